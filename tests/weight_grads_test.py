"""Tests of lingvo_gpipe.pipeline.weight_grads: B's adjoints and W's weight gradients, each in a
function of its own, against one plain tape's gradients of the same forward."""

import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import remat
from lingvo_gpipe.pipeline import weight_grads

DIM = 8


class _Pair(base_layer.BaseLayer):
  """x @ a + tanh(x @ b) of a theta its caller hands it: no variables of its own."""

  def FProp(self, theta, x):
    theta = self.ToFPropDtype(theta)
    return x @ theta.a + tf.tanh(x @ theta.b)


class _Tied(base_layer.BaseLayer):
  """Weights used every way a split backward must get right: an embedding handed to a
  child as a transposed theta, a child's weight read in this layer's own ops, a child
  called twice, a child that passes its input through (dropout that keeps everything),
  an output also used inside (two outputs, or their sum), a float keyword input, and one
  weight handed to a child twice in one theta."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('two_outputs', True, 'Return (y, y * sum(emb)), else their sum.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('emb', py_utils.WeightParams([DIM, DIM]))
    self.CreateChild('proj', layers.ProjectionLayer.Params().Set(
        input_dim=DIM, output_dim=DIM, activation='TANH'))
    self.CreateChild('out', layers.ProjectionLayer.Params().Set(
        input_dim=DIM, output_dim=DIM, has_bias=False))
    self.CreateChild('keep', layers.DropoutLayer.Params().Set(keep_prob=1.0))
    self.CreateChild('pair', _Pair.Params())

  def FProp(self, theta, x, scale=2.0):
    h = self.keep.FProp(theta.keep, x @ theta.emb)
    h = self.pair.FProp(py_utils.NestedMap(a=theta.emb, b=theta.emb), h)
    h = self.proj.FProp(theta.proj, h) + self.proj.FProp(theta.proj, 0.5 * h)
    h = h * scale + tf.sin(x @ self.ToFPropDtype(theta.proj.w))
    tied = py_utils.NestedMap(w=tf.transpose(tf.cast(theta.emb, tf.float32)))
    y = self.out.FProp(tied, h)
    extra = y * tf.reduce_sum(theta.emb)
    return (y, extra) if self.params.two_outputs else y + extra


def _Model(fprop_dtype=None):
  """(a _Tied layer, a stack of _Tied, Transformer, _Tied), in fprop_dtype if given."""
  dtype = {} if fprop_dtype is None else dict(fprop_dtype=fprop_dtype)
  stack = layers.SequentialLayer.Params().Set(
      name='stack', sub=[_Tied.Params().Set(name='a', two_outputs=False, **dtype),
                         layers.TransformerLayer.Params().Set(
                             name='t', input_dim=DIM, hidden_dim=2 * DIM, num_heads=2, **dtype),
                         _Tied.Params().Set(name='b', two_outputs=False, **dtype)],
      **dtype)
  return _Tied.Params().Set(name='top', **dtype).Instantiate(), stack.Instantiate()


def _Forward(model, theta, x, scale):
  tied, stack = model
  y, extra = tied.FProp(theta[0], x, scale=scale)
  z = stack.FProp(theta[1], y[:, None, :] + extra[:, None, :])[:, 0]
  return tf.cast(z, tf.float32), tf.cast(extra, tf.float32)


def _Theta(model):
  """theta's last tensor is read by no op: its gradient is zero."""
  return tf.nest.map_structure(tf.convert_to_tensor, [m.theta for m in model] + [[1.0]])


def _OneTape(model, x, scale, targets_grads):
  """(input grads, theta grads) of the forward from one tape."""
  theta = _Theta(model)
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    tape.watch([x, scale] + tf.nest.flatten(theta))
    targets = _Forward(model, theta, x, scale)
  grads = tape.gradient(targets, [x, scale, tf.nest.flatten(theta)],
                        output_gradients=targets_grads,
                        unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return grads[:2], grads[2]


def _Split(model, x, scale, targets_grads):
  """The same, split: B in one function hands W, another function, tensors."""
  plans = []

  @tf.function(autograph=False)
  def B(theta, x, scale):
    with tf.GradientTape(watch_accessed_variables=False) as tape:
      tape.watch([x, scale] + tf.nest.flatten(theta))
      targets, plan, why = weight_grads.WeightGradPlan.Trace(
          lambda th, a: _Forward(model, th, *a), theta, (x, scale))
    assert plan is not None, why
    plans.append(plan)
    grads = tape.gradient(targets, [x, scale, plan.adjointed], output_gradients=targets_grads,
                          unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return grads[:2], plan.saved, grads[2]

  @tf.function(autograph=False)
  def W(theta, saved, adjoints):
    return plans[-1].WeightGradients(theta, saved, adjoints)

  theta = _Theta(model)
  d_args, saved, adjoints = B(theta, x, scale)
  d_theta = W(theta, saved, adjoints)
  return d_args, [tf.zeros_like(t) if g is None else g
                  for t, g in zip(tf.nest.flatten(theta), d_theta)]


@pytest.mark.parametrize('fprop_dtype,tol', [(None, 1e-5), (tf.bfloat16, 2e-2)])
def testSplitGradientsEqualOneTape(fprop_dtype, tol):
  model = _Model(fprop_dtype)
  x = tf.random.stateless_normal([4, DIM], [1, 2])
  scale = tf.random.stateless_normal([4, DIM], [3, 4])
  targets_grads = [tf.random.stateless_normal([4, DIM], [5, i]) for i in range(2)]
  (ref_dx, ref_ds), ref = _OneTape(model, x, scale, targets_grads)
  (dx, ds), got = _Split(model, x, scale, targets_grads)
  assert len(got) == len(ref) and len(ref) > 20
  for a, b in zip([ref_dx, ref_ds] + ref, [dx, ds] + got):
    scale_ = max(float(tf.reduce_max(tf.abs(a))), 1e-6)
    assert float(tf.reduce_max(tf.abs(a - b))) <= tol * scale_
