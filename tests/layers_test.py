"""Tests of lingvo_gpipe.layers against independent numpy/TensorFlow references."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils

_NP_ACTIVATIONS = {
    'NONE': lambda x: x,
    'RELU': lambda x: np.maximum(x, 0.0),
    'GELU': lambda x: 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0))),
    'TANH': np.tanh,
    'SIGMOID': lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def _Build(cls, **kwargs):
  return cls.Params().Set(name='layer', **kwargs).Instantiate()


def _Normal(shape, seed=0):
  return tf.random.stateless_normal(shape, [seed, 1]).numpy()


def _NumpyVars(layer):
  return layer.vars.Transform(lambda v: v.numpy())


def _Close(actual, expected, tol=1e-5):
  np.testing.assert_allclose(np.asarray(actual), expected, rtol=tol, atol=tol)


# -- numpy references -----------------------------------------------------------


def _RefProjection(v, x, activation='NONE'):
  y = x @ v.w + (v.b if 'b' in v else 0.0)
  return _NP_ACTIVATIONS[activation](y)


def _RefLayerNorm(v, x, epsilon=1e-6):
  mean = x.mean(-1, keepdims=True)
  var = ((x - mean) ** 2).mean(-1, keepdims=True)
  return (x - mean) / np.sqrt(var + epsilon) * v.scale + v.bias


def _RefSoftmax(logits, axis=-1):
  e = np.exp(logits - logits.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


def _RefAttention(v, query, key, value, num_heads, paddings=None, causal=False):
  q, k, vv = (_RefProjection(v[n], x) for n, x in
              (('query_proj', query), ('key_proj', key), ('value_proj', value)))
  b, t, hidden = q.shape
  s = k.shape[1]
  h = hidden // num_heads
  q, k, vv = (x.reshape(b, -1, num_heads, h) for x in (q, k, vv))
  logits = np.einsum('btnh,bsnh->bnts', q, k) / np.sqrt(h)
  valid = np.ones([b, 1, t, s], bool)
  if paddings is not None:
    valid &= (paddings < 0.5)[:, None, None, :]
  if causal:
    valid &= np.tril(np.ones([t, s], bool))
  probs = _RefSoftmax(np.where(valid, logits, -1e30))
  context = np.einsum('bnts,bsnh->btnh', probs, vv).reshape(b, t, hidden)
  return _RefProjection(v.post_proj, context)


def _RefAttentionBlock(v, x, num_heads, paddings=None, source=None, causal=False):
  normed = _RefLayerNorm(v.layer_norm, x)
  source = normed if source is None else source
  return x + _RefAttention(v.atten, normed, source, source, num_heads, paddings, causal)


def _RefFeedForward(v, x, activation='RELU'):
  h = _RefProjection(v.fc1, _RefLayerNorm(v.layer_norm, x), activation)
  return x + _RefProjection(v.fc2, h)


# -- projection, layer norm, embeddings ---------------------------------------


@pytest.mark.parametrize('activation', sorted(_NP_ACTIVATIONS))
def testProjectionMatchesNumpyOnRank3(activation):
  layer = _Build(layers.ProjectionLayer, input_dim=4, output_dim=3, activation=activation)
  layer.vars.b.assign([0.1, -0.2, 0.3])
  x = _Normal([2, 5, 4])
  _Close(layer(x), _RefProjection(_NumpyVars(layer), x, activation))


@pytest.mark.parametrize('signature_shape,reshapes', [
    ([3, 4], 0),  # Rank 2: the matmul alone.
    ([2, 5, 4], 2),  # Known: to 2-D and back, to constant shapes.
    ([None, None, 4], 2),  # Read when the step runs.
])
def testProjectionInAGraphReshapesOnlyWhatItMust(signature_shape, reshapes):
  """Each op of a cell is made again at every call site while TensorFlow prepares a pipelined
  step: a rank-2 projection takes no reshapes, a known shape no ops to compute it."""
  layer = _Build(layers.ProjectionLayer, input_dim=4, output_dim=3, activation='RELU')
  layer.vars.b.assign([0.1, -0.2, 0.3])
  fprop = tf.function(lambda x: layer.FProp(layer.theta, x), autograph=False,
                      input_signature=[tf.TensorSpec(signature_shape, tf.float32)])
  graph = fprop.get_concrete_function().graph
  types = [op.type for op in graph.get_operations()]
  assert types.count('Reshape') == reshapes
  assert ('ConcatV2' in types) == (None in signature_shape[:-1])  # The shape, computed.
  x = _Normal([d or 2 for d in signature_shape])
  out = fprop(x)
  assert out.shape == list(x.shape[:-1]) + [3]
  _Close(out, _RefProjection(_NumpyVars(layer), x, 'RELU'))


def testProjectionWithoutBias():
  layer = _Build(layers.ProjectionLayer, input_dim=4, output_dim=3, has_bias=False)
  assert sorted(layer.vars) == ['w']
  x = _Normal([3, 4])
  _Close(layer(x), x @ layer.vars.w.numpy())


def testLayerNormMatchesNumpy():
  layer = _Build(layers.LayerNorm, input_dim=6)
  layer.vars.scale.assign(_Normal([6], 1))
  layer.vars.bias.assign(_Normal([6], 2))
  x = _Normal([2, 3, 6]) * 3.0 + 1.0
  _Close(layer(x), _RefLayerNorm(_NumpyVars(layer), x), tol=1e-4)


@pytest.mark.parametrize('scale', [False, True])
def testEmbeddingLooksUpRows(scale):
  layer = _Build(layers.EmbeddingLayer, vocab_size=7, embedding_dim=4, scale_sqrt_depth=scale)
  ids = np.array([[0, 6, 3], [3, 3, 1]])
  expected = layer.vars.emb.numpy()[ids] * (2.0 if scale else 1.0)
  _Close(layer(ids), expected)
  _Close(layer.EmbLookup(layer.theta, ids), expected)


def testEmbeddingOutOfRangeIdsRaiseOnCpu():
  layer = _Build(layers.EmbeddingLayer, vocab_size=3, embedding_dim=2)
  with pytest.raises(tf.errors.InvalidArgumentError):
    layer(tf.constant([3]))


def testPositionalEmbeddingMatchesFormula():
  layer = _Build(layers.PositionalEmbeddingLayer, embedding_dim=6, max_len=8)
  assert not layer.variables
  pos = np.arange(5)[:, None]
  freq = 1.0 / 10000.0 ** (2.0 * np.arange(3) / 6.0)
  expected = np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=-1)
  _Close(layer(5), expected)
  positions = np.array([[0, 4], [2, 1]])
  _Close(layer.FPropWithPosition(layer.theta, positions), expected[positions])


def testPositionalEmbeddingTooLongIsAnError():
  layer = _Build(layers.PositionalEmbeddingLayer, embedding_dim=4, max_len=8)
  layer(8)
  with pytest.raises(ValueError, match='max_len=8'):
    layer(9)
  with pytest.raises(ValueError, match='position 8'):
    layer.FPropWithPosition(layer.theta, tf.constant([1, 8]))


# -- softmax ------------------------------------------------------------------


def testSoftmaxMatchesTfCrossEntropyWithSmoothedLabels():
  eps, num_classes = 0.1, 5
  layer = _Build(layers.SimpleFullSoftmax, input_dim=4, num_classes=num_classes,
                 label_smoothing=eps)
  x = _Normal([2, 3, 4])
  ids = np.array([[0, 4, 2], [1, 1, 3]])
  weights = np.array([[1.0, 1.0, 0.0], [1.0, 0.5, 1.0]], np.float32)
  out = layer.FProp(layer.theta, x, ids, weights)

  logits = _RefProjection(_NumpyVars(layer).proj, x)
  labels = (1.0 - eps) * np.eye(num_classes)[ids] + eps / num_classes
  xent = tf.nn.softmax_cross_entropy_with_logits(labels, logits).numpy()
  _Close(out.logits, logits)
  _Close(out.log_probs, np.log(_RefSoftmax(logits)))
  _Close(out.per_example_xent, xent)
  np.testing.assert_array_equal(out.per_example_argmax, logits.argmax(-1))
  _Close(out.total_xent, (xent * weights).sum())
  _Close(out.total_weight, 4.5)
  _Close(out.avg_xent, (xent * weights).sum() / 4.5)


def testSoftmaxDefaultWeightsAndAllPaddedBatch():
  layer = _Build(layers.SimpleFullSoftmax, input_dim=3, num_classes=4)
  x, ids = _Normal([5, 3]), np.array([0, 1, 2, 3, 0])
  out = layer.FProp(layer.theta, x, ids)
  _Close(out.total_weight, 5.0)
  _Close(out.avg_xent, out.per_example_xent.numpy().mean())
  empty = layer.FProp(layer.theta, x, ids, np.zeros([5], np.float32))
  assert empty.avg_xent.numpy() == 0.0


# -- dropout ------------------------------------------------------------------


def testDropoutMaskIsAFunctionOfTheContext():
  layer = _Build(layers.DropoutLayer, keep_prob=0.75)
  x = tf.ones([40, 100])

  def Run(**context):
    with py_utils.Context(**context):
      return layer(x).numpy()

  mask = Run(step=3)
  np.testing.assert_array_equal(mask, Run(step=3))
  np.testing.assert_array_equal(mask, Run(step=tf.constant(3)))
  assert not np.array_equal(mask, Run(step=4))
  kept = mask != 0
  assert abs(kept.mean() - 0.75) < 0.03
  _Close(mask[kept], 1.0 / 0.75)
  np.testing.assert_array_equal(Run(training=False), x)
  # A micro-batch (rows 10..19 of the 40) draws its rows of the whole batch's mask.
  with py_utils.Context(step=3, batch_slice=py_utils.BatchSlice(10, 10)):
    np.testing.assert_array_equal(layer(x[10:20]), mask[10:20])


def testDropoutStepDefaultsToTheLayersCallCount():
  # In a user's own loop (no context step) each training call draws a new mask,
  # the n-th call the mask of step n, and eval calls do not count.
  layer = _Build(layers.DropoutLayer, keep_prob=0.5)
  x = tf.ones([8, 16])
  first, second = layer(x).numpy(), layer(x).numpy()
  assert not np.array_equal(first, second)
  with py_utils.EvalMode():
    layer(x)
  third = tf.function(lambda: layer(x))().numpy()
  for step, got in enumerate([first, second, third]):
    with py_utils.Context(step=step):
      np.testing.assert_array_equal(got, _Build(layers.DropoutLayer, keep_prob=0.5)(x))


def testDropoutMasksDifferAcrossLayers():
  other = layers.DropoutLayer.Params().Set(name='other', keep_prob=0.5).Instantiate()
  layer = _Build(layers.DropoutLayer, keep_prob=0.5)
  x = tf.ones([100])
  assert not np.array_equal(layer(x), other(x))


def testDropoutKeepAllIsIdentity():
  x = _Normal([3, 4])
  np.testing.assert_array_equal(_Build(layers.DropoutLayer)(x), x)


# -- attention and Transformer ------------------------------------------------


@pytest.mark.parametrize('causal', [False, True])
def testAttentionMatchesNumpy(causal):
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, hidden_dim=6, num_heads=2,
                 causal=causal)
  x, kv = _Normal([2, 3, 4], 1), _Normal([2, 3, 4], 2)
  paddings = np.array([[0, 0, 1], [0, 0, 0]], np.float32)
  out = layer.FProp(layer.theta, x, kv, kv * 2.0, paddings)
  expected = _RefAttention(_NumpyVars(layer), x, kv, kv * 2.0, 2, paddings, causal)
  _Close(out, expected)


@pytest.mark.parametrize('shape', [[2, 3, 4], [None, None, 4]])
def testCausalAttentionInAGraphComputesShapesOnlyWhenUnknown(shape):
  """As a projection's (testProjectionInAGraphReshapesOnlyWhatItMust): known shapes are
  constants, unknown ones are read when the step runs; both give the same numbers."""
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, hidden_dim=6, num_heads=2,
                 causal=True)
  spec = tf.TensorSpec(shape, tf.float32)
  fprop = tf.function(lambda x, kv: layer.FProp(layer.theta, x, kv, kv * 2.0),
                      autograph=False, input_signature=[spec, spec])
  types = [op.type for op in fprop.get_concrete_function().graph.get_operations()]
  assert ('ConcatV2' in types) == (None in shape)  # Shapes of heads, computed.
  x, kv = _Normal([2, 3, 4], 1), _Normal([2, 3, 4], 2)
  _Close(fprop(x, kv), _RefAttention(_NumpyVars(layer), x, kv, kv * 2.0, 2, causal=True))


def testAttentionDefaultsToSelfAttention():
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, num_heads=2)
  x = _Normal([2, 3, 4])
  _Close(layer(x), _RefAttention(_NumpyVars(layer), x, x, x, 2))


def testAttentionIgnoresPaddedKeys():
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, num_heads=2)
  x, kv = _Normal([2, 3, 4], 1), _Normal([2, 5, 4], 2)
  paddings = np.array([[0, 0, 0, 1, 1], [0, 1, 0, 0, 0]], np.float32)
  changed = kv + 100.0 * paddings[:, :, None]
  np.testing.assert_allclose(layer(x, changed, changed, paddings), layer(x, kv, kv, paddings),
                             atol=1e-5)


def testAttentionFullyPaddedRowIsFinite():
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, num_heads=1)
  out = layer(_Normal([1, 2, 4]), None, None, tf.ones([1, 2]))
  assert np.all(np.isfinite(out))


def testCausalAttentionNeedsAsManyQueriesAsKeys():
  layer = _Build(layers.MultiHeadedAttention, input_dim=4, num_heads=1, causal=True)
  with pytest.raises(ValueError, match='got 2 and 3'):
    layer(_Normal([1, 2, 4]), _Normal([1, 3, 4]))


def testFeedForwardMatchesNumpy():
  layer = _Build(layers.TransformerFeedForwardLayer, input_dim=4, hidden_dim=8,
                 activation='GELU')
  x = _Normal([2, 3, 4])
  _Close(layer(x), _RefFeedForward(_NumpyVars(layer), x, 'GELU'), tol=1e-4)


def _Transformer(**kwargs):
  return _Build(layers.TransformerLayer, input_dim=4, num_heads=2, hidden_dim=8, **kwargs)


def testTransformerLayerMatchesNumpy():
  layer = _Transformer(mask_self_atten=True, has_aux_atten=True)
  x, aux = _Normal([2, 3, 4], 1), _Normal([2, 5, 4], 2)
  paddings = np.array([[0, 0, 1], [0, 0, 0]], np.float32)
  aux_paddings = np.array([[0, 0, 0, 1, 1], [0, 0, 0, 0, 0]], np.float32)
  v = _NumpyVars(layer)
  y = _RefAttentionBlock(v.self_atten, x, 2, paddings, causal=True)
  y = _RefAttentionBlock(v.aux_atten, y, 2, aux_paddings, source=aux)
  expected = _RefFeedForward(v.ff, y)
  _Close(layer(x, paddings, aux, aux_paddings), expected, tol=1e-4)


def testTransformerPaddedPositionsDoNotAffectOthers():
  layer = _Transformer(has_aux_atten=True)
  x, aux = _Normal([2, 4, 4], 1), _Normal([2, 3, 4], 2)
  paddings = np.array([[0, 0, 1, 1], [0, 0, 0, 1]], np.float32)
  aux_paddings = np.array([[0, 1, 1], [0, 0, 0]], np.float32)
  out = layer(x, paddings, aux, aux_paddings).numpy()
  changed = layer(x + 50.0 * paddings[..., None], paddings,
                  aux + 50.0 * aux_paddings[..., None], aux_paddings).numpy()
  real = paddings == 0
  np.testing.assert_allclose(changed[real], out[real], atol=1e-5)


def testCausalTransformerIgnoresFutureTokens():
  layer = _Transformer(mask_self_atten=True)
  x = _Normal([2, 5, 4])
  changed = x.copy()
  changed[:, 3:] = _Normal([2, 2, 4], 7)
  np.testing.assert_allclose(layer(changed)[:, :3], layer(x)[:, :3], atol=1e-5)


def testTransformerAuxVecsMustMatchConfig():
  with pytest.raises(ValueError, match='has_aux_atten=True but aux_vecs is None'):
    _Transformer(has_aux_atten=True)(_Normal([1, 2, 4]))
  with pytest.raises(ValueError, match='has_aux_atten=False but aux_vecs is given'):
    _Transformer()(_Normal([1, 2, 4]), None, _Normal([1, 2, 4]))


# -- sequential ---------------------------------------------------------------


class _Fork(base_layer.BaseLayer):
  """x -> (x, 2x): a layer with a tuple output."""

  def FProp(self, theta, x):
    return x, 2.0 * x


class _Add(base_layer.BaseLayer):
  """(a, b) -> a + b."""

  def FProp(self, theta, a, b):
    return a + b


def testSequentialChainsLayersAndSpreadsTuples():
  sub = [layers.ProjectionLayer.Params().Set(input_dim=4, output_dim=3, activation='RELU'),
         _Fork.Params(), _Add.Params(), layers.LayerNorm.Params().Set(input_dim=3)]
  layer = _Build(layers.SequentialLayer, sub=sub)
  assert [c.params.name for c in layer.sub] == ['sub0', 'sub1', 'sub2', 'sub3']
  x = _Normal([2, 4])
  v = _NumpyVars(layer)
  h = _RefProjection(v.sub[0], x, 'RELU')
  _Close(layer(x), _RefLayerNorm(v.sub[3], 3.0 * h), tol=1e-4)


def testSequentialFPropMetaChainsShapes():
  proj = layers.ProjectionLayer.Params()
  p = layers.SequentialLayer.Params().Set(
      sub=[proj.Copy().Set(input_dim=4, output_dim=8), proj.Copy().Set(input_dim=8,
                                                                        output_dim=2)])
  meta = layers.SequentialLayer.FPropMeta(p, tf.TensorShape([3, 4]))
  first = layers.ProjectionLayer.FPropMeta(p.sub[0], tf.TensorShape([3, 4]))
  second = layers.ProjectionLayer.FPropMeta(p.sub[1], tf.TensorShape([3, 8]))
  assert meta.flops == first.flops + second.flops
  assert meta.out_shapes[0].as_list() == [3, 2]


# -- convolution, pooling, batch norm -----------------------------------------


@pytest.mark.parametrize('padding,stride', [('SAME', (1, 1)), ('VALID', (2, 1))])
def testConv2DMatchesTfConv(padding, stride):
  layer = _Build(layers.Conv2DLayer, filter_shape=[3, 2, 2, 3], filter_stride=stride,
                 padding=padding, activation='RELU')
  layer.vars.b.assign([0.5, -0.5, 0.0])
  x = _Normal([2, 5, 4, 2])
  v = _NumpyVars(layer)
  expected = np.maximum(tf.nn.conv2d(x, v.w, [1, *stride, 1], padding).numpy() + v.b, 0.0)
  out = layer(x)
  _Close(out, expected)
  assert layers.Conv2DLayer.FPropMeta(layer.params, x.shape).out_shapes[0] == out.shape


@pytest.mark.parametrize('pooling_type,reduce_fn', [('MAX', np.max), ('AVG', np.mean)])
def testPoolingMatchesNumpy(pooling_type, reduce_fn):
  layer = _Build(layers.PoolingLayer, pooling_type=pooling_type)
  x = _Normal([2, 4, 6, 3])
  windows = x.reshape(2, 2, 2, 3, 2, 3)
  _Close(layer(x), reduce_fn(windows, axis=(2, 4)))


def testGlobalPoolingAveragesSpatialDims():
  x = _Normal([2, 3, 4, 5])
  _Close(_Build(layers.GlobalPoolingLayer)(x), x.mean(axis=(1, 2)))


def _RefBatchNorm(v, x, mean, variance, epsilon=1e-3):
  return (x - mean) / np.sqrt(variance + epsilon) * v.gamma + v.beta


def testBatchNormTrainsOnBatchStatsAndEvaluatesOnMovingOnes():
  layer = _Build(layers.BatchNormLayer, dim=3, decay=0.9)
  layer.vars.gamma.assign([1.0, 2.0, 0.5])
  x = _Normal([4, 2, 3]) * 2.0 + 1.0
  mean, var = x.mean((0, 1)), x.var((0, 1))
  _Close(layer(x), _RefBatchNorm(_NumpyVars(layer), x, mean, var), tol=1e-4)
  # Outside a pipeline the update is applied at once.
  moving_mean, moving_var = 0.1 * mean, 0.9 + 0.1 * var
  _Close(layer.vars.moving_mean, moving_mean)
  _Close(layer.vars.moving_variance, moving_var)
  with py_utils.EvalMode():
    _Close(layer(x), _RefBatchNorm(_NumpyVars(layer), x, moving_mean, moving_var), tol=1e-4)
  _Close(layer.vars.moving_mean, moving_mean)  # Eval updates nothing.


def testBatchNormCombinesUnevenMicroBatchesExactly():
  layer = _Build(layers.BatchNormLayer, dim=3)
  x = _Normal([10, 3]) * 3.0 + 2.0
  updates = []
  with py_utils.Context(updates=updates):
    for chunk in (x[:2], x[2:5], x[5:]):
      layer(chunk)
  assert len(updates) == 3
  _Close(layer.vars.moving_mean, np.zeros(3))  # Recorded, not yet applied.
  combined = layer.CombineUpdates([stats for _, stats in updates])
  _Close(combined.mean, x.mean(0))
  _Close(combined.variance, x.var(0))
  _Close(combined.count, 10.0)
  base_layer.ApplyRecordedUpdates(updates)
  _Close(layer.vars.moving_mean, 0.001 * x.mean(0))
  _Close(layer.vars.moving_variance, 0.999 + 0.001 * x.var(0))


# -- FPropMeta ----------------------------------------------------------------


def testProjectionAndConvFlops():
  proj = layers.ProjectionLayer.Params().Set(input_dim=4, output_dim=5, activation='RELU')
  meta = layers.ProjectionLayer.FPropMeta(proj, tf.TensorShape([2, 3, 4]))
  assert meta.flops == 2 * 6 * 4 * 5 + 2 * 6 * 5  # Matmul, then bias and ReLU.
  conv = layers.Conv2DLayer.Params().Set(filter_shape=[3, 3, 2, 4], has_bias=False)
  meta = layers.Conv2DLayer.FPropMeta(conv, tf.TensorSpec([1, 5, 5, 2]))
  assert meta.flops == 2 * 25 * 4 * 9 * 2
  assert meta.out_shapes[0].as_list() == [1, 5, 5, 4]


def testFeedForwardFlopsAreTheSumOfItsParts():
  p = layers.TransformerFeedForwardLayer.Params().Set(input_dim=4, hidden_dim=8)
  shape = tf.TensorShape([2, 3, 4])
  proj = layers.ProjectionLayer.Params()
  expected = (layers.LayerNorm.FPropMeta(layers.LayerNorm.Params(), shape).flops +
              layers.ProjectionLayer.FPropMeta(
                  proj.Copy().Set(input_dim=4, output_dim=8, activation='RELU'), shape).flops +
              layers.ProjectionLayer.FPropMeta(
                  proj.Copy().Set(input_dim=8, output_dim=4), [2, 3, 8]).flops +
              24)  # The residual sum; dropouts that keep all units cost nothing.
  assert layers.TransformerFeedForwardLayer.FPropMeta(p, shape).flops == expected


# -- mixed precision ----------------------------------------------------------


def _MixedPrecisionCases():
  x = _Normal([2, 3, 4])
  return {
      'transformer': (layers.TransformerLayer.Params().Set(
          input_dim=4, num_heads=2, hidden_dim=8, mask_self_atten=True), (x,)),
      'softmax': (layers.SimpleFullSoftmax.Params().Set(input_dim=4, num_classes=3),
                  (x, np.zeros([2, 3], np.int32))),
      'conv': (layers.Conv2DLayer.Params().Set(filter_shape=[2, 2, 4, 2]), (x[None],)),
      'batch_norm': (layers.BatchNormLayer.Params().Set(dim=4), (x,)),
      'embedding': (layers.EmbeddingLayer.Params().Set(vocab_size=5, embedding_dim=4),
                    (np.array([[1, 4]]),)),
  }


@pytest.mark.parametrize('case', sorted(_MixedPrecisionCases()))
def testBfloat16ActivationsWithFloat32Variables(case):
  params, inputs = _MixedPrecisionCases()[case]
  full = params.Copy().Set(name='layer').Instantiate()
  half = params.Copy().Set(name='layer', fprop_dtype=tf.bfloat16).Instantiate()
  assert all(v.dtype == tf.float32 for v in half.variables)
  expected, out = full(*inputs), half(*inputs)
  if case == 'softmax':
    assert out.logits.dtype == tf.bfloat16 and out.avg_xent.dtype == tf.float32
    expected, out = expected.logits, out.logits
  assert out.dtype == tf.bfloat16
  np.testing.assert_allclose(tf.cast(out, tf.float32), expected, rtol=0.05, atol=0.05)


# -- configuration errors -----------------------------------------------------


@pytest.mark.parametrize('cls,kwargs,match', [
    (layers.ProjectionLayer, dict(input_dim=2, output_dim=2, activation='SWISH'),
     r"'SWISH'.*'RELU'"),
    (layers.ProjectionLayer, dict(input_dim=0, output_dim=2), 'input_dim .* got 0'),
    (layers.MultiHeadedAttention, dict(input_dim=4, hidden_dim=6, num_heads=4),
     'hidden_dim=6 .* num_heads=4'),
    (layers.MultiHeadedAttention, dict(input_dim=4, atten_dropout_prob=1.0),
     'atten_dropout_prob .* got 1.0'),
    (layers.TransformerFeedForwardLayer, dict(input_dim=2, hidden_dim=2, relu_dropout_prob=-0.1),
     'relu_dropout_prob .* got -0.1'),
    (layers.TransformerLayer, dict(input_dim=2, hidden_dim=2, activation='ELU'), "'ELU'"),
    (layers.DropoutLayer, dict(keep_prob=0.0), r'keep_prob must be in \(0, 1\], got 0.0'),
    (layers.SimpleFullSoftmax, dict(input_dim=2, num_classes=2, label_smoothing=1.0),
     'label_smoothing .* got 1.0'),
    (layers.PositionalEmbeddingLayer, dict(embedding_dim=5), 'even, got 5'),
    (layers.Conv2DLayer, dict(filter_shape=[3, 3, 1]), r'filter_shape .* got \[3, 3, 1\]'),
    (layers.Conv2DLayer, dict(filter_shape=[3, 3, 1, 1], padding='FULL'), "'FULL'"),
    (layers.PoolingLayer, dict(pooling_type='MIN'), "'MIN'"),
    (layers.BatchNormLayer, dict(dim=2, decay=1.5), 'decay .* got 1.5'),
    (layers.SequentialLayer, dict(sub=[]), 'at least one sub-layer'),
])
def testBadConfigsAreValueErrors(cls, kwargs, match):
  with pytest.raises(ValueError, match=match):
    _Build(cls, **kwargs)
