"""Lingvo-style metrics: NestedMaps of (value, weight) pairs, and merging them.

`value` is a mean over `weight` items (tokens, examples), so the metrics of
several batches or micro-batches merge exactly as sum(value * weight) / sum(weight).
How a loss_fn's bare scalar merges over micro-batches is declared (loss_contract.py).
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils


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
  """Merges (value, weight) metrics of several batches: sum(v * w) / sum(w).

  A value of weight 0 adds nothing, also when it is NaN: the mean over no items of an
  empty micro-batch.
  """
  merged = py_utils.NestedMap()
  for name in metrics_list[0]:
    weight = tf.add_n([m[name][1] for m in metrics_list])
    total = tf.add_n([_TimesWeight(*m[name]) for m in metrics_list])
    merged[name] = (total / weight, weight)
  return merged


def _TimesWeight(value, weight):
  """value * weight; 0 for a weight of 0, whatever the value (an int cannot be NaN)."""
  return tf.math.multiply_no_nan(value, weight) if value.dtype.is_floating else value * weight
