"""Tests of a chunk's weights packed into one input per dtype (pipeline/packing.py)."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import packing


def _Theta():
  return py_utils.NestedMap(
      w=tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)),
      inner=py_utils.NestedMap(b=tf.constant([0.5, -1.0], tf.bfloat16),
                               v=tf.constant([7.0, 8.0, 9.0])),
      seed=tf.constant([3, 4], tf.int64))


def testUnpackGivesBackEveryLeafWithItsDtypeAndShape():
  theta = _Theta()
  packer = packing.Packing(theta)
  shapes = {}

  @tf.function(autograph=False)
  def RoundTrip(theta):
    out = packer.Unpack(packer.Pack(theta))
    shapes.update({k: v.shape for k, v in out.FlattenItems()})
    return out

  out = RoundTrip(theta)
  tf.nest.assert_same_structure(out, theta)
  for (key, x), (_, y) in zip(theta.FlattenItems(), out.FlattenItems()):
    assert x.dtype == y.dtype, key
    assert shapes[key] == x.shape, key  # Known while tracing, not only when run.
    np.testing.assert_array_equal(x.numpy(), y.numpy())


def testAPackedThetaIsOneCallInputPerFloatDtype():
  theta = _Theta()
  packer = packing.Packing(theta)

  @tf.function(autograph=False)
  def Sum(packed):
    t = packer.Unpack(packed)
    return tf.reduce_sum(t.w) + tf.reduce_sum(tf.cast(t.inner.b, tf.float32)) + tf.reduce_sum(
        t.inner.v) + tf.cast(tf.reduce_sum(t.seed), tf.float32)

  @tf.function(autograph=False)
  def Step(theta):
    return Sum(packer.Pack(theta))

  graph = Step.get_concrete_function(theta).graph
  calls = [op for op in graph.get_operations() if 'PartitionedCall' in op.type]
  assert len(calls) == 1
  assert [x.dtype for x in calls[0].inputs] == [tf.variant, tf.variant, tf.int64]
  expected = 15 + (0.5 - 1.0) + 24 + 7
  np.testing.assert_allclose(Step(theta).numpy(), expected)


def testGradientsOfUnpackedWeightsEqualThoseOfTheWeights():
  """What a backward call takes: the gradients of its unpacked weights."""
  w = tf.constant([[1.0, 2.0], [3.0, -1.0]])
  x = tf.constant([[0.1, 0.2]])
  theta = py_utils.NestedMap(w=w, b=tf.constant([0.1, 0.2]))
  packer = packing.Packing(theta)

  def Loss(t):
    return tf.reduce_sum(tf.tanh(tf.matmul(x, t.w) + t.b))

  @tf.function(autograph=False)
  def Grads(packed):
    t = packer.Unpack(packed)
    with tf.GradientTape() as tape:
      tape.watch(tf.nest.flatten(t))
      loss = Loss(t)
    return tape.gradient(loss, t)

  with tf.GradientTape() as tape:
    tape.watch(tf.nest.flatten(theta))
    loss = Loss(theta)
  expected = tape.gradient(loss, theta)
  got = tf.function(lambda t: Grads(packer.Pack(t)), autograph=False)(theta)
  for key in ('w', 'b'):
    np.testing.assert_allclose(got[key].numpy(), expected[key].numpy(), rtol=1e-6, atol=1e-7)


def testUnpackTakesANodePerItemAndAFewSharedOnes():
  """A call's function is read again at each call site while TensorFlow prepares a step, so
  unpacking shares the items' indices and their shapes' constants."""
  shapes = [[4, 8], [8], [8, 4], [4]] * 6
  theta = [tf.zeros(shape) for shape in shapes]
  packer = packing.Packing(theta)

  @tf.function(autograph=False)
  def Unpacked(packed):
    return packer.Unpack(packed)

  graph = Unpacked.get_concrete_function(packer.Pack(theta)).graph
  types = [op.type for op in graph.get_operations()]
  assert types.count('TensorListGetItem') == len(shapes)
  assert types.count('Const') <= len({tuple(s) for s in shapes}) + 3  # + the range's.
  out = Unpacked(packer.Pack(theta))
  assert [x.shape.as_list() for x in out] == shapes
