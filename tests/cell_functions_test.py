"""Tests of a chunk's traced functions' helpers (lingvo_gpipe/pipeline/cell_functions.py)."""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import cell_functions


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
  cell_functions.Watch(tape, theta, args)
  assert sorted(x.dtype.name for x in tape.watched) == ['float32', 'float32']
  assert any(x is theta.w for x in tape.watched) and any(x is args[0] for x in tape.watched)
