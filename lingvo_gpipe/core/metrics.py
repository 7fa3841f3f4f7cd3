"""Lingvo-style metrics: NestedMaps of (value, weight) pairs, and merging them.

`value` is a mean over `weight` items (tokens, examples), so the metrics of
several batches or micro-batches merge exactly as sum(value * weight) / sum(weight).
"""

import itertools

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


def _ProbeInput(like, sizes, batch_dim, index):
  """Random values shaped like micro-batch tensor `like` (the index-th of loss_fn's tensors),
  for a batch of micro-batches of `sizes` rows. Micro-batch i of M draws its floats from
  [i + 0.25, i + 0.75) / M (every other tensor in reverse order, so that an output minus a
  target still differs between micro-batches): within (0, 1), so logs and roots of outputs
  and of 1 - outputs (probabilities) stay finite, and from a range of their own, so that a
  loss reading batch statistics (the square of a mean, a variance, centering by the batch's
  mean) gives a whole-batch value far from any combination of its micro-batch values,
  however many values it averages. Made by random
  ops, not a constant: a probe in a step's graph would otherwise hold the whole batch's
  outputs in the graph. 16-bit floats are probed as float32: their rounding would hide a
  small batch-statistic term, and how a loss merges does not depend on its precision."""
  shape = like.shape.as_list()
  shape[batch_dim] = sum(sizes)
  if None in shape:
    raise ValueError(
        'a schedule that calls loss_fn on each micro-batch probes it on random outputs of the '
        f"batch's shape, but the outputs' shape {like.shape} has an unknown dimension besides "
        "the batch: use schedule='gpipe', or give the outputs a fixed shape (pad them)")
  if not like.dtype.is_floating:
    return tf.zeros(shape, like.dtype)
  parts = len(sizes)
  order = range(parts) if index % 2 == 0 else reversed(range(parts))
  offsets = np.repeat(np.array(list(order)) + 0.25, sizes)
  offsets = offsets.reshape([-1 if d == batch_dim else 1 for d in range(len(shape))])
  dtype = tf.float64 if like.dtype == tf.float64 else tf.float32
  values = tf.random.stateless_uniform(shape, [index, 0], 0.0, 0.5, dtype)
  return (values + offsets.astype(dtype.as_numpy_dtype)) / parts


def _Combination(whole, parts, sizes):
  """'sum' or 'mean' if the whole batch's value is the sum of the micro-batches' values or
  their mean weighted by their sizes, else None; '' if the values cannot tell (all zero, or
  not all finite)."""
  whole, parts = float(whole), np.asarray(parts, np.float64)
  scale = max(abs(whole), float(np.abs(parts).max()))
  if not np.isfinite(scale) or scale == 0.0:
    return ''
  for rule, value in (('sum', parts.sum()), ('mean', np.average(parts, weights=sizes))):
    if abs(whole - value) <= 1e-4 * scale:
      return rule
  return None


def _CombinationWhenRun(whole, parts, sizes, message):
  """_Combination of values known only when the step runs: (is_sum, told, check), bool
  tensors: True for 'sum' (else 'mean'); whether the probe's values tell (not all zero, all
  finite); and whether one of the two holds or they do not tell (`message` if not)."""
  whole = tf.cast(whole, tf.float64)
  parts = tf.cast(tf.stack(parts), tf.float64)
  total = tf.reduce_sum(parts)
  mean = tf.reduce_sum(parts * np.asarray(sizes, np.float64) / sum(sizes))
  tolerance = 1e-4 * tf.maximum(tf.abs(whole), tf.reduce_max(tf.abs(parts)))
  told = tf.math.is_finite(tolerance) & (tolerance > 0)
  is_sum = tf.abs(whole - total) <= tolerance
  holds = is_sum | (tf.abs(whole - mean) <= tolerance) | ~told
  return is_sum, told, _Check(holds, message, 'whole batch, sum, mean:', whole, total, mean)


def _WeightedMeanWhenRun(value, pairs, message):
  """A _Check, when the step runs, that (value, weight) pairs merge to `value`."""
  values = tf.cast(tf.stack([v for v, _ in pairs]), tf.float64)
  weights = tf.cast(tf.stack([w for _, w in pairs]), tf.float64)
  value = tf.cast(value, tf.float64)
  merged = tf.math.divide_no_nan(tf.reduce_sum(values * weights), tf.reduce_sum(weights))
  holds = (tf.equal(tf.reduce_sum(weights), 0.0) |
           (tf.abs(value - merged) <= 1e-4 * tf.maximum(tf.abs(value), tf.abs(merged))) |
           ~tf.math.is_finite(value - merged))
  return _Check(holds, message, 'whole batch, weighted mean:', value, merged)


def _Check(holds, message, *data):
  """`holds` (a bool tensor) once an assertion of it with `message` and `data` has run."""
  with tf.control_dependencies([tf.debugging.Assert(holds, [message, *data])]):
    return tf.identity(holds)


def _Guarded(pair, checks):
  """A (value, weight) metric whose weight is NaN unless every check holds: XLA compiles
  assertions away, so a loss that failed its check still cannot train silently."""
  value, weight = pair
  value = tf.convert_to_tensor(value)
  if not value.dtype.is_floating:  # A count, say: it cannot be NaN, nor trains anything.
    return pair
  weight = tf.cast(weight, value.dtype)
  holds = tf.reduce_all(tf.stack(checks))
  return value, tf.where(holds, weight, tf.constant(np.nan, value.dtype))


def MicroBatchLoss(loss_fn, num_parts, batch_size, batch_dim, schedule):
  """loss_fn for a schedule that calls it on each of num_parts micro-batches alone.

  Micro-batch (value, weight) metrics merge as sum(value * weight) / sum(weight)
  by their definition. A bare scalar says nothing of how it merges, so the
  first call probes loss_fn on random outputs of a whole batch and of its
  micro-batches: a scalar that is the sum of its micro-batch values becomes
  (value * num_parts, 1 / num_parts), a mean (value, rows / batch_size), its
  micro-batch's share of the batch, which weighs micro-batches of uneven size
  right; anything else (a max, a normalization by batch statistics, a loss
  reading whole-batch tensors other than its arguments) is refused with a
  ValueError. When micro-batches differ in size (num_parts does not divide
  batch_size, or it is unknown at trace time), (value, weight) pairs are probed
  too: one whose whole-batch value is not the weighted mean of its micro-batch
  values (a weight that does not count the items value is a mean over) is
  refused. So every schedule gives the loss and gradients that loss_fn gives on
  the whole batch.

  The probe runs eagerly, once per trace. A loss that reads tensors of the step
  being traced (a scale computed from the step, say) cannot run eagerly: it is
  probed in the step's graph instead, every time the step runs (num_parts + 1
  more loss_fn calls on the probe's outputs), and a loss that does not merge
  fails the step with the same message (under XLA, which drops assertions, its
  weight is NaN: the step's loss and gradients are NaN). A loss that is 0 or not
  finite on the probe's outputs cannot be told: refused, or in the step's graph
  accepted only for micro-batch values that are 0 or not finite too (a scale of 0).

  Args:
    loss_fn: the caller's loss function.
    num_parts: the micro-batches of all replicas.
    batch_size: the whole batch's rows, an int or (unknown at trace time) a tensor.
    batch_dim: the batch dimension of loss_fn's arguments.
    schedule: the schedule's name, for messages.
  """
  rules = {}  # Name -> 'sum', 'mean' or, known when the step runs, (is_sum, told, message).
  checks = []  # _Checks of a probe in the step's graph, guarding every micro-batch's metrics.
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

  def ProbeValues(args, sizes):
    index = itertools.count()
    whole = tf.nest.map_structure(
        lambda x: _ProbeInput(x, sizes, batch_dim, next(index)) if isinstance(x, tf.Tensor)
        else x, args)
    return [Call(*part) for part in [whole] + microbatch.Split(whole, num_parts, batch_dim)]

  def Probe(args):
    # A batch of unknown size is probed with one that num_parts does not divide either.
    sizes = microbatch.Sizes(batch_size if static else 2 * num_parts + 1, num_parts)
    try:
      with tf.init_scope():
        values = ProbeValues(args, sizes)
      when_run = False
    except ValueError:  # Call's: loss_fn failed.
      if tf.executing_eagerly():
        raise
      values = ProbeValues(args, sizes)  # It reads tensors of the step: probe in its graph.
      when_run = True
    for name, value in _Scalars(values[0]).items():
      parts = [_Scalars(v)[name] for v in values[1:]]
      head = f'schedule={schedule!r} calls loss_fn on each of {num_parts} micro-batches, but its '
      advice = ('return (value, weight) pairs, which merge as sum(value * weight) / '
                "sum(weight), or use schedule='gpipe'.")
      message = head + f'{name!r} on a whole batch' + '{} is neither the sum{} nor the mean{} ' \
          'of its micro-batch values: ' + advice
      untold = (head + f'{name!r} on the probe\'s random outputs is 0 or not finite, so whether '
                'it is the sum or the mean of its micro-batch values cannot be told: ' + advice)
      if when_run:
        is_sum, told, check = _CombinationWhenRun(value, parts, sizes,
                                                  message.format('', '', ''))
        rules[name] = (is_sum, told, untold + " (A micro-batch's value is not 0.)")
        checks.append(check)
        continue
      whole, parts = _Floats(value), [_Floats(part) for part in parts]
      rules[name] = _Combination(whole, parts, sizes)
      if not rules[name]:
        raise ValueError(untold if rules[name] == '' else message.format(
            f' ({whole:.6g})', f' ({np.sum(parts):.6g})',
            f' ({np.average(parts, weights=sizes):.6g})'))
    for name, (value, weight) in (_Pairs(values[0]) if uneven else {}).items():
      message = (f'schedule={schedule!r} calls loss_fn on each of {num_parts} micro-batches of '
                 f'uneven sizes {sizes}, but its {name!r} (value, weight) on a whole batch'
                 '{} is not the weighted mean{} of its micro-batch values: the weight must '
                 "count the items the value is a mean over; or use schedule='gpipe', or a batch "
                 'that num_micro_batches divides.')
      pairs = [_Pairs(v)[name] for v in values[1:]]
      if when_run:
        checks.append(_WeightedMeanWhenRun(value, pairs, message.format('', '')))
        continue
      pairs = np.asarray([[_Floats(x) for x in pair] for pair in pairs], np.float64)
      if not np.sum(pairs[:, 1]):
        continue  # No item to weigh in the probe's outputs: the pair's definition stands.
      value, merged = _Floats(value), float(np.sum(pairs[:, 0] * pairs[:, 1]) / np.sum(pairs[:, 1]))
      if not abs(value - merged) <= 1e-4 * max(abs(value), abs(merged)):
        raise ValueError(message.format(f' ({value:.6g}, weight {_Floats(weight):.6g})',
                                        f' ({merged:.6g})'))

  def Weighted(value, rule, args, call_checks):
    def Total():
      return (value * num_parts, tf.constant(1.0 / num_parts, value.dtype))

    def Mean():
      rows = microbatch.BatchSize(args, batch_dim)
      return (value, tf.cast(rows, value.dtype) / tf.cast(batch_size, value.dtype))

    if isinstance(rule, str):
      return Total() if rule == 'sum' else Mean()
    is_sum, told, untold = rule  # Known when the step runs.
    # A probe that cannot tell is fine for a value that is 0 (a scale of 0) or not finite.
    call_checks.append(_Check(told | tf.equal(value, 0) | ~tf.math.is_finite(value), untold))
    return tuple(tf.where(is_sum, t, m) for t, m in zip(Total(), Mean()))

  def MicroBatchLossFn(*args):
    value = Call(*args)
    AsMetrics(value)  # A ValueError unless its metrics are scalars or (value, weight) pairs.
    if not probed and (_Scalars(value) or uneven):
      Probe(args)
      probed.append(True)
    call_checks = list(checks)
    if isinstance(value, dict):
      value = type(value)({k: v if _IsPair(v) else Weighted(tf.convert_to_tensor(v), rules[k],
                                                            args, call_checks)
                           for k, v in value.items()})
    elif not _IsPair(value):
      value = Weighted(tf.convert_to_tensor(value), rules['loss'], args, call_checks)
    if not call_checks:
      return value
    if isinstance(value, dict):
      return type(value)({k: _Guarded(v, call_checks) for k, v in value.items()})
    return _Guarded(value, call_checks)

  return MicroBatchLossFn


def _Floats(value):
  """An eager probe's scalar as a Python float (via float64: numpy cannot read bfloat16)."""
  with tf.init_scope():
    return float(tf.cast(value, tf.float64))


def _Scalars(value):
  """name -> bare scalar metric of loss_fn's value (pairs left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if not _IsPair(v)}



def _Pairs(value):
  """name -> (value, weight) metric of loss_fn's value (bare scalars left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if _IsPair(v)}
