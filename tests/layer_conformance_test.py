"""Conformance: every layer of lingvo_gpipe.layers passes the same checks.

`ConformanceCases()` is the table, one case per layer class (a test fails when a
class has none). Other test modules import it to run their own checks over every
layer, e.g. the pipeline's "pipelined equals plain":

  from layer_conformance_test import ConformanceCases
"""

import collections
import inspect

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils

Case = collections.namedtuple('Case', ['name', 'params', 'make_inputs'])
Case.__doc__ = """One layer configuration and the FProp inputs to run it on.

name: a unique identifier, also the layer name.
params: fresh, mutable layer params.
make_inputs: () -> tuple of FProp inputs after theta, equal on every call; every
  tensor has its batch along dimension 0 (the positional embedding's only input
  is a sequence length).
"""


def _Normal(shape, seed):
  return tf.random.stateless_normal(shape, [seed, 3])


def _Ids(shape, vocab_size):
  return tf.random.stateless_uniform(shape, [4, 2], maxval=vocab_size, dtype=tf.int32)


def _Paddings(lengths, max_len):
  """[B, max_len] paddings, 1.0 past each example's length."""
  return 1.0 - tf.sequence_mask(lengths, max_len, dtype=tf.float32)


def _Case(name, cls, make_inputs, **kwargs):
  return Case(name, cls.Params().Set(name=name, **kwargs), make_inputs)


def _Activations():
  return (_Normal([2, 3, 4], 1),)


def _Images():
  return (_Normal([2, 5, 5, 2], 2),)


def ConformanceCases():
  """The table: one Case per layer class, small enough to run in milliseconds."""
  x, image = _Activations, _Images
  return [
      _Case('projection', layers.ProjectionLayer, x, input_dim=4, output_dim=3,
            activation='GELU'),
      _Case('layer_norm', layers.LayerNorm, x, input_dim=4),
      _Case('embedding', layers.EmbeddingLayer, lambda: (_Ids([2, 3], 6),), vocab_size=6,
            embedding_dim=4, scale_sqrt_depth=True),
      _Case('positional_embedding', layers.PositionalEmbeddingLayer, lambda: (5,),
            embedding_dim=4, max_len=16),
      _Case('softmax', layers.SimpleFullSoftmax,
            lambda: (_Normal([2, 3, 4], 1), _Ids([2, 3], 5), 1.0 - _Paddings([3, 2], 3)),
            input_dim=4, num_classes=5, label_smoothing=0.1),
      _Case('dropout', layers.DropoutLayer, x, keep_prob=0.5),
      _Case('attention', layers.MultiHeadedAttention,
            lambda: (_Normal([2, 3, 4], 1), _Normal([2, 3, 4], 2), _Normal([2, 3, 4], 3),
                     _Paddings([3, 2], 3)),
            input_dim=4, hidden_dim=6, num_heads=2, causal=True, atten_dropout_prob=0.2),
      _Case('transformer_attention', layers.TransformerAttentionLayer,
            lambda: (_Normal([2, 3, 4], 1), _Paddings([5, 2], 5), _Normal([2, 5, 4], 2)),
            input_dim=4, num_heads=2, residual_dropout_prob=0.2),
      _Case('feed_forward', layers.TransformerFeedForwardLayer, x, input_dim=4, hidden_dim=8,
            residual_dropout_prob=0.1, relu_dropout_prob=0.2),
      _Case('transformer', layers.TransformerLayer,
            lambda: (_Normal([2, 3, 4], 1), _Paddings([3, 2], 3), _Normal([2, 5, 4], 2),
                     _Paddings([4, 5], 5)),
            input_dim=4, num_heads=2, hidden_dim=8, mask_self_atten=True, has_aux_atten=True,
            residual_dropout_prob=0.1, atten_dropout_prob=0.1, relu_dropout_prob=0.1),
      _Case('sequential', layers.SequentialLayer, x, sub=[
          layers.ProjectionLayer.Params().Set(input_dim=4, output_dim=6, activation='RELU'),
          layers.BatchNormLayer.Params().Set(dim=6),
          layers.DropoutLayer.Params().Set(keep_prob=0.8)]),
      _Case('conv2d', layers.Conv2DLayer, image, filter_shape=[3, 3, 2, 3],
            filter_stride=(2, 2), activation='RELU'),
      _Case('pooling', layers.PoolingLayer, image, window_shape=(3, 3), pooling_type='AVG',
            padding='SAME'),
      _Case('global_pooling', layers.GlobalPoolingLayer, image),
      _Case('batch_norm', layers.BatchNormLayer, x, dim=4, decay=0.9),
  ]


_CASES = ConformanceCases()
_IDS = [case.name for case in _CASES]


def _Instantiate(case, **overrides):
  return case.params.Copy().Set(**overrides).Instantiate()


def _FProp(layer, inputs):
  return layer.FProp(layer.theta, *inputs)


def _AssertSameOutputs(actual, expected, tol):
  tf.nest.assert_same_structure(actual, expected)
  for a, e in zip(tf.nest.flatten(actual), tf.nest.flatten(expected)):
    np.testing.assert_allclose(tf.cast(a, tf.float32), tf.cast(e, tf.float32),
                               rtol=tol, atol=tol)


def _Loss(outputs):
  """A random projection of every float output, so no output's gradient is trivial."""
  floats = [tf.cast(x, tf.float32) for x in tf.nest.flatten(outputs) if x.dtype.is_floating]
  return tf.add_n([tf.reduce_sum(x * tf.random.stateless_normal(x.shape, [i, 5]))
                   for i, x in enumerate(floats)])


def testTableCoversEveryLayerClass():
  defined = {cls.__name__ for _, cls in inspect.getmembers(layers, inspect.isclass)
             if issubclass(cls, base_layer.BaseLayer) and cls.__module__ == layers.__name__}
  covered = {case.params.cls.__name__ for case in _CASES}
  assert defined - covered == set(), 'Add a ConformanceCases() entry for each new layer.'
  assert len(set(_IDS)) == len(_IDS)


@pytest.mark.parametrize('training', [True, False], ids=['train', 'eval'])
@pytest.mark.parametrize('case', _CASES, ids=_IDS)
def testEagerEqualsFunction(case, training):
  layer = _Instantiate(case)
  inputs = case.make_inputs()
  with py_utils.Context(training=training, step=3):
    eager = _FProp(layer, inputs)
    graph = tf.function(lambda *args: _FProp(layer, args))(*inputs)
  _AssertSameOutputs(graph, eager, tol=1e-5)


@pytest.mark.parametrize('case', _CASES, ids=_IDS)
def testCheckpointRestoresIntoDifferentlySeededLayer(case, tmp_path):
  layer = _Instantiate(case)
  inputs = case.make_inputs()
  _FProp(layer, inputs)  # A training step moves batch-norm statistics off their initial values.
  path = tf.train.Checkpoint(layer=layer).save(str(tmp_path / 'ckpt'))
  other = _Instantiate(case, random_seed=7)
  tf.train.Checkpoint(layer=other).restore(path).assert_consumed()
  # Eval: training-time dropout masks depend on the seed, by design.
  with py_utils.EvalMode():
    _AssertSameOutputs(_FProp(other, inputs), _FProp(layer, inputs), tol=0.0)


@pytest.mark.parametrize('case', _CASES, ids=_IDS)
def testInstantiatingTwiceGivesIdenticalVariables(case):
  a, b = _Instantiate(case), _Instantiate(case)
  assert [v.name for v in a.variables] == [v.name for v in b.variables]
  for x, y in zip(a.variables, b.variables):
    np.testing.assert_array_equal(x.numpy(), y.numpy())


@pytest.mark.parametrize('case', _CASES, ids=_IDS)
def testGradientsAreFinite(case):
  """Gradients of all trainable variables, or of the float input of layers without any."""
  layer = _Instantiate(case)
  inputs = case.make_inputs()
  sources = list(layer.trainable_variables)
  if not sources and tf.is_tensor(inputs[0]) and inputs[0].dtype.is_floating:
    sources = [inputs[0]]
  if not sources:
    return  # Positional embeddings: nothing to differentiate.
  with py_utils.Context(step=1), tf.GradientTape() as tape:
    tape.watch(sources)
    loss = _Loss(_FProp(layer, inputs))
  grads = tape.gradient(loss, sources)
  for source, grad in zip(sources, grads):
    assert grad is not None, f'{case.name}: no gradient for {source.name}'
    assert np.all(np.isfinite(tf.convert_to_tensor(grad))), f'{case.name}: {source.name}'


_META_CASES = [case for case in _CASES if case.params.cls.HasFPropMeta()]


@pytest.mark.parametrize('case', _META_CASES, ids=[case.name for case in _META_CASES])
def testFPropMetaMatchesOutputs(case):
  inputs = case.make_inputs()
  meta = case.params.cls.FPropMeta(case.params, *[tf.TensorShape(x.shape) for x in inputs])
  assert isinstance(meta.flops, int) and meta.flops > 0
  outputs = _FProp(_Instantiate(case), inputs)
  outputs = outputs if isinstance(outputs, tuple) else (outputs,)
  actual = tf.nest.map_structure(lambda x: x.shape.as_list(), outputs)
  assert tf.nest.map_structure(lambda s: s.as_list(), meta.out_shapes) == actual
