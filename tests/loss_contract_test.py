"""Tests of the loss contract: micro-batch metrics that merge to the whole batch's, by plain
TensorFlow math on the whole batch."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import loss_contract
from lingvo_gpipe.pipeline import metrics
from lingvo_gpipe.pipeline import microbatch


def _Merged(loss_fn, reduction, y, num_parts):
  """loss_fn's merged metrics over y split into num_parts micro-batches."""
  fn = loss_contract.MicroBatchLoss(loss_fn, reduction, num_parts, y.shape[0], 0, '1f1b')
  return metrics.MergeMetrics([metrics.AsMetrics(fn(part))
                               for part in microbatch.Split(y, num_parts, 0)])


@pytest.mark.parametrize('rows', [12, 10, 3])
def testDeclaredMeansSumsAndPairsMergeToTheWholeBatchsValue(rows):
  """Even and uneven micro-batches (10 rows: 3, 3, 2, 2), and one without rows (3 rows)."""
  y = tf.random.stateless_normal([rows, 5], [1, 2])
  cases = [(lambda t: tf.reduce_mean(t ** 2), 'mean'),
           (lambda t: tf.reduce_sum(t ** 2), 'sum'),
           (lambda t: (tf.reduce_mean(t ** 2), tf.cast(tf.shape(t)[0], tf.float32)), None)]
  for loss_fn, reduction in cases:
    merged = _Merged(loss_fn, reduction, y, 4)
    whole = tf.nest.flatten(loss_fn(y))[0]
    np.testing.assert_allclose(merged.loss[0], whole, rtol=1e-5)


def testEveryBareMetricOfANestedMapTakesTheReduction():
  y = tf.random.stateless_normal([8, 3], [3, 4])

  def LossFn(t):
    return py_utils.NestedMap(loss=tf.reduce_sum(t), count=tf.shape(t)[0])

  merged = _Merged(LossFn, 'sum', y, 4)
  np.testing.assert_allclose(merged.loss[0], tf.reduce_sum(y), rtol=1e-5)
  assert merged.count[0].dtype == tf.float32 and float(merged.count[0]) == 8.0


def testABareScalarWithoutAReductionIsRefusedAndOneMicroBatchNeedsNone():
  y = tf.ones([4, 2])
  with pytest.raises(ValueError, match=r"bare scalar 'loss', and schedule='1f1b' calls it on "
                     r"each micro-batch.*loss_reduction='mean'.*schedule='gpipe'"):
    _Merged(tf.reduce_mean, None, y, 2)
  assert float(_Merged(tf.reduce_mean, None, y, 1).loss[0]) == 1.0
  with pytest.raises(ValueError, match=r"loss_reduction='total'; expected None, 'mean' or "
                     r"'sum'"):
    loss_contract.MicroBatchLoss(tf.reduce_mean, 'total', 2, 4, 0, '1f1b')


def testALossFailingOnAMicroBatchIsOneValueErrorNamingTheSchedule():
  whole = tf.zeros([8, 2])
  with pytest.raises(ValueError, match=r"schedule='1f1b' calls loss_fn on each micro-batch's "
                     'outputs alone'):
    _Merged(lambda t: tf.reduce_mean(t - whole), 'mean', tf.ones([8, 2]), 4)
