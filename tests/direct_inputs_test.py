"""Inputs sent straight to the last chunk: exact against plain TensorFlow, and not handed on."""

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.pipeline import direct_inputs
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules

NestedMap = py_utils.NestedMap
DIM, TARGET_DIM, BATCH = 8, 3, 16
_V = {'interleaved_1f1b': 2, 'zbv': 2}


class _Res(base_layer.BaseLayer):
  """state.x += relu(state.x @ w); every other field passes through."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', py_utils.WeightParams([DIM, DIM]))

  def FProp(self, theta, state):
    return NestedMap(state, x=state.x + tf.nn.relu(state.x @ theta.w))


class _Head(base_layer.BaseLayer):
  """The last layer: per-row squared error of x @ w against state.y, and state.weight."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateVariable('w', py_utils.WeightParams([DIM, TARGET_DIM]))

  def FProp(self, theta, state):
    err = tf.reduce_sum(tf.square(state.x @ theta.w - state.y), axis=1)
    return NestedMap(err=err, weight=state.target.weight)


class _ReadsY(_Res):
  """A layer that reads y, which it must not be sent apart from."""

  def FProp(self, theta, state):
    return NestedMap(state, x=state.x + tf.reduce_mean(state.y))


class _WritesY(_Res):
  def FProp(self, theta, state):
    return NestedMap(super().FProp(theta, state), y=state.x[:, :TARGET_DIM])


_PATHS = ['y', 'target.weight']


def _Pipe(sched, k=4, m=4, paths=_PATHS, first=_Res, before=(), **kwargs):
  v = _V.get(sched, 1)
  layer_params = [first.Params()] + [_Res.Params() for _ in range(2 * k * v - 2)] + [
      _Head.Params()]
  for i, p in enumerate(layer_params):
    p.name = f'layer{i}'
  cells = gpipe.CellsFromEnds(layer_params, list(range(2, 2 * k * v + 1, 2)))
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m, schedule=sched, virtual_stages=v,
      last_chunk_inputs=paths, before_tpl=list(before), **kwargs).Instantiate()


def _Inputs():
  return NestedMap(x=tf.random.stateless_normal([BATCH, DIM], [1, 2]),
                   y=tf.random.stateless_normal([BATCH, TARGET_DIM], [3, 4]),
                   target=NestedMap(weight=tf.range(BATCH, dtype=tf.float32) % 3))


def _Loss(out):
  return tf.reduce_sum(out.err * out.weight) / tf.reduce_sum(out.weight), tf.reduce_sum(
      out.weight)


def _Reference(pipe, inputs, x=None):
  """Plain TensorFlow on the pipeline's weights: the whole batch on one device."""
  thetas = [sub for cell in pipe.theta.cell for sub in cell.sub]
  x = inputs.x if x is None else x
  for t in thetas[:-1]:
    x = x + tf.nn.relu(x @ t.w)
  err = tf.reduce_sum(tf.square(x @ thetas[-1].w - inputs.y), axis=1)
  w = inputs.target.weight
  return tf.reduce_sum(err * w) / tf.reduce_sum(w)


def _AssertExact(pipe, loss, grads, reference):
  with tf.GradientTape() as tape:
    ref_loss = reference()
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  for var, ref in zip(pipe.trainable_variables, ref_grads):
    np.testing.assert_allclose(by_name[var.name], ref, rtol=1e-4, atol=1e-5)


def _ChunkCallInputShapes(graph):
  """Per chunk, the shapes of the tensors its action calls take (its theta, input, ...)."""
  shapes = {}
  for op in graph.get_operations():
    if op.type in ('PartitionedCall', 'StatefulPartitionedCall') and '_F' in op.name:
      chunk = int(op.name.split('/')[0].split('_')[0][len('chunk'):])
      shapes.setdefault(chunk, set()).update(tuple(i.shape.as_list()) for i in op.inputs)
  return shapes


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testExactAndNotHandedThroughTheStages(sched):
  pipe = _Pipe(sched)
  inputs = _Inputs()
  step = tf.function(lambda: pipe.ForwardBackward(pipe.theta, inputs, _Loss))
  loss, grads = step()
  _AssertExact(pipe, loss, grads, lambda: _Reference(pipe, inputs))
  shapes = _ChunkCallInputShapes(step.get_concrete_function().graph)
  last = len(pipe.cell) - 1
  assert sorted(shapes) == list(range(last + 1))
  rows = BATCH // 4
  for c, seen in shapes.items():
    # y [rows, 3] and weight [rows] reach the last chunk's forward, no other.
    assert ((rows, TARGET_DIM) in seen and (rows,) in seen) == (c == last), (c, seen)


def testUnchangedWithoutAndBitwiseEqual():
  inputs = _Inputs()
  results = []
  for paths in (_PATHS, []):
    tf.random.set_seed(5)
    pipe = _Pipe('1f1b', paths=paths)
    loss, grads = tf.function(lambda: pipe.ForwardBackward(pipe.theta, inputs, _Loss))()
    results.append([loss.numpy()] + [g.numpy() for g in tf.nest.flatten(grads)])
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)


def testInALoopOfTheSteadyState():
  pipe = _Pipe('1f1b', k=2, m=8, loop_steady_state=True)
  inputs = _Inputs()
  loss, grads = tf.function(lambda: pipe.ForwardBackward(pipe.theta, inputs, _Loss))()
  _AssertExact(pipe, loss, grads, lambda: _Reference(pipe, inputs))


class _ProjX(layers.ProjectionLayer):
  def FProp(self, theta, state):
    return NestedMap(state, x=super().FProp(theta, state.x))


def testBeforeLayersTakeTheFirstChunksInputGradients():
  before = _ProjX.Params().Set(name='proj', input_dim=DIM, output_dim=DIM)
  pipe = _Pipe('zb_h1', before=[before])
  inputs = _Inputs()
  loss, grads = pipe.ForwardBackward(pipe.theta, inputs, _Loss)
  proj = pipe.theta.before[0]
  _AssertExact(pipe, loss, grads,
               lambda: _Reference(pipe, inputs, x=inputs.x @ proj.w + proj.b))


def testEvalAndTapeForwards():
  pipe = _Pipe('gpipe')
  inputs = _Inputs()
  with py_utils.EvalMode():
    np.testing.assert_allclose(_Loss(pipe.FProp(pipe.theta, inputs))[0],
                               _Reference(pipe, inputs), rtol=1e-5)
  with tf.GradientTape() as tape:
    loss = _Loss(pipe.FProp(pipe.theta, inputs))[0]
  grads = tape.gradient(loss, pipe.trainable_variables)
  with tf.GradientTape() as tape:
    ref = _Reference(pipe, inputs)
  for g, r in zip(grads, tape.gradient(ref, pipe.trainable_variables)):
    np.testing.assert_allclose(g, r, rtol=1e-4, atol=1e-5)


def testAnEarlierChunkReadingOneIsAClearError():
  pipe = _Pipe('1f1b', first=_ReadsY)
  with pytest.raises(ValueError, match=r"chunk 0 failed on a field it lacks \(.*keys: \['target', 'x'\]\)\. "
                     r"last_chunk_inputs sends these from the batch straight to later chunks: "
                     r"'y' to chunk 3, 'target.weight' to chunk 3;"):
    pipe.ForwardBackward(pipe.theta, _Inputs(), _Loss)


def testAnEarlierChunkWritingOneIsAClearError():
  pipe = _Pipe('1f1b', first=_WritesY, paths=['target.weight'])
  pipe.ForwardBackward(pipe.theta, _Inputs(), _Loss)  # y is not sent apart: fine.
  pipe = _Pipe('1f1b', first=_WritesY, paths=['y'])
  with pytest.raises(ValueError, match=r"A layer of chunk 0 writes 'y', which is sent straight from the batch to chunk 3"):
    pipe.ForwardBackward(pipe.theta, _Inputs(), _Loss)


def testMissingPathOrBadInputIsAClearError():
  with pytest.raises(ValueError, match=r"'target.wieght', which the pipeline input does not "
                     r"have; its fields: \['target.weight', 'x', 'y'\]"):
    pipe = _Pipe('1f1b', paths=['target.wieght'])
    pipe.ForwardBackward(pipe.theta, _Inputs(), _Loss)
  with pytest.raises(ValueError, match="'target', a NestedMap"):
    pipe = _Pipe('1f1b', paths=['target'])
    pipe.ForwardBackward(pipe.theta, _Inputs(), _Loss)
  with pytest.raises(ValueError, match=r"expected one NestedMap"):
    direct_inputs.DirectInputs(['y'], {}, (tf.zeros([2]),), 2)
  for bad in ('y', [''], ['a..b'], [3]):
    with pytest.raises(ValueError, match='last_chunk_inputs='):
      _Pipe('1f1b', paths=bad)


def testDefaultsOnlyWhereTheInputHasThem():
  state = NestedMap(x=tf.ones([2, 1]), t=NestedMap(a=tf.ones([2]), b=tf.zeros([2]),
                                                   c=tf.zeros([2])))
  direct = direct_inputs.DirectInputs(None, {'t.b': -1, 't.c': 1, 't.a': 0, 't.d': -1},
                                      (state,), 3)
  assert direct.joins == {'t.b': 2, 't.c': 1}  # t.a rides with the first chunk's input.
  (rest,), side = direct.Without((state,))
  assert sorted(rest.t) == ['a'] and sorted(state.t) == ['a', 'b', 'c']  # Unchanged input.
  assert side == [state.t.b, state.t.c]
  (at1,) = direct.Joined((rest,), (state,), 1)
  assert sorted(at1.t) == ['a', 'c'] and at1.t.c is state.t.c
  (at2,) = direct.Joined((at1,), (state,), 2)
  assert at2.t.b is state.t.b and at2.x is state.x
  (grads,) = direct.ArgGrads((NestedMap(x=1, t=NestedMap(a=2, b=3, c=4)),), 2)
  assert grads == NestedMap(x=1, t=NestedMap(a=2, c=4))  # b's gradient stays at chunk 2.
  (grads,) = direct.ArgGrads((NestedMap(x=1, t=NestedMap(a=2)),), 0)
  assert grads == NestedMap(x=1, t=NestedMap(a=2, b=None, c=None))
  assert not direct_inputs.DirectInputs(['t.b'], {}, (state,), 1)  # One chunk: nothing apart.


def _LmStack(**kwargs):
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      **dict(dict(name='lm', model_dim=8, num_heads=2, hidden_dim=16, num_decoder_layers=4,
                  splits=4, num_micro_batches=2, schedule='1f1b', max_seq_len=6), **kwargs))
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 7
  return p.Instantiate()


def testAStacksIntegersReachOnlyTheirChunks():
  """A language model's ids reach only the embedding's chunk, its labels only the softmax's:
  the middle chunks' forward calls take no int32 tensor."""
  ids = tf.constant(np.random.RandomState(0).randint(0, 7, [4, 6]), tf.int32)
  state = NestedMap(tgt=NestedMap(ids=ids, labels=tf.roll(ids, 1, 1), paddings=tf.zeros([4, 6]),
                                  weights=tf.ones([4, 6])))

  def Loss(out):
    return tf.reduce_mean(out.xent), tf.constant(24.0)

  int_inputs = {}
  for paths in (None, []):
    stack = _LmStack(last_chunk_inputs=paths)
    step = tf.function(lambda: stack.ForwardBackward(stack.theta, state, Loss))
    step()
    for op in step.get_concrete_function().graph.get_operations():
      if op.type in ('PartitionedCall', 'StatefulPartitionedCall') and '_F' in op.name:
        chunk = op.name.split('/')[0].split('_')[0]
        int_inputs.setdefault((paths is None, chunk), set()).update(
            i.shape.as_list()[-1] for i in op.inputs if i.dtype == tf.int32)
  assert int_inputs[(True, 'chunk0')] == {6}  # ids
  assert int_inputs[(True, 'chunk1')] == int_inputs[(True, 'chunk2')] == set()
  assert int_inputs[(True, 'chunk3')] == {6}  # labels
  assert int_inputs[(False, 'chunk2')] == {6}  # Sent through: the labels ride along.


def testATranslationModelsTargetSkipsTheEncodersChunks():
  """The target stream joins at its embedding's chunk, its labels at the last: exact, and
  the encoder's chunks take no target field."""
  rng = np.random.RandomState(1)
  src, tgt = (tf.constant(rng.randint(0, 7, [4, 6]), tf.int32) for _ in range(2))
  state = NestedMap(
      src=NestedMap(ids=src, paddings=tf.zeros([4, 6])),
      tgt=NestedMap(ids=tgt, labels=tf.roll(tgt, -1, 1), paddings=tf.zeros([4, 6]),
                    weights=tf.constant(rng.rand(4, 6), tf.float32)))

  def Loss(out):
    return tf.reduce_sum(out.xent * out.weights) / tf.reduce_sum(out.weights), tf.reduce_sum(
        out.weights)

  results, inputs = [], {}
  for paths in (None, []):
    tf.random.set_seed(3)
    # Layers: src_emb, enc0, enc1, tgt_emb, dec0, dec1, softmax; cells end at 2, 3, 5, 7.
    stack = _LmStack(last_chunk_inputs=paths, num_encoder_layers=2, num_decoder_layers=2,
                     splits=[2, 3, 5, 7])
    step = tf.function(lambda: stack.ForwardBackward(stack.theta, state, Loss))
    loss, grads = step()
    results.append([loss.numpy()] + [g.numpy() for g in tf.nest.flatten(grads)])
    for op in step.get_concrete_function().graph.get_operations():
      if op.type in ('PartitionedCall', 'StatefulPartitionedCall') and '_F' in op.name:
        inputs.setdefault((paths is None, op.name.split('/')[0].split('_')[0]), []).append(
            len(op.inputs))
  for a, b in zip(*results):
    np.testing.assert_array_equal(a, b)
  # Per chunk, its forward call's inputs: fewer where the target skips (chunks 0 and 1: its
  # ids, labels, paddings and weights) or its labels and weights do (chunk 2).
  for chunk, fewer in (('chunk0', 4), ('chunk1', 4), ('chunk2', 2), ('chunk3', 0)):
    assert {n + fewer for n in inputs[(True, chunk)]} == set(inputs[(False, chunk)]), chunk
