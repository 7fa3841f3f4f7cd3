"""The loss contract: how the losses of micro-batches merge into the whole batch's.

Every schedule but fill-drain ('gpipe') calls loss_fn on each micro-batch alone, as soon as
it leaves the last stage, so the batch's loss is merged from the micro-batches' ones:

  * a Lingvo (value, weight) pair, value a mean over `weight` items, merges exactly as
    sum(value * weight) / sum(weight) (metrics.MergeMetrics): the tasks' own contract;
  * a bare scalar says nothing of how it merges, so its caller declares it:
    loss_reduction='mean' (a mean over the batch's rows: a micro-batch's value weighs its
    share of them) or 'sum' (a sum over rows: the micro-batches' values add up).

A bare scalar without a declaration is a ValueError, not a guess. Whether a declaration is
true of the loss (a mean over some rows only, or batch statistics, merge to other numbers)
is what `--mode=check_pipeline` verifies: pipelined training against unpipelined.
"""

from typing import Any, Callable, Optional

import tensorflow as tf

from lingvo_gpipe.pipeline import metrics
from lingvo_gpipe.pipeline import microbatch

REDUCTIONS = ('mean', 'sum')


def CheckReduction(reduction: Optional[str]) -> None:
  """Raises a ValueError unless `reduction` is None or one of REDUCTIONS."""
  if reduction is not None and reduction not in REDUCTIONS:
    raise ValueError(f'loss_reduction={reduction!r}; expected None, '
                     f'{" or ".join(map(repr, REDUCTIONS))}.')


def _IsPair(value):
  return isinstance(value, (tuple, list))


class MicroBatchLoss:
  """loss_fn for a schedule that calls it on each of num_parts micro-batches alone: its
  bare scalars become (value, weight) pairs by the declared reduction, so the micro-batches'
  metrics merge to the whole batch's; its pairs pass as they are.

  Args:
    loss_fn: the caller's loss function.
    reduction: None, 'mean' or 'sum' (CheckReduction): how its bare scalars merge.
    num_parts: the micro-batches of all replicas.
    batch_size: the whole batch's rows, an int or (unknown at trace time) a tensor.
    batch_dim: the batch dimension of loss_fn's arguments.
    schedule: the schedule's name, for messages.
  """

  def __init__(self, loss_fn: Callable[..., Any], reduction: Optional[str], num_parts: int,
               batch_size, batch_dim: int, schedule: str):
    CheckReduction(reduction)
    self._loss_fn = loss_fn
    self._reduction = reduction
    self._num_parts = num_parts
    self._batch_size = batch_size
    self._batch_dim = batch_dim
    self._schedule = schedule
    # The dtypes of loss_fn's metrics, for zeros on a micro-batch traced without rows.
    self._dtypes = None

  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args):
    if self._num_parts == 1:  # The one micro-batch is the batch: its loss is loss_fn's.
      return self._Call(*args)
    empty = microbatch.StaticBatchSize(args, self._batch_dim) == 0
    if empty and self._dtypes is not None:
      # Zeros, not loss_fn's value: some fail on no rows (Keras's, eagerly).
      value = _MapScalars(lambda dtype: tf.zeros([], dtype), self._dtypes)
    else:
      value = self._Call(*args)
      value = _NoRowsAsZero(value) if empty else value
      metrics.AsMetrics(value)  # A ValueError unless its metrics are scalars or pairs.
      if self._dtypes is None:
        self._dtypes = _MapScalars(lambda x: tf.convert_to_tensor(x).dtype, value)

    def Weighted(name, metric):
      return metric if _IsPair(metric) else self._Weighted(name, _FloatScalar(metric), args)

    if isinstance(value, dict):
      return type(value)({k: Weighted(k, v) for k, v in value.items()})
    return Weighted('loss', value)

  def _Call(self, *args):
    try:
      return self._loss_fn(*args)
    except (ValueError, TypeError, AssertionError, tf.errors.OpError) as e:
      raise ValueError(f'schedule={self._schedule!r} calls loss_fn on each micro-batch\'s '
                       'outputs alone (a loss must read nothing but them), and it failed on '
                       f'them: {e}') from None

  def _Weighted(self, name, value, args):
    """A micro-batch's bare scalar as (value, weight) by the declared reduction."""
    if self._reduction is None:
      raise ValueError(
          f'loss_fn returned a bare scalar {name!r}, and schedule={self._schedule!r} calls '
          "it on each micro-batch: say how micro-batches merge, by returning (value, "
          "weight) pairs (value a mean over weight items) or by passing "
          "loss_reduction='mean' (a mean over the batch's rows) or 'sum' (a sum over "
          "them); or use schedule='gpipe', which calls it once on the whole batch.")
    rows = microbatch.BatchSize(args, self._batch_dim)
    if self._reduction == 'mean':
      return value, tf.cast(rows, value.dtype) / tf.cast(self._batch_size, value.dtype)
    # A sum: the micro-batch's value times M, weighing 1 / M; 0 for a micro-batch without
    # rows, whatever loss_fn made of them (0 times a mean over none).
    if not (isinstance(rows, int) and rows > 0):
      value = tf.where(rows > 0, value, tf.zeros_like(value))
    return value * self._num_parts, tf.constant(1.0 / self._num_parts, value.dtype)


def _MapScalars(fn, value):
  """loss_fn's value with fn of each scalar (both of a (value, weight) pair)."""
  def Map(metric):
    return tuple(map(fn, metric)) if _IsPair(metric) else fn(metric)

  if isinstance(value, dict):
    return type(value)({k: Map(v) for k, v in value.items()})
  return Map(value)


def _NoRowsAsZero(value):
  """An empty micro-batch's metrics, those of shape (0,) summed: a Keras loss returns its
  values of no examples unreduced, and their sum, 0, weighs nothing."""
  def Summed(metric):
    if _IsPair(metric) or tf.convert_to_tensor(metric).shape.as_list() != [0]:
      return metric
    return tf.reduce_sum(metric)

  if isinstance(value, dict):
    return type(value)({k: Summed(v) for k, v in value.items()})
  return Summed(value)


def _FloatScalar(value):
  """A bare metric as a float tensor (an int count too: its weight is a fraction)."""
  value = tf.convert_to_tensor(value)
  return value if value.dtype.is_floating else tf.cast(value, tf.float32)


def RefuseWeightsRead(layer, read) -> None:
  """Refuses a loss_fn that read some of a pipeline `layer`'s weights (a weight penalty): its
  backward starts from the gradients of the outputs, so that gradient would be lost. `read`:
  the variables loss_fn read (usually none, so the layer's own are not listed)."""
  own = {v.ref() for v in layer.trainable_variables} if read else set()
  names = [v.name for v in read if v.ref() in own]
  if names:
    raise ValueError(f'loss_fn reads weights of the pipeline {layer.path} ({names}): their '
                     'gradient through the loss would be lost. Add a weight penalty to the '
                     'gradients ForwardBackward returns, outside it.')
