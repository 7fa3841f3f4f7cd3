"""The executor's own helpers; the schedules it runs are tested against the plain model in
gpipe_test and transparency_test."""

import tensorflow as tf

from lingvo_gpipe.core import executor
from lingvo_gpipe.core import py_utils


class _RecordingTape:

  def __init__(self):
    self.watched = []

  def watch(self, tensors):
    self.watched += list(tensors)


def testOnlyFloatInputsAndWeightsAreWatched():
  """A Keras layer's integer state (a dropout seed) is no weight: watching it made TensorFlow
  warn at every fit."""
  theta = py_utils.NestedMap(w=tf.Variable([1.0]), seed=tf.Variable([1, 2], dtype=tf.int64))
  args = (tf.constant([2.0]), tf.constant([3], tf.int32))
  tape = _RecordingTape()
  executor._Watch(tape, theta, args)  # pylint: disable=protected-access
  assert sorted(x.dtype.name for x in tape.watched) == ['float32', 'float32']
  assert any(x is theta.w for x in tape.watched) and any(x is args[0] for x in tape.watched)
