"""Lingvo-style metrics: NestedMaps of (value, weight) pairs, and merging them.

`value` is a mean over `weight` items (tokens, examples), so the metrics of
several batches or micro-batches merge exactly as sum(value * weight) / sum(weight).
"""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import microbatch
from lingvo_gpipe.core import py_utils


def _MetricPair(name, value):
  """A metric as (value, weight); a bare scalar has weight 1."""
  if isinstance(value, (tuple, list)):
    if len(value) != 2:
      raise ValueError(f'Metric {name!r} must be a scalar or (value, weight), got {value!r}.')
    mean = tf.convert_to_tensor(value[0])
    pair = (mean, tf.cast(value[1], mean.dtype))
  else:
    pair = (tf.convert_to_tensor(value), None)
  if pair[0].shape.rank != 0:
    raise ValueError(f'Metric {name!r} must be a scalar, got shape {pair[0].shape}.')
  return pair if pair[1] is not None else (pair[0], tf.ones([], pair[0].dtype))


def AsMetrics(value):
  """loss_fn's value as a NestedMap name -> (value, weight) holding 'loss'."""
  if isinstance(value, dict):
    if 'loss' not in value:
      raise ValueError(f"loss_fn returned metrics {sorted(value)} without a 'loss'.")
    return py_utils.NestedMap({k: _MetricPair(k, v) for k, v in value.items()})
  return py_utils.NestedMap(loss=_MetricPair('loss', value))


def MergeMetrics(metrics_list):
  """Merges (value, weight) metrics of several batches: sum(v * w) / sum(w)."""
  merged = py_utils.NestedMap()
  for name in metrics_list[0]:
    weight = tf.add_n([m[name][1] for m in metrics_list])
    total = tf.add_n([m[name][0] * m[name][1] for m in metrics_list])
    merged[name] = (total / weight, weight)
  return merged


def _IsPair(value):
  return isinstance(value, (tuple, list))


def _ProbeInput(like, sizes, batch_dim, rng):
  """Random values shaped like micro-batch tensor `like`, for a batch of micro-batches of
  `sizes` rows. Micro-batch i's floats lie in [0.5, 1) + i / len(sizes): positive, so logs and
  roots of outputs stay finite, and from a range of their own, so that a loss reading batch
  statistics (the square of a mean, a variance, centering by the batch's mean) gives a
  whole-batch value far from any combination of its micro-batch values, however many values
  it averages (on values of one distribution, its micro-batches' statistics agree with the
  batch's to within the probe's tolerance)."""
  shape = like.shape.as_list()
  shape[batch_dim] = sum(sizes)
  if None in shape:
    raise ValueError(f'outputs of shape {like.shape} are not fully static')
  if not like.dtype.is_floating:
    return tf.zeros(shape, like.dtype)
  offsets = np.repeat(np.arange(len(sizes)) / len(sizes), sizes)
  offsets = offsets.reshape([-1 if d == batch_dim else 1 for d in range(len(shape))])
  return tf.constant(rng.uniform(0.5, 1.0, shape) + offsets, like.dtype)


def _Combination(whole, parts, sizes):
  """'sum' or 'mean' if the whole batch's value is the sum of the micro-batches' values or
  their mean weighted by their sizes, else None."""
  whole, parts = float(whole), np.asarray(parts, np.float64)
  scale = max(abs(whole), float(np.abs(parts).max()))
  if not np.isfinite(scale) or scale == 0.0:
    return None
  for rule, value in (('sum', parts.sum()), ('mean', np.average(parts, weights=sizes))):
    if abs(whole - value) <= 1e-4 * scale:
      return rule
  return None


def MicroBatchLoss(loss_fn, num_parts, batch_size, batch_dim, schedule):
  """loss_fn for a schedule that calls it on each of num_parts micro-batches alone.

  Micro-batch (value, weight) metrics merge as sum(value * weight) / sum(weight)
  by their definition. A bare scalar says nothing of how it merges, so the
  first call probes loss_fn on random outputs of a whole batch and of its
  micro-batches: a scalar that is the sum of its micro-batch values becomes
  (value * num_parts, 1 / num_parts), a mean (value, rows / batch_size), its
  micro-batch's share of the batch, which weighs micro-batches of uneven size
  right; anything else (a max, a normalization by batch statistics, a loss
  reading tensors other than its arguments) is refused with a ValueError. When
  micro-batches differ in size (num_parts does not divide batch_size, or it is
  unknown at trace time), (value, weight) pairs are probed too: one whose
  whole-batch value is not the weighted mean of its micro-batch values (a
  weight that does not count the items value is a mean over) is refused. So
  every schedule gives the loss and gradients that loss_fn gives on the whole
  batch.

  Args:
    loss_fn: the caller's loss function.
    num_parts: the micro-batches of all replicas.
    batch_size: the whole batch's rows, an int or (unknown at trace time) a tensor.
    batch_dim: the batch dimension of loss_fn's arguments.
    schedule: the schedule's name, for messages.
  """
  rules = {}
  probed = []
  static = isinstance(batch_size, int)
  uneven = not static or batch_size % num_parts != 0

  def Call(*args):
    try:
      return loss_fn(*args)
    except (ValueError, TypeError, tf.errors.OpError) as e:
      raise ValueError(f'schedule={schedule!r} calls loss_fn on each micro-batch\'s outputs '
                       'alone (a loss must read nothing but them), and it failed on them: '
                       f'{e}') from None

  def Probe(args):
    rng = np.random.default_rng(0)
    # A batch of unknown size is probed with one that num_parts does not divide either.
    rows = batch_size if static else 2 * num_parts + 1
    sizes = microbatch.Sizes(rows, num_parts)
    with tf.init_scope():
      whole = tf.nest.map_structure(
          lambda x: _ProbeInput(x, sizes, batch_dim, rng) if isinstance(x, tf.Tensor) else x,
          args)
      values = [Call(*part) for part in [whole] + microbatch.Split(whole, num_parts, batch_dim)]
    for name, value in _Scalars(values[0]).items():
      parts = [_Scalars(v)[name] for v in values[1:]]
      rule = _Combination(value, parts, sizes)
      if rule is None:
        raise ValueError(
            f'schedule={schedule!r} calls loss_fn on each of {num_parts} micro-batches, but its '
            f'{name!r} on a whole batch ({float(value):.6g}) is neither the sum '
            f'({float(np.sum(parts)):.6g}) nor the mean ({np.average(parts, weights=sizes):.6g}) '
            'of its micro-batch values: return (value, weight) pairs, which merge as '
            "sum(value * weight) / sum(weight), or use schedule='gpipe'.")
      rules[name] = rule
    for name, (value, weight) in (_Pairs(values[0]) if uneven else {}).items():
      pairs = np.asarray([[float(x) for x in _Pairs(v)[name]] for v in values[1:]], np.float64)
      if not np.sum(pairs[:, 1]):
        continue  # No item to weigh in the probe's outputs: the pair's definition stands.
      value, merged = float(value), float(np.sum(pairs[:, 0] * pairs[:, 1]) / np.sum(pairs[:, 1]))
      if not abs(value - merged) <= 1e-4 * max(abs(value), abs(merged)):
        raise ValueError(
            f'schedule={schedule!r} calls loss_fn on each of {num_parts} micro-batches of '
            f'uneven sizes {sizes}, but its {name!r} (value, weight) on a whole batch '
            f'({value:.6g}, weight {float(weight):.6g}) is not the weighted mean '
            f'({merged:.6g}) of its micro-batch values: the weight must count the items the '
            "value is a mean over; or use schedule='gpipe', or a batch that "
            f'num_micro_batches divides.')

  def Weighted(value, rule, args):
    if rule == 'sum':
      return (value * num_parts, tf.constant(1.0 / num_parts, value.dtype))
    rows = microbatch.BatchSize(args, batch_dim)
    return (value, tf.cast(rows, value.dtype) / tf.cast(batch_size, value.dtype))

  def MicroBatchLossFn(*args):
    value = Call(*args)
    if not probed and (_Scalars(value) or uneven):
      Probe(args)
      probed.append(True)
    if isinstance(value, dict):
      return type(value)({k: v if _IsPair(v) else Weighted(tf.convert_to_tensor(v), rules[k],
                                                           args)
                          for k, v in value.items()})
    return value if _IsPair(value) else Weighted(tf.convert_to_tensor(value), rules['loss'], args)

  return MicroBatchLossFn


def _Scalars(value):
  """name -> bare scalar metric of loss_fn's value (pairs left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if not _IsPair(v)}



def _Pairs(value):
  """name -> (value, weight) metric of loss_fn's value (bare scalars left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if _IsPair(v)}
