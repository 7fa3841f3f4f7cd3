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


def _ProbeInput(like, num_parts, batch_dim, rng):
  """Random values shaped like micro-batch tensor `like`, for a batch of num_parts of them."""
  shape = like.shape.as_list()
  if None in shape:
    raise ValueError(f'outputs of shape {like.shape} are not fully static')
  shape[batch_dim] *= num_parts
  if like.dtype.is_floating:  # Positive, so logs and roots of outputs stay finite.
    return tf.constant(rng.uniform(0.5, 1.5, shape), like.dtype)
  return tf.zeros(shape, like.dtype)


def _Combination(whole, parts):
  """'sum' or 'mean' if the whole batch's value is that of the micro-batches', else None."""
  whole, parts = float(whole), np.asarray(parts, np.float64)
  scale = max(abs(whole), float(np.abs(parts).max()))
  if not np.isfinite(scale) or scale == 0.0:
    return None
  for rule, value in (('sum', parts.sum()), ('mean', parts.mean())):
    if abs(whole - value) <= 1e-4 * scale:
      return rule
  return None


def MicroBatchLoss(loss_fn, num_parts, batch_dim, schedule):
  """loss_fn for a schedule that calls it on each of num_parts micro-batches alone.

  Micro-batch (value, weight) metrics merge as sum(value * weight) / sum(weight)
  by their definition. A bare scalar says nothing of how it merges, so the
  first call probes loss_fn on random outputs of a whole batch and of its
  micro-batches: a scalar that is the sum of its micro-batch values becomes
  (value * num_parts, 1 / num_parts), a mean (value, 1); anything else (a max,
  a normalization by batch statistics, a loss reading tensors other than its
  arguments) is refused with a ValueError. So every schedule gives the loss and
  gradients that loss_fn gives on the whole batch.
  """
  rules = {}

  def Call(*args):
    try:
      return loss_fn(*args)
    except (ValueError, TypeError, tf.errors.OpError) as e:
      raise ValueError(f'schedule={schedule!r} calls loss_fn on each micro-batch\'s outputs '
                       'alone (a loss must read nothing but them), and it failed on them: '
                       f'{e}') from None

  def Probe(args):
    rng = np.random.default_rng(0)
    with tf.init_scope():
      whole = tf.nest.map_structure(
          lambda x: _ProbeInput(x, num_parts, batch_dim, rng) if isinstance(x, tf.Tensor)
          else x, args)
      values = [Call(*part) for part in [whole] + microbatch.Split(whole, num_parts, batch_dim)]
    for name, value in _Scalars(values[0]).items():
      parts = [_Scalars(v)[name] for v in values[1:]]
      rule = _Combination(value, parts)
      if rule is None:
        raise ValueError(
            f'schedule={schedule!r} calls loss_fn on each of {num_parts} micro-batches, but its '
            f'{name!r} on a whole batch ({float(value):.6g}) is neither the sum '
            f'({float(np.sum(parts)):.6g}) nor the mean ({float(np.mean(parts)):.6g}) of its '
            'micro-batch values: return (value, weight) pairs, which merge as '
            "sum(value * weight) / sum(weight), or use schedule='gpipe'.")
      rules[name] = rule

  def Weighted(value, rule):
    if rule == 'sum':
      return (value * num_parts, tf.constant(1.0 / num_parts, value.dtype))
    return value

  def MicroBatchLossFn(*args):
    value = Call(*args)
    if _Scalars(value) and not rules:
      Probe(args)
    if isinstance(value, dict):
      return type(value)({k: v if _IsPair(v) else Weighted(tf.convert_to_tensor(v), rules[k])
                          for k, v in value.items()})
    return value if _IsPair(value) else Weighted(tf.convert_to_tensor(value), rules['loss'])

  return MicroBatchLossFn


def _Scalars(value):
  """name -> bare scalar metric of loss_fn's value (pairs left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if not _IsPair(v)}

