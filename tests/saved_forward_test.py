"""saved_forward: a traced function's forward that saves, and its backward, give the
gradients a GradientTape takes of the same call."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.pipeline import saved_forward


@tf.function(autograph=False)
def _Cell(theta, x, ids, scale, training):
  """Weights in a dict, an integer input, a Python constant and bool, a None output and an
  output no gradient weighs (like a layer's statistics)."""
  h = tf.nn.relu(tf.matmul(x, theta['w']) + theta['b'])
  if training:
    h = h * scale
  y = tf.gather(h, ids, axis=1) + tf.sin(x[:, :1])
  return (y, None), {'mean': tf.reduce_mean(h, 0)}


def _Inputs():
  theta = {'w': tf.random.stateless_normal([4, 5], [1, 2]),
           'b': tf.random.stateless_normal([5], [3, 4])}
  x = tf.random.stateless_normal([3, 4], [5, 6])
  ids = tf.constant([4, 0, 2])
  d_y = tf.random.stateless_normal([3, 3], [7, 8])
  return theta, x, ids, d_y


def _TapeGradients(theta, x, ids, d_y):
  with tf.GradientTape() as tape:
    tape.watch([theta, x])
    (y, _), _ = _Cell(theta, x, ids, 2.0, True)
  return tape.gradient(y, [theta, x], output_gradients=d_y)


def _SavedGradients(theta, x, ids, d_y):
  ((y, none), stats), pair, saved = saved_forward.Forward(_Cell, theta, x, ids, 2.0, True)
  assert none is None and set(stats) == {'mean'} and y.shape == [3, 3]
  grads = saved_forward.Backward(pair, saved, ((d_y, None),))
  d_theta, d_x, d_ids, d_scale, d_training = grads
  assert d_ids is None and d_scale is None and d_training is None  # Integer, constants.
  return [d_theta, d_x]


@pytest.mark.parametrize('traced', [True, False])
def testSavedGradientsAreTheTapes(traced):
  inputs = _Inputs()
  saved, taped = _SavedGradients, _TapeGradients
  if traced:
    saved, taped = tf.function(saved, autograph=False), tf.function(taped, autograph=False)
  for a, b in zip(tf.nest.flatten(saved(*inputs)), tf.nest.flatten(taped(*inputs))):
    np.testing.assert_array_equal(a, b)


def testTheBackwardNeedsNoRecompute():
  """What the forward saved is all the backward takes: its graph holds no matmul (the
  forward's one), only the two of the gradients."""
  theta, x, ids, d_y = _Inputs()
  _, pair, saved = saved_forward.Forward(_Cell, theta, x, ids, 2.0, True)
  ops = [op.type for op in pair.backward.graph.get_operations()]
  assert ops.count('MatMul') == 2, ops
  assert 'Relu' not in ops  # Its gradient reads the saved output.
  assert all(isinstance(t, tf.Tensor) for t in saved)


def testOutputGradientsMayWeighAPrefixOrNothing():
  theta, x, ids, _ = _Inputs()
  _, pair, saved = saved_forward.Forward(_Cell, theta, x, ids, 2.0, True)
  d_theta, d_x = saved_forward.Backward(pair, saved, ())[:2]
  for g in tf.nest.flatten((d_theta, d_x)):
    np.testing.assert_array_equal(g, np.zeros_like(g))


def testACompositeArgumentIsAClearError():
  @tf.function(autograph=False)
  def Ragged(r):
    return tf.reduce_sum(r.flat_values)

  with pytest.raises(ValueError, match='composite tensor'):
    saved_forward.Forward(Ragged, tf.ragged.constant([[1.0], [2.0, 3.0]]))
