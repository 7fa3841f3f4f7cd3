"""Tests of lingvo_gpipe.pipeline.microbatch and lingvo_gpipe.foundation.devices."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import devices
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import microbatch


def _Batch():
  return py_utils.NestedMap(
      x=tf.reshape(tf.range(24.0), [6, 4]), ids=tf.range(6), note=None)


def testSplitMergeRoundTrip():
  batch = _Batch()
  pieces = microbatch.Split(batch, 3)
  assert len(pieces) == 3
  np.testing.assert_array_equal(pieces[1].x.numpy(), batch.x.numpy()[2:4])
  np.testing.assert_array_equal(pieces[2].ids.numpy(), [4, 5])
  assert pieces[0].note is None
  merged = microbatch.Merge(pieces)
  np.testing.assert_array_equal(merged.x.numpy(), batch.x.numpy())
  np.testing.assert_array_equal(merged.ids.numpy(), batch.ids.numpy())


def testSplitAlongOtherDimension():
  x = tf.reshape(tf.range(12), [2, 6])
  pieces = microbatch.Split((x,), 2, batch_dim=1)
  np.testing.assert_array_equal(pieces[1][0].numpy(), [[3, 4, 5], [9, 10, 11]])
  assert microbatch.BatchSize((x,), 1) == 6


@pytest.mark.parametrize('kwargs,match', [
    (dict(num_micro_batches=8), 'A batch of 6 examples is smaller than num_micro_batches=8'),
    (dict(num_micro_batches=4, num_replicas=2), r'smaller than num_micro_batches=4 x '
     r'num_replicas=2: every micro-batch needs at least one example'),
    (dict(num_micro_batches=0), 'positive int'),
    (dict(micro_batch_size=0), 'positive int'),
])
def testBadMicroBatchCounts(kwargs, match):
  with pytest.raises(ValueError, match=match):
    microbatch.NumMicroBatches(6, **kwargs)
  with pytest.raises(ValueError, match='micro_batch_size=2 needs a batch size known at trace'):
    microbatch.NumMicroBatches(None, micro_batch_size=2)


def testMicroBatchSize():
  assert microbatch.NumMicroBatches(6, micro_batch_size=2) == 3
  assert microbatch.NumMicroBatches(6, micro_batch_size=4) == 2  # 3, 3.
  assert microbatch.NumMicroBatches(7, micro_batch_size=2, num_replicas=2) == 2  # 4=2+2, 3=2+1.
  assert microbatch.NumMicroBatches(6, num_micro_batches=4) == 4  # 2, 2, 1, 1.
  assert microbatch.NumMicroBatches(3, num_micro_batches=4, allow_empty=True) == 4
  assert microbatch.NumMicroBatches(None, num_micro_batches=4) == 4


def testUnevenSplit():
  x = tf.reshape(tf.range(20), [10, 2])
  assert microbatch.Sizes(10, 4) == [3, 3, 2, 2]
  assert microbatch.Offsets([3, 3, 2, 2]) == [0, 3, 6, 8]
  pieces = microbatch.Split((x, None), 4)
  assert [p[0].shape[0] for p in pieces] == [3, 3, 2, 2]
  np.testing.assert_array_equal(pieces[2][0].numpy(), x.numpy()[6:8])
  np.testing.assert_array_equal(microbatch.Merge(pieces)[0].numpy(), x.numpy())


def testSplitOfUnknownBatchSize():
  """A batch of unknown size at trace time splits at run time as a known one would."""
  @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.int32)])
  def SplitSizes(x):
    assert microbatch.BatchSize((x,), 0).dtype == tf.int32
    pieces = microbatch.Split(x, 4)
    assert pieces[0].shape.as_list() == [None, 2]
    return [tf.shape(p)[0] for p in pieces], microbatch.Merge(pieces)

  for rows, expected in ((10, [3, 3, 2, 2]), (4, [1, 1, 1, 1]), (1, [1, 0, 0, 0])):
    x = tf.reshape(tf.range(2 * rows), [rows, 2])
    sizes, merged = SplitSizes(x)
    assert [int(s) for s in sizes] == expected
    np.testing.assert_array_equal(merged.numpy(), x.numpy())


def testBatchSizeChecks():
  with pytest.raises(ValueError, match=r'disagree on the batch size: \[2, 3\]'):
    microbatch.BatchSize((tf.zeros([2, 1]), tf.zeros([3, 1])), 0)
  with pytest.raises(ValueError, match='no batch dimension'):
    microbatch.BatchSize((tf.zeros([]),), 0)
  with pytest.raises(ValueError, match='holds no tensor'):
    microbatch.BatchSize((None,), 0)


def testStageDevices():
  found = list(devices.Current().devices)
  assert len(found) >= 4 and all('CPU' in d for d in found)
  assert devices.StageDevices(2) == found[:2]
  a, b = found[:2]
  assert devices.StageDevices(3, [a, b], allow_reuse=True) == [a, b, a]
  with pytest.raises(ValueError,
                     match=r'needs 3 devices \(3 stages\) but only 2 devices were given'):
    devices.StageDevices(3, [a, b])
  # A device TensorFlow does not have would silently become another one: refused.
  with pytest.raises(ValueError, match=r"Device '/device:GPU:3' does not exist here"):
    devices.StageDevices(2, [a, '/device:GPU:3'])
  assert devices.StageDevices(1, ['/job:localhost/replica:0/task:0/device:CPU:1']) == [
      '/job:localhost/replica:0/task:0/device:CPU:1']
  with pytest.raises(ValueError, match='allow_device_reuse'):
    devices.StageDevices(len(found) + 1)
