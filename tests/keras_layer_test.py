"""Tests of lingvo_gpipe.layers.keras_layer: Keras layers as pipeline layers."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import keras_layer
from lingvo_gpipe.pipeline import gpipe


def _Pipe(params_list, num_stages, num_micro_batches, batch=8, **kwargs):
  shape = tf.TensorShape([batch] + params_list[0].input_shape)
  cells = gpipe.PartitionSequentialLayers(params_list, num_stages, shape)
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches, **kwargs).Instantiate()


def _DenseParams():
  params, _ = keras_layer.ParamsFromKerasLayers(
      [keras.layers.Dense(6, activation='relu'), keras.layers.Dense(3)], [5])
  return params


def _Input(shape, seed=0):
  return tf.random.stateless_normal(shape, [seed, 7])


def testVariablesAreThetaNamedByPathAndTrainLikePlainMath():
  pipe = _Pipe(_DenseParams(), num_stages=2, num_micro_batches=4)
  assert sorted(v.name for v in pipe.trainable_variables) == [
      'pipe/dense0/bias:0', 'pipe/dense0/kernel:0', 'pipe/dense1/bias:0', 'pipe/dense1/kernel:0']
  x = _Input([8, 5])
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum(pipe(x) ** 2)
  grads = tape.gradient(loss, pipe.trainable_variables)
  v = {var.name: var for var in pipe.trainable_variables}
  with tf.GradientTape() as tape:
    h = tf.nn.relu(x @ v['pipe/dense0/kernel:0'] + v['pipe/dense0/bias:0'])
    ref_loss = tf.reduce_sum((h @ v['pipe/dense1/kernel:0'] + v['pipe/dense1/bias:0']) ** 2)
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-6)
  for g, r in zip(grads, ref_grads):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)
  # The Keras layer reads the same variables: its get_weights are theta's values.
  dense0 = pipe.LayersByPath()['pipe/dense0'].keras_layer
  np.testing.assert_array_equal(dense0.get_weights()[0], v['pipe/dense0/kernel:0'].numpy())


@keras.saving.register_keras_serializable(package='keras_layer_test')
class _Doubles(keras.layers.Layer):
  """A class named with a leading '_': Keras names the layer '_doubles'."""

  def call(self, x):
    return 2.0 * x


def testALayerWhoseNameStartsWithAnUnderscoreRunsInATracedStep():
  """Keras opens a scope named after the layer; at the root of a chunk's function, '_doubles'
  is no valid TensorFlow scope name."""
  params, _ = keras_layer.ParamsFromKerasLayers([keras.layers.Dense(3), _Doubles()], [5])
  pipe = _Pipe(params, num_stages=2, num_micro_batches=2)
  x = _Input([8, 5])
  v = {var.name: var for var in pipe.trainable_variables}
  want = 2.0 * (x @ v['pipe/dense0/kernel:0'] + v['pipe/dense0/bias:0'])
  np.testing.assert_allclose(tf.function(pipe)(x).numpy(), want.numpy(), rtol=1e-6)


def testInitialValuesDependOnThePathOnly():
  try:
    keras.utils.set_random_seed(1)
    one = _Pipe(_DenseParams(), num_stages=1, num_micro_batches=1)
    keras.utils.set_random_seed(2)
    two = _Pipe(_DenseParams(), num_stages=2, num_micro_batches=2)
  finally:
    tf.random.set_seed(None)  # No global seed for the tests that follow in this process.
  for a, b in zip(one.trainable_variables, two.trainable_variables):
    assert a.name == b.name
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  # Keras's initializers, not zeros: the kernels differ from each other.
  assert np.std(one.trainable_variables[1].numpy()) > 0.1


def testBatchNormUsesMicroBatchStatisticsAndMovesByTheWholeBatch():
  params, _ = keras_layer.ParamsFromKerasLayers(
      [keras.layers.BatchNormalization(momentum=0.9, epsilon=1e-3, center=False, scale=False)],
      [3])
  pipe = _Pipe(params, num_stages=1, num_micro_batches=4)
  x = _Input([8, 3]).numpy() * 2 + 1
  with tf.GradientTape() as tape:
    y = pipe(tf.constant(x))
  xs = x.reshape(4, 2, 3)
  expected = (xs - xs.mean(1, keepdims=True)) / np.sqrt(xs.var(1, keepdims=True) + 1e-3)
  np.testing.assert_allclose(y.numpy(), expected.reshape(8, 3), rtol=1e-4, atol=1e-5)
  bn = pipe.LayersByPath()['pipe/batch_normalization0']
  np.testing.assert_allclose(bn.vars.moving_mean.numpy(), 0.1 * x.mean(0), rtol=1e-5)
  np.testing.assert_allclose(bn.vars.moving_variance.numpy(), 0.9 + 0.1 * x.var(0), rtol=1e-5)
  del tape
  with py_utils.EvalMode():
    y_eval = pipe(tf.constant(x))
  np.testing.assert_allclose(
      y_eval.numpy(), (x - 0.1 * x.mean(0)) / np.sqrt(0.9 + 0.1 * x.var(0) + 1e-3), rtol=1e-5)


def testDropoutMaskIsTheSameForAnyCut():
  layers = [keras.layers.Dense(16), keras.layers.Dropout(0.5), keras.layers.Dense(4)]
  params, _ = keras_layer.ParamsFromKerasLayers(layers, [5])
  x = _Input([8, 5])
  outs = []
  for k, m in ((1, 1), (3, 4)):
    pipe = _Pipe(params, num_stages=k, num_micro_batches=m)
    with py_utils.Context(step=3):
      outs.append(pipe(x).numpy())
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-5, atol=1e-6)
  with py_utils.EvalMode():
    assert not np.allclose(pipe(x).numpy(), outs[1])


def testRandomOpsInsideKerasLayersAreSeededByStepAndMicroBatch():
  params, _ = keras_layer.ParamsFromKerasLayers([keras.layers.GaussianNoise(1.0)], [4])
  pipe = _Pipe(params, num_stages=1, num_micro_batches=2, batch=4)
  x = tf.zeros([4, 4])
  with py_utils.Context(step=5):
    a, b = pipe(x).numpy(), pipe(x).numpy()
  with py_utils.Context(step=6):
    c = pipe(x).numpy()
  np.testing.assert_array_equal(a, b)
  assert not np.allclose(a, c)
  assert not np.allclose(a[:2], a[2:])  # The two micro-batches draw their own noise.
  with tf.GradientTape() as tape, py_utils.Context(step=5):
    tape.watch(x)
    y = pipe(x)
  np.testing.assert_array_equal(y.numpy(), a)
  np.testing.assert_array_equal(tape.gradient(y, x).numpy(), np.ones([4, 4]))


class _Counting(keras.layers.Layer):
  """Counts its calls in a non-trainable variable: state the pipeline cannot update."""

  def build(self, input_shape):
    self.calls = self.add_weight(shape=(), initializer='zeros', trainable=False, name='calls')

  def call(self, x):
    self.calls.assign_add(1.0)
    return x


def testOtherStateUpdatesAreAnError():
  p = keras_layer.KerasLayer.Params().Set(name='count', layer=_Counting, input_shape=[2])
  layer = p.Instantiate()
  with pytest.raises(ValueError, match=r"updates \['.*calls'\] in call\(\)"):
    layer(tf.zeros([1, 2]))


def testBadParamsAreNamedErrors():
  base = keras_layer.KerasLayer.Params().Set(name='ff', input_shape=[4])
  with pytest.raises(ValueError, match='ff: params.layer must be a function.*got Dense'):
    base.Copy().Set(layer=keras.layers.Dense(3)).Instantiate()
  with pytest.raises(ValueError, match=r'ff: input_shape must be .* got \[0, 4\]'):
    base.Copy().Set(layer=lambda: keras.layers.Dense(3), input_shape=[0, 4]).Instantiate()
  built = keras.layers.Dense(3)
  built.build((None, 4))
  with pytest.raises(ValueError, match='returned the built Keras layer'):
    base.Copy().Set(layer=lambda: built).Instantiate()
  with pytest.raises(ValueError, match='expected a Keras layer'):
    keras_layer.ParamsFromKerasLayers([keras.layers.Dense(3), 'relu'], [4])


@pytest.mark.parametrize('make,shape', [
    (lambda: keras.layers.Embedding(10, 4, mask_zero=True), [6]),
    (lambda: keras.layers.Masking(), [6, 4]),
])
def testALayerThatMakesAMaskIsAnError(make, shape):
  """Its mask would not reach the layers after a pipeline cut (they read the padding)."""
  p = keras_layer.KerasLayer.Params().Set(name='masked', layer=make, input_shape=shape)
  with pytest.raises(ValueError, match=r'masked: the Keras layer .* makes a Keras mask'):
    p.Instantiate()


def testKerasPolicySetsFPropDtypeAndFPropDtypeSetsThePolicy():
  keras.mixed_precision.set_global_policy('mixed_bfloat16')
  try:
    params, _ = keras_layer.ParamsFromKerasLayers([keras.layers.Dense(3)], [4])
  finally:
    keras.mixed_precision.set_global_policy('float32')
  layer = params[0].Instantiate()
  assert layer.fprop_dtype == tf.bfloat16 and layer.vars.kernel.dtype == tf.float32
  x = tf.ones([2, 4])
  with tf.GradientTape() as tape:
    y = layer(x)
  assert y.dtype == tf.bfloat16
  assert tape.gradient(y, layer.vars.kernel).dtype == tf.float32
  p = keras_layer.KerasLayer.Params().Set(
      name='ff', layer=lambda: keras.layers.Dense(3), input_shape=[4], fprop_dtype=tf.float16)
  assert p.Instantiate().keras_layer.dtype_policy.name == 'mixed_float16'
  with pytest.raises(ValueError, match='computes in bfloat16 .* params.fprop_dtype is float32'):
    params[0].Copy().Set(fprop_dtype=tf.float32).Instantiate()


def testAParentsDtypeGivesWayToTheKerasLayersOwn():
  """Under a float64 parent a float32 Keras layer keeps float32, as in Keras; set in its
  own params, a dtype other than the Keras layer's is an error."""
  child = keras_layer.KerasLayer.Params().Set(name='k', layer=lambda: keras.layers.Dense(3),
                                              input_shape=[4])
  parent = layers.SequentialLayer.Params().Set(name='top', sub=[child], dtype=tf.float64)
  layer = parent.Instantiate()
  assert layer.sub[0].vars.kernel.dtype == tf.float32 and layer.sub[0].fprop_dtype == tf.float32
  x = tf.ones([2, 4], tf.float64)
  y = layer(x)
  assert y.dtype == tf.float32
  np.testing.assert_allclose(y, tf.cast(x, tf.float32) @ layer.sub[0].vars.kernel +
                             layer.sub[0].vars.bias, rtol=1e-6)
  with pytest.raises(ValueError, match='keeps variables in float32 but params.dtype is float64'):
    child.Copy().Set(dtype=tf.float64).Instantiate()


def testJitCompiledCells():
  """XLA gives the loss and gradients of the uncompiled cells, with dropout too (its own
  stateless random kernels give other numbers than TensorFlow's: the masks' hash is not
  made of them), for any micro-batching."""
  layers = [keras.layers.Dense(8, activation='gelu'), keras.layers.Dropout(0.5),
            keras.layers.Dense(3)]
  params, _ = keras_layer.ParamsFromKerasLayers(layers, [5])
  x = _Input([8, 5])
  results = {}
  for jit, training, m in ((False, False, 2), (True, False, 2), (False, True, 2), (True, True, 1),
                           (True, True, 4)):
    pipe = _Pipe(params, num_stages=2, num_micro_batches=m, jit_compile=jit)

    @tf.function
    def Step():
      with tf.GradientTape() as tape, py_utils.Context(training=training, step=1):
        loss = tf.reduce_sum(pipe(x) ** 2)
      return [loss] + list(tape.gradient(loss, pipe.trainable_variables))

    results[jit, training, m] = Step()
  for key_a, key_b in (((False, False, 2), (True, False, 2)), ((False, True, 2), (True, True, 1)),
                       ((False, True, 2), (True, True, 4))):
    for a, b in zip(results[key_a], results[key_b]):
      np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize('sched', ['zb_h1', 'zb_h2'])
def testSplitBackwardOfAKerasLayerThatChainsWeightsWalksNoChainAgain(sched):
  """A zero-bubble W of a Keras layer with several weights in one call (a Sequential of two
  Dense) runs only the weight gradients' matmuls, B at most a recompute and one walk of the
  activation chain, and the step gives the plain model's gradients."""
  from gpipe_test import _FunctionMatMuls  # pylint: disable=g-import-not-at-top
  block = keras_layer.KerasLayer.Params().Set(layer=lambda: keras.Sequential(
      [keras.layers.Dense(16, activation='relu'), keras.layers.Dense(8)]), input_shape=[8])
  pipe = _Pipe([block.Copy().Set(name=f'block{i}') for i in range(4)], num_stages=2,
               num_micro_batches=2, schedule=sched, remat='never')

  def Loss(y):
    return tf.reduce_sum(y ** 2)

  @tf.function
  def Plain(x):
    with tf.GradientTape() as tape:
      for cell, theta in zip(pipe.cell, pipe.theta.cell):
        x = cell.FProp(theta, x)
      loss = Loss(x)
    return loss, tape.gradient(loss, pipe.theta)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, Loss, loss_reduction='sum')

  graph = Step.get_concrete_function(tf.TensorSpec([8, 8])).graph
  assert all(fn.splits for fn in pipe.cell_functions[0])
  blocks_per_chunk = 2
  weights = _FunctionMatMuls(graph, '_WeightGrad')
  assert len(weights) == 2 and set(weights.values()) == {2 * blocks_per_chunk}, weights
  inputs = _FunctionMatMuls(graph, '_InputGrad')
  # At most the forward again and the activation chain: 2 matmuls per block each.
  assert len(inputs) == 2 and max(inputs.values()) <= 4 * blocks_per_chunk, inputs
  x = _Input([8, 8])
  (loss, grads), (ref_loss, ref_grads) = Step(x), Plain(x)
  np.testing.assert_allclose(loss.numpy(), ref_loss.numpy(), rtol=1e-5)
  for g, r in zip(tf.nest.flatten(grads), tf.nest.flatten(ref_grads)):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-5, atol=1e-6)
