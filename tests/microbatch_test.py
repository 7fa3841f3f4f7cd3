"""Tests of lingvo_gpipe.core.microbatch and lingvo_gpipe.core.devices."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.core import devices
from lingvo_gpipe.core import microbatch
from lingvo_gpipe.core import py_utils


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
    (dict(num_micro_batches=4), 'Batch size 6 is not divisible by num_micro_batches=4'),
    (dict(num_micro_batches=8), 'num_micro_batches=8 is larger than the batch size 6'),
    (dict(num_micro_batches=0), 'positive int'),
    (dict(micro_batch_size=4), 'Batch size 6 is not divisible by micro_batch_size 4'),
])
def testBadMicroBatchCounts(kwargs, match):
  with pytest.raises(ValueError, match=match):
    microbatch.NumMicroBatches(6, **kwargs)


def testMicroBatchSize():
  assert microbatch.NumMicroBatches(6, micro_batch_size=2) == 3


def testBatchSizeChecks():
  with pytest.raises(ValueError, match=r'disagree on the batch size: \[2, 3\]'):
    microbatch.BatchSize((tf.zeros([2, 1]), tf.zeros([3, 1])), 0)
  with pytest.raises(ValueError, match='no batch dimension'):
    microbatch.BatchSize((tf.zeros([]),), 0)
  with pytest.raises(ValueError, match='holds no tensor'):
    microbatch.BatchSize((None,), 0)


def testStageDevices():
  found = devices.AvailableDevices()
  assert len(found) >= 4 and all('CPU' in d for d in found)
  assert devices.StageDevices(2) == found[:2]
  a, b = found[:2]
  assert devices.StageDevices(3, [a, b], allow_reuse=True) == [a, b, a]
  with pytest.raises(ValueError, match=r'needs 3 devices \(3 stages\) but only 2 devices were given'):
    devices.StageDevices(3, [a, b])
  # A device TensorFlow does not have would silently become another one: refused.
  with pytest.raises(ValueError, match=r"Device '/device:GPU:3' does not exist here"):
    devices.StageDevices(2, [a, '/device:GPU:3'])
  assert devices.StageDevices(1, ['/job:localhost/replica:0/task:0/device:CPU:1']) == [
      '/job:localhost/replica:0/task:0/device:CPU:1']
  with pytest.raises(ValueError, match='allow_device_reuse'):
    devices.StageDevices(len(found) + 1)
