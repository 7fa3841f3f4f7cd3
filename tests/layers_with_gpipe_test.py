"""Tests of layers_with_gpipe and its state_layers: every stack, split and micro-batched,
equals its unpipelined run.

The reference is a plain SequentialLayer of the stack's own LayerParams on one
device, with the pipeline's weights copied by each layer's path below its cell
(initial values depend on the path, which includes the cell).
"""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

import pairwise
from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.models import layers_with_gpipe as lg
from lingvo_gpipe.models import state_layers
from lingvo_gpipe.models import tasks
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.training import learner

NestedMap = py_utils.NestedMap
_B, _S, _T, _VOCAB = 4, 5, 6, 11
_NUM_CLASSES, _IMAGE = 5, (6, 6, 2)


def _SeqStack(**kwargs):
  p = lg.GPipeTransformerStack.Params().Set(name='stack', model_dim=8, num_heads=2,
                                            hidden_dim=16, max_seq_len=8)
  p.emb_tpl.vocab_size = _VOCAB
  p.softmax_tpl.num_classes = _VOCAB
  return p.Set(**kwargs)


def _ResNet(**kwargs):
  return lg.GPipeResNetStack.Params().Set(
      name='stack', image_shape=_IMAGE, num_classes=_NUM_CLASSES, stem_channels=4,
      block_channels=[4, 8, 8], bn_decay=0.9).Set(**kwargs)


_STACKS = {
    'encoder': lambda **kw: _SeqStack(num_encoder_layers=3, num_decoder_layers=0, **kw),
    'lm': lambda **kw: _SeqStack(num_decoder_layers=3, **kw),
    'tied_lm': lambda **kw: _SeqStack(num_decoder_layers=3, tie_embeddings=True, **kw),
    'encdec': lambda **kw: _SeqStack(num_encoder_layers=2, num_decoder_layers=2, **kw),
    'resnet': _ResNet,
}


def _Ints(shape, seed, low, high):
  return tf.random.stateless_uniform(shape, [seed, 7], low, high, dtype=tf.int32)


def _Sequence(lengths, max_len, seed, labeled):
  """Ids (0 where padded) and paddings of examples of different lengths."""
  mask = tf.sequence_mask(lengths, max_len)
  seq = NestedMap(ids=tf.where(mask, _Ints([len(lengths), max_len], seed, 1, _VOCAB), 0),
                  paddings=1.0 - tf.cast(mask, tf.float32))
  if labeled:
    seq.labels = tf.where(mask, _Ints([len(lengths), max_len], seed + 1, 1, _VOCAB), 0)
    seq.weights = tf.cast(mask, tf.float32)
  return seq


def _Inputs(p):
  if p.cls is lg.GPipeResNetStack:
    return NestedMap(image=NestedMap(
        vecs=tf.random.stateless_normal([_B, *_IMAGE], [1, 2]),
        labels=_Ints([_B], 3, 0, _NUM_CLASSES), weights=tf.constant([1.0, 0.5, 1.0, 2.0])))
  state = NestedMap()
  if p.num_encoder_layers:
    state.src = _Sequence([5, 3, 4, 1], _S, 10, labeled=not p.num_decoder_layers)
  if p.num_decoder_layers:
    state.tgt = _Sequence([6, 2, 5, 4], _T, 20, labeled=True)
  return state


def _LossFn(out):
  total = tf.reduce_sum(out.weights)
  return tf.reduce_sum(out.xent * out.weights) / total, total


def _Key(var):
  """A variable's path below its cell (or below the reference's root)."""
  parts = var.name.split(':')[0].split('/')
  return '/'.join(parts[2:] if parts[1].startswith('cell') else parts[1:])


def _Reference(p):
  """The stack's layers run one after another on one device."""
  ref = layers.SequentialLayer.Params().Set(name='ref', sub=p.cls.LayerParams(p)).Instantiate()
  if p.cls is lg.GPipeTransformerStack and p.tie_embeddings:
    lg.TieSoftmaxToEmbedding(ref.sub)
  return ref


def _CopyWeights(src, dst):
  values = {_Key(v): v for v in src.variables}
  for v in dst.variables:
    v.assign(values[_Key(v)])


def _Chunks(state, num_chunks):
  return [tf.nest.pack_sequence_as(state, leaves) for leaves in
          zip(*[tf.split(x, num_chunks) for x in tf.nest.flatten(state)])]


def _ReferenceLossAndGrads(ref, state, num_chunks):
  """Loss and gradients; batch norm sees `num_chunks` chunks, as micro-batches do."""
  with tf.GradientTape() as tape:
    outs = [ref.FProp(ref.theta, chunk) for chunk in _Chunks(state, num_chunks)]
    merged = tf.nest.map_structure(lambda *xs: tf.concat(xs, 0), *outs)
    loss, _ = _LossFn(merged)
  grads = tape.gradient(loss, ref.trainable_variables)
  return loss, {_Key(v): tf.convert_to_tensor(g) for v, g in zip(ref.trainable_variables, grads)}


def _Close(actual, expected, tol=2e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


@pytest.mark.parametrize('kind,splits,num_micro_batches',
                         pairwise.EveryPair(sorted(_STACKS), [1, 2, 4], [1, 2, 4]))
def testPipelinedEqualsUnpipelined(kind, splits, num_micro_batches):
  """Every stack cut into 1, 2 and 4 cells and run on 1, 2 and 4 micro-batches, and every
  cut on every number of micro-batches: the unpipelined stack's outputs, loss and
  gradients."""
  p = _STACKS[kind](splits=splits, num_micro_batches=num_micro_batches)
  stack = p.Instantiate()
  assert stack.num_stages == splits
  ref = _Reference(p)
  _CopyWeights(stack, ref)
  state = _Inputs(p)

  with py_utils.EvalMode():
    tf.nest.map_structure(_Close, stack.FProp(stack.theta, state), ref.FProp(ref.theta, state))

  # Batch norm normalizes each micro-batch by its own statistics, as in GPipe.
  chunks = num_micro_batches if kind == 'resnet' else 1
  ref_loss, ref_grads = _ReferenceLossAndGrads(ref, state, chunks)
  loss, grads = stack.ForwardBackward(stack.theta, state, _LossFn)
  _Close(loss, ref_loss)
  summed = learner.GradientsAndVariables(stack.vars, grads)
  assert sorted(_Key(v) for _, v in summed) == sorted(ref_grads)
  for grad, var in summed:
    _Close(grad, ref_grads[_Key(var)])


def testBatchNormMovingStatisticsFollowTheWholeBatch():
  """One update per step from all micro-batches' statistics, merged exactly."""
  p = _ResNet(splits=2, num_micro_batches=4, bn_decay=0.9)
  stack, ref = p.Instantiate(), _Reference(p)
  _CopyWeights(stack, ref)
  state = _Inputs(p)
  stack.ForwardBackward(stack.theta, state, _LossFn)
  records = []
  with py_utils.Context(updates=records):
    for chunk in _Chunks(state, 4):
      ref.FProp(ref.theta, chunk)
  stats = {}
  for layer, s in records:
    stats.setdefault(_Key(layer.vars.moving_mean).rsplit('/', 1)[0], []).append(
        s.Transform(lambda x: x.numpy()))
  assert len(stats) == 8  # Batch norms: stem 1, blocks 2 + 3 (with shortcut) + 2.
  moving = {_Key(v): v.numpy() for v in stack.variables if 'moving' in v.name}
  for name, chunks in stats.items():
    count = sum(c.count for c in chunks)
    mean = sum(c.count * c.mean for c in chunks) / count
    variance = sum(c.count * (c.variance + (c.mean - mean) ** 2) for c in chunks) / count
    _Close(moving[f'{name}/moving_mean'], 0.1 * mean)
    _Close(moving[f'{name}/moving_variance'], 0.9 + 0.1 * variance)


def testOneFOneBScheduleGivesTheSameGradients():
  p = _STACKS['encdec'](splits=2, num_micro_batches=4)
  stack = p.Instantiate()
  other = p.Copy().Set(schedule='1f1b').Instantiate()
  _CopyWeights(stack, other)
  state = _Inputs(p)
  loss, grads = stack.ForwardBackward(stack.theta, state, _LossFn)
  other_loss, other_grads = other.ForwardBackward(other.theta, state, _LossFn)
  _Close(other_loss, loss)
  tf.nest.map_structure(_Close, other_grads, grads)


# -- masks ----------------------------------------------------------------------


def testDecoderIsCausal():
  p = _STACKS['lm'](splits=2, num_micro_batches=2)
  stack, state = p.Instantiate(), _Inputs(p)
  changed = state.DeepCopy()
  changed.tgt.ids = tf.concat([state.tgt.ids[:, :3], (state.tgt.ids[:, 3:] + 1) % _VOCAB], 1)
  with py_utils.EvalMode():
    before, after = stack.FProp(stack.theta, state), stack.FProp(stack.theta, changed)
  _Close(after.xent[:, :3], before.xent[:, :3], tol=1e-6)
  assert np.all(np.abs(after.xent[:, 3:] - before.xent[:, 3:]) > 1e-6)


def testPaddedSourcePositionsDoNotMatter():
  p = _STACKS['encdec'](splits=4, num_micro_batches=2)
  stack, state = p.Instantiate(), _Inputs(p)
  padded = state.DeepCopy()
  padded.src.ids = tf.where(state.src.paddings > 0.5, 7, state.src.ids)
  real = state.DeepCopy()
  real.src.ids = tf.where(state.src.paddings > 0.5, 0, (state.src.ids + 1) % _VOCAB)
  with py_utils.EvalMode():
    base = stack.FProp(stack.theta, state)
    _Close(stack.FProp(stack.theta, padded).xent, base.xent, tol=1e-6)
    assert np.all(np.abs(stack.FProp(stack.theta, real).xent - base.xent) > 1e-6)


# -- layers against plain math ----------------------------------------------------


def _Sinusoids(length, depth):
  pos = np.arange(length)[:, None]
  freq = 1.0 / 10000.0 ** (2.0 * np.arange(depth // 2) / depth)
  return np.concatenate([np.sin(pos * freq), np.cos(pos * freq)], axis=-1)


def testEmbeddingLayerMatchesNumpy():
  layer = state_layers.GPipeEmbeddingLayer.Params().Set(
      name='emb', stream='src', vocab_size=_VOCAB, embedding_dim=6, max_len=8).Instantiate()
  state = NestedMap(src=_Sequence([5, 2], _S, 1, labeled=False), other=tf.ones([2, 3]))
  out = layer.FProp(layer.theta, state)
  table = layer.vars.emb.emb.numpy()
  _Close(out.src.vecs, table[state.src.ids.numpy()] * math.sqrt(6) + _Sinusoids(_S, 6))
  assert out.other is state.other and out.src.paddings is state.src.paddings
  assert 'ids' not in out.src  # Embedded: no later layer reads them.
  with pytest.raises(ValueError, match='max_len=8'):
    layer.FProp(layer.theta, NestedMap(src=NestedMap(ids=tf.zeros([1, 9], tf.int32))))


@pytest.mark.parametrize('tied', [False, True])
def testSoftmaxLayerMatchesNumpy(tied):
  p = state_layers.GPipeSoftmaxLayer.Params().Set(name='softmax', input_dim=6,
                                                  num_classes=_VOCAB, label_smoothing=0.1,
                                                  tie_embedding=tied)
  layer = p.Instantiate()
  seq = _Sequence([5, 2], _S, 1, labeled=True)
  seq.vecs = tf.random.stateless_normal([2, _S, 6], [3, 4])
  if tied:
    emb = state_layers.GPipeEmbeddingLayer.Params().Set(name='emb', vocab_size=_VOCAB,
                                                        embedding_dim=6).Instantiate()
    layer.ShareEmbedding(emb)
    assert layer.vars.softmax.proj.emb is emb.vars.emb.emb
    w = emb.vars.emb.emb.numpy().T
  else:
    w = layer.vars.softmax.proj.w.numpy()
  layer.vars.softmax.proj.b.assign(tf.random.stateless_normal([_VOCAB], [5, 6]))
  out = layer.FProp(layer.theta, NestedMap(tgt=seq))
  logits = seq.vecs.numpy() @ w + layer.vars.softmax.proj.b.numpy()
  log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
  labels = seq.labels.numpy()
  nll = -np.take_along_axis(log_probs, labels[..., None], -1)[..., 0]
  smoothed = 0.9 * nll - 0.1 / _VOCAB * log_probs.sum(-1)
  _Close(out.nll, nll)
  _Close(out.xent, smoothed)
  np.testing.assert_array_equal(out.argmax, log_probs.argmax(-1))
  np.testing.assert_array_equal(out.labels, labels)
  _Close(out.weights, seq.weights)


def testTiedStackSharesOneVariableAcrossStages():
  p = _STACKS['tied_lm'](splits=2)
  stack = p.Instantiate()
  emb, softmax = stack.cell[0].sub[0], stack.cell[-1].sub[-1]
  assert emb.params.name == 'tgt_emb' and softmax.params.name == 'softmax'
  assert softmax.vars.softmax.proj.emb is emb.vars.emb.emb
  assert 'w' not in softmax.vars.softmax.proj
  flat = tf.nest.flatten(stack.vars)
  assert len(flat) == len({v.ref() for v in flat}) + 1


def testTiedStackCheckpointRestoresTheSharedTableOnce(tmp_path):
  stack = _STACKS['tied_lm'](splits=2).Instantiate()
  path = tf.train.Checkpoint(stack=stack).save(str(tmp_path / 'ckpt'))
  other = _STACKS['tied_lm'](splits=2, random_seed=5).Instantiate()
  tf.train.Checkpoint(stack=other).restore(path).assert_consumed()
  for a, b in zip(stack.variables, other.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert other.cell[1].sub[-1].vars.softmax.proj.emb is other.cell[0].sub[0].vars.emb.emb


def testFPropMetaShapesMatchOutputs():
  for kind in ('encdec', 'resnet'):
    p = _STACKS[kind]()
    ref, state = _Reference(p), _Inputs(p)
    spec = state.Transform(lambda x: tf.TensorSpec(x.shape, x.dtype))
    for layer_params, layer in zip(p.cls.LayerParams(p), ref.sub):
      meta = layer_params.cls.FPropMeta(layer_params, spec)
      assert meta.flops > 0
      state = layer.FProp(layer.theta, state)
      spec = meta.out_shapes[0]
      tf.nest.assert_same_structure(spec, state)
      for s, x in zip(tf.nest.flatten(spec), tf.nest.flatten(state)):
        assert s.shape.as_list() == x.shape.as_list() and s.dtype == x.dtype, layer.path


# -- splits and configuration errors ------------------------------------------------


def _LayerNames(stack):
  return [[layer.params.name for layer in cell.sub] for cell in stack.cell]


def testIntSplitsMinimizeTheSlowestStageAndNeverLeaveTheSoftmaxAlone():
  p = _SeqStack(num_decoder_layers=3, splits=4)
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 4000  # A heavy softmax.
  assert _LayerNames(p.Instantiate()) == [['tgt_emb'], ['dec0'], ['dec1'], ['dec2', 'softmax']]

  p = _SeqStack(num_encoder_layers=4, num_decoder_layers=4, splits=3, max_seq_len=16)
  layer_params = p.cls.LayerParams(p)
  costs = profiler.LayerCosts(layer_params, p.cls.InputSpec(p))
  n = len(costs)

  def Slowest(ends):
    return max(sum(costs[a:b]) for a, b in zip([0] + ends[:-1], ends))

  best = min(Slowest([i, j, n]) for i, j in itertools.combinations(range(1, n - 1), 2))
  sizes = [len(cell) for cell in _LayerNames(p.Instantiate())]
  ends = list(np.cumsum(sizes))
  assert ends[-1] == n and sizes[-1] >= 2
  assert Slowest(ends) == pytest.approx(best)


def testExplicitSplits():
  p = _STACKS['lm'](splits=[2, 3, 5])
  assert _LayerNames(p.Instantiate()) == [['tgt_emb', 'dec0'], ['dec1'], ['dec2', 'softmax']]
  # As --model_params_override gives them, over the default count.
  p = _STACKS['lm']().FromText('splits : [2, 3, 5]')
  assert _LayerNames(p.Instantiate()) == [['tgt_emb', 'dec0'], ['dec1'], ['dec2', 'softmax']]


@pytest.mark.parametrize('splits,message', [
    (5, r'splits=5 cells, but the stack has 5 layers'),
    (0, r'expected 1 <= splits <= 4'),
    ([2, 6], r'must end at the layer count 5'),
    ([1, 2, 3, 4, 5, 6], r'must end at the layer count 5'),
    ([3, 2, 5], 'ascending'),
    ([2, 2, 5], 'ascending'),
    ([3, 4, 5], 'softmax alone'),
    ('2', 'int number of cells'),
])
def testBadSplitsAreClearErrors(splits, message):
  with pytest.raises(ValueError, match=message):
    _STACKS['lm'](splits=splits).Instantiate()


@pytest.mark.parametrize('overrides,message', [
    (dict(model_dim=30, num_heads=4), r'model_dim=30 is not divisible by num_heads=4'),
    (dict(num_decoder_layers=0), 'num_encoder_layers or num_decoder_layers'),
    (dict(dropout_prob=1.5), r'stack: dropout_prob must be in \[0, 1\), got 1.5'),
    (dict(label_smoothing=-0.1), r'stack: label_smoothing must be in \[0, 1\), got -0.1'),
    (dict(tie_embeddings=True, **{'softmax_tpl.num_classes': 12}),
     r'emb_tpl.vocab_size \(11\) == softmax_tpl.num_classes \(12\)'),
    (dict(cell_tpl=[layers.LayerNorm.Params()]), 'cell_tpl is built from the stack params'),
    # Template fields the stack sets from its own params: refused, not silently replaced.
    ({'decoder_tpl.num_heads': 1},
     r'stack: decoder_tpl.num_heads is 1, but the stack sets it from its num_heads \(2\): '
     r'set num_heads instead'),
    ({'decoder_tpl.relu_dropout_prob': 0.5}, r'relu_dropout_prob .* from its dropout_prob'),
    ({'emb_tpl.dropout_prob': 0.5}, r'emb_tpl.dropout_prob is 0.5, .* its dropout_prob \(0.0\)'),
    ({'softmax_tpl.label_smoothing': 0.3}, r'from its label_smoothing \(0.0\)'),
    # Micro-batches along the sequence would change the model (attention across them).
    (dict(batch_dim=1), r'stack: batch_dim=1, but every tensor of a stack.s state has the batch '
                        r'as dimension 0'),
])
def testBadStackConfigsAreClearErrors(overrides, message):
  with pytest.raises(ValueError, match=message):
    _SeqStack().Set(**overrides).Instantiate()


def testATemplateFieldEqualToTheStacksValueIsFine():
  """Set as the stack sets it (a config written out in full), it is no conflict."""
  _SeqStack(**{'decoder_tpl.num_heads': 2, 'emb_tpl.max_len': 8}).Instantiate()


def testATemplateReplacedByFreshParamsTakesTheStacksValues():
  """Lingvo's p.decoder_tpl = Layer.Params().Set(...): its class defaults are not the user's
  settings; a field set away from them still is."""
  p = _SeqStack(decoder_tpl=state_layers.GPipeTransformerLayer.Params().Set(activation='GELU'))
  stack = p.Instantiate()
  dec = stack.LayersByPath()['stack/dec0']
  assert (dec.params.num_heads, dec.params.input_dim, dec.params.activation) == (2, 8, 'GELU')
  with pytest.raises(ValueError, match=r'decoder_tpl.hidden_dim is 7, but the stack sets it '
                     r'from its hidden_dim \(16\)'):
    _SeqStack(
        decoder_tpl=state_layers.GPipeTransformerLayer.Params().Set(hidden_dim=7)).Instantiate()
  with pytest.raises(ValueError, match=r"decoder_tpl.mask_self_atten is False, but the stack "
                     r"sets it to True by the layer's place in it"):
    _SeqStack(**{'decoder_tpl.mask_self_atten': False}).Instantiate()


def testBadResNetConfigIsAClearError():
  with pytest.raises(ValueError, match=r'image_shape must be \(height, width, channels\)'):
    _ResNet(image_shape=(8, 8)).Instantiate()
  with pytest.raises(ValueError, match=r'block_channels\[1\] must be a positive int'):
    _ResNet(block_channels=[4, 0]).Instantiate()
