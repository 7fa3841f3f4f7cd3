"""Tests of lingvo_gpipe.pipeline.gpipe against plain TensorFlow math on the same weights."""

import functools
import itertools

import numpy as np
import pytest
import tensorflow as tf

import pairwise
from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import memory_stats
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import conv
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules

DIM, HIDDEN, BATCH = 8, 16, 16


class _Res(base_layer.BaseLayer):
  """x + relu(x @ w1) @ w2, casting to the fprop dtype like a real layer."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Model width.')
    p.Define('hidden', HIDDEN, 'Hidden width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('w1', py_utils.WeightParams([p.dim, p.hidden]))
    self.CreateVariable('w2', py_utils.WeightParams([p.hidden, p.dim]))

  def FProp(self, theta, x):
    theta, x = self.ToFPropDtype(theta), self.ToFPropDtype(x)
    return x + tf.nn.relu(x @ theta.w1) @ theta.w2


class _MapRes(_Res):
  """The residual block on NestedMap(x, mask): mask (int) passes through unchanged."""

  def FProp(self, theta, inputs):
    x = super().FProp(theta, inputs.x) * tf.cast(inputs.mask, self.fprop_dtype)[:, None]
    return py_utils.NestedMap(x=x, mask=inputs.mask)


# Chunks per device of the schedules that run more than one.
_V = {'interleaved_1f1b': 2, 'zbv': 2}


def _Pipe(num_stages, num_micro_batches, remat='always', sched='gpipe', num_layers=8,
          layer=_Res, **kwargs):
  """K = num_stages devices holding K * v cells (v: _V's chunks per device of `sched`)."""
  v = kwargs.pop('virtual_stages', None) or _V.get(sched, 1)
  cells = gpipe.PartitionSequentialLayers([layer.Params() for _ in range(num_layers)],
                                          num_stages * v, tf.TensorShape([BATCH, DIM]),
                                          cost='params')
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num_micro_batches, remat=remat,
      schedule=sched, virtual_stages=v, **kwargs).Instantiate()


def _LayerThetas(pipe):
  return [sub for cell in pipe.theta.cell for sub in cell.sub]


def _Reference(pipe, x):
  """Plain TF math on the pipeline's weights: the whole batch on one device."""
  for t in _LayerThetas(pipe):
    x = x + tf.nn.relu(x @ t.w1) @ t.w2
  return x


def _Input(seed=1):
  return tf.random.stateless_normal([BATCH, DIM], [seed, 2])


def _Loss(y):
  return tf.reduce_mean(tf.square(y - 0.5))


def _ReferenceLossAndGrads(pipe, x):
  with tf.GradientTape() as tape:
    loss = _Loss(_Reference(pipe, x))
  return loss, tape.gradient(loss, pipe.trainable_variables)


def _RelErr(a, b):
  """Largest error on the scale of b (float32 sums in another order differ by ~1e-7
  of the largest value, which element-wise tolerances mistake for errors near 0)."""
  a, b = (np.asarray(tf.convert_to_tensor(t), np.float64) for t in (a, b))
  return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)


def _AssertGradsClose(grads, ref_grads, tol=1e-5):
  """Relative error <= tol; a gradient that is ~0 (rounding noise) is judged on the
  scale of the largest gradient instead of on its own."""
  assert len(grads) == len(ref_grads)
  ref = [np.asarray(tf.convert_to_tensor(r), np.float64) for r in ref_grads]
  scale = max((np.max(np.abs(r)) for r in ref), default=0.0)
  for g, r in zip(grads, ref):
    err = np.max(np.abs(np.asarray(tf.convert_to_tensor(g), np.float64) - r))
    assert err <= tol * max(np.max(np.abs(r)), 0.1 * scale)


def _EveryCutWithRematCycled():
  """Every schedule at every (K, M); remat cycles so that it meets every schedule, K and M
  (and, across schedules, every (K, M)): 72 cases where the full grid has 216."""
  remats = gpipe.REMAT_MODES
  return [(sched, k, m, remats[(s + i + j) % len(remats)])
          for s, sched in enumerate(named_schedules.SCHEDULE_NAMES)
          for i, k in enumerate([1, 2, 4]) for j, m in enumerate([1, 2, 4, 8])]


@pytest.mark.parametrize('sched,k,m,remat', _EveryCutWithRematCycled())
def testForwardBackwardIsExact(sched, k, m, remat):
  pipe = _Pipe(k, m, remat, sched)
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  # grads mirrors theta; theta's variables in the same order as trainable_variables.
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('sched,kmr,remat', pairwise.EveryPair(
    named_schedules.SCHEDULE_NAMES, [(3, 3, 1), (2, 3, 2), (4, 1, 2), (3, 2, 2)],
    gpipe.REMAT_MODES))
def testEveryScheduleIsExactWithOddSizesAndReplicas(sched, kmr, remat):
  """K = 3, M = 3 (the batch not a power of 2), M < K, and R = 2 replicas."""
  k, m, r = kmr

  def Build():
    return _Pipe(k, m, remat, sched, num_layers=12, num_replicas=r, allow_device_reuse=True)

  if sched == 'interleaved_1f1b' and m > k and m % k:  # Micro-batches go in groups of K.
    with pytest.raises(ValueError, match=f'num_micro_batches={m} must be at most K'):
      Build()
    return
  pipe = Build()
  x = tf.random.stateless_normal([4 * m * r, DIM], [5, 6])
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('remat', ['always', 'never'])
def testSchedulesThatSumInTheSameOrderGiveBitwiseTheSameGradients(remat):
  """1F1B, ZB-H1, ZB-H2, interleaved and ZB-V add each chunk's micro-batch weight gradients
  in micro-batch order, fused (BW) or split (B, then W from B's tape): bit for bit the same."""
  grads = {}
  for sched in ('1f1b', 'zb_h1', 'zb_h2', 'interleaved_1f1b', 'zbv'):
    pipe = _Pipe(2, 4, remat, sched)
    if grads:
      for a, b in zip(pipe.variables, first.variables):
        a.assign(b)
    else:
      first = pipe
    _, g = tf.function(pipe.ForwardBackward)(pipe.theta, _Input(), _Loss, loss_reduction='mean')
    # By layer: the cells differ between one and two chunks per device.
    grads[sched] = [np.asarray(t) for t in tf.nest.flatten([c.sub for c in g.cell])]
  for sched, got in grads.items():
    assert all(np.array_equal(a, b) for a, b in zip(got, grads['1f1b'])), sched


class _Tangled(base_layer.BaseLayer):
  """Weights used where a split backward must not assume them: a child called twice, a
  child's weight read outside the child's FProp, and a weight of its own. (Taking each
  weight gradient from its own layer call's outputs alone, a shortcut for W, got the
  borrowed weight's gradient wrong by 0.19 of its scale: this case keeps W whole.)"""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', DIM, 'Model width.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('inner', _Res.Params())
    self.CreateVariable('scale', py_utils.WeightParams([self.params.dim]))

  def FProp(self, theta, x):
    y = self.inner.FProp(theta.inner, x) + self.inner.FProp(theta.inner, 0.5 * x)
    return y * theta.scale + tf.tanh(x @ theta.inner.w1) @ theta.inner.w2


@pytest.mark.parametrize('sched', ['zb_h1', 'zbv'])
@pytest.mark.parametrize('remat', ['always', 'never'])
def testSplitWeightGradientsOfSharedAndBorrowedWeightsAreExact(sched, remat):
  """Split B and W give the plain model's gradients for weights shared between calls and
  read outside their layer."""
  pipe = _Pipe(2, 4, remat, sched, num_layers=4, layer=_Tangled)
  plain = _Pipe(1, 1, remat, 'gpipe', num_layers=4, layer=_Tangled)
  for a, b in zip(plain.variables, pipe.variables):
    a.assign(b)
  x = _Input()
  ref_loss, ref_grads = plain.ForwardBackward(plain.theta, x, _Loss, loss_reduction='mean')
  loss, grads = tf.function(pipe.ForwardBackward)(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  ref = tf.nest.flatten([c.sub for c in ref_grads.cell])
  _AssertGradsClose(tf.nest.flatten([c.sub for c in grads.cell]), ref)


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEvalThenTrainWithEverySchedule(sched):
  """Eval runs the schedule's forwards on its placement (zbv's V included), then training
  still gives the plain model's gradients."""
  pipe = _Pipe(2, 2, 'always', sched)
  x = _Input()
  with py_utils.EvalMode():
    assert _RelErr(pipe(x), _Reference(pipe, x)) <= 1e-5
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('k,m,remat', itertools.product([1, 2, 4], [1, 2, 4, 8],
                                                       gpipe.REMAT_MODES))
def testFPropUnderTapeIsExact(k, m, remat):
  pipe = _Pipe(k, m, remat)
  x = _Input()
  assert _RelErr(pipe(x), _Reference(pipe, x)) <= 1e-5
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  with tf.GradientTape() as tape:
    tape.watch(x)
    loss = _Loss(pipe(x))
  grads = tape.gradient(loss, list(pipe.trainable_variables) + [x])
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertGradsClose(grads[:-1], ref_grads)
  with tf.GradientTape() as tape:
    tape.watch(x)
    ref_x_loss = _Loss(_Reference(pipe, x))
  assert _RelErr(grads[-1], tape.gradient(ref_x_loss, x)) <= 1e-5


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEagerStepsTraceEachCellFunctionOnce(sched, caplog):
  """Every later micro-batch and step reuses the cells' traced functions: a retrace costs
  time, and TensorFlow warns about it (eagerly) as if the user had made a mistake. With
  more than 4 cells it also warns if it counts the cells' functions as one."""
  pipe = _Pipe(8, 4, sched=sched, num_layers=16, allow_device_reuse=True)
  for seed in (1, 2):
    pipe.ForwardBackward(pipe.theta, _Input(seed), _Loss, loss_reduction='mean')
  assert not [r for r in caplog.records if 'retracing' in r.getMessage()]
  functions = [f for cell in pipe.cell_functions[0] for f in vars(cell).values()
               if isinstance(f, tf.types.experimental.PolymorphicFunction)]
  counts = [f.experimental_get_tracing_count() for f in functions]
  # A zero-bubble pipe never calls the fused backward's functions, nor a 1F1B one B's.
  assert counts and set(counts) - {0} == {1}, counts


@pytest.mark.parametrize('k,m,sched', [(4, 8, 'gpipe'), (2, 4, '1f1b'), (4, 2, '1f1b')])
def testInsideTfFunction(k, m, sched):
  """Exact, and traced once where a step is given and the gradient sums are made (as the
  trainer does): a trace that makes variables makes tf.function trace the step again."""
  pipe = _Pipe(k, m, 'except_last', sched)
  cell_functions.CreateGradientSums(pipe)
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  traces = []

  @tf.function
  def Step(x):
    traces.append(x)
    loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    if sched != 'gpipe':
      return loss, tf.nest.flatten(grads)
    with tf.GradientTape() as tape:
      tape_loss = _Loss(pipe(x))
    return tape_loss, tape.gradient(tape_loss, pipe.trainable_variables)

  with py_utils.Context(step=tf.constant(0, tf.int64)):
    loss, grads = Step(x)
  assert len(traces) == 1
  assert _RelErr(loss, ref_loss) <= 1e-5
  if sched != 'gpipe':
    by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), grads)}
    grads = [by_name[v.name] for v in pipe.trainable_variables]
  _AssertGradsClose(grads, ref_grads)


@pytest.mark.parametrize('sched', ['1f1b', 'zb_h1'])
def testStepsTracedApartReuseTheChunksFunctions(sched):
  """Each action is a call of a function of its chunk, traced once per chunk and kind (and
  per training flag): a second step function, an eval pass and more calls trace no chunk
  function again, and each step function once."""
  pipe = _Pipe(2, 4, 'always', sched)
  cell_functions.CreateGradientSums(pipe)
  steps = [tf.function(lambda x: pipe.ForwardBackward(pipe.theta, x, _Loss,
                                                      loss_reduction='mean')[0])
           for _ in range(2)]

  @tf.function
  def Evaluate(x):
    with py_utils.EvalMode():
      return pipe(x)

  for seed in (1, 2):
    with py_utils.Context(step=tf.constant(seed, tf.int64)):  # As the trainer gives one.
      for step in steps:
        step(_Input(seed))
    Evaluate(_Input(seed))
  assert [s.experimental_get_tracing_count() for s in steps] == [1, 1]
  assert Evaluate.experimental_get_tracing_count() == 1
  counts = {name: f.experimental_get_tracing_count()
            for c, cell in enumerate(pipe.cell_functions[0]) for name, f in
            ((f'{c}{n}', f) for n, f in vars(cell).items())
            if isinstance(f, tf.types.experimental.PolymorphicFunction)}
  used = {n: k for n, k in counts.items() if k}
  # The forwards twice, training and evaluating; the others once.
  assert used == {n: 2 if n.endswith('_forward') else 1 for n in used}, used
  assert sum(n.endswith('_forward') for n in used) == pipe.num_chunks


@pytest.mark.parametrize('sched', ['gpipe', 'zb_h1'])
def testPassesInOneFunctionEachSumTheirOwnGradients(sched):
  """Each pass starts its chunks' in-place gradient sums afresh, after the last pass read
  them: fused backwards (gpipe) and split weight gradients (zb_h1); FProp under a tape."""
  pipe = _Pipe(2, 2, 'always', sched)
  inputs = [_Input(1), _Input(2)]

  def Ordered(grads):
    by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
    return [by_name[v.name] for v in pipe.trainable_variables]

  @tf.function
  def Steps():
    grads = [Ordered(pipe.ForwardBackward(pipe.theta, x, _Loss,
                                          loss_reduction='mean')[1]) for x in inputs]
    if sched == 'gpipe':
      with tf.GradientTape() as tape:
        loss = _Loss(pipe(inputs[0]))
      grads.append(tape.gradient(loss, pipe.trainable_variables))
    return grads

  grads = Steps()
  for x, pass_grads in zip(inputs + inputs[:1], grads):
    _AssertGradsClose(pass_grads, _ReferenceLossAndGrads(pipe, x)[1])


class _MapProj(layers.ProjectionLayer):
  """Projects NestedMap.x, keeping the mask: a before_tpl layer."""

  def FProp(self, theta, inputs):
    return py_utils.NestedMap(x=super().FProp(theta, inputs.x), mask=inputs.mask)


@pytest.mark.parametrize('remat', ['always', 'never'])
@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testNestedMapInputsWithIntegerLeavesAndBeforeLayers(sched, remat):
  """A before layer trains through the first chunk's input gradients, which every schedule
  takes only when such a layer needs them."""
  v = _V.get(sched, 1)
  cells = gpipe.PartitionSequentialLayers([_MapRes.Params() for _ in range(4)], 2 * v,
                                          tf.TensorShape([BATCH, DIM]), cost='params')
  before = [_MapProj.Params().Set(name='proj', input_dim=DIM, output_dim=DIM)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, before_tpl=before, num_micro_batches=4, schedule=sched,
      virtual_stages=v, remat=remat).Instantiate()
  mask = tf.constant([1, 0] * (BATCH // 2))
  x = _Input()

  def Reference():
    proj = pipe.theta.before[0]
    h = x @ proj.w + proj.b
    for t in _LayerThetas(pipe):
      h = (h + tf.nn.relu(h @ t.w1) @ t.w2) * tf.cast(mask, tf.float32)[:, None]
    return h

  def Loss(out):
    assert out.mask.dtype == tf.int32
    return _Loss(out.x)

  with tf.GradientTape() as tape:
    ref_loss = _Loss(Reference())
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  inputs = py_utils.NestedMap(x=x, mask=mask)
  loss, grads = pipe.ForwardBackward(pipe.theta, inputs, Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)
  if sched == 'gpipe':
    with tf.GradientTape() as tape:
      tape_loss = Loss(pipe(inputs))
    _AssertGradsClose(tape.gradient(tape_loss, pipe.trainable_variables), ref_grads)


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testWeightedMetricsMergeExactly(sched):
  """(value, weight) metrics of micro-batches merge to the whole batch's."""
  pipe = _Pipe(2, 4, 'always', sched)
  x = _Input()

  def Weights(y):
    """Each row's weight, 0, 1 or 2 by its outputs: an uneven weight per micro-batch. (A
    loss reads nothing but its arguments: the probe calls it too.)"""
    return tf.cast(tf.reduce_sum(tf.cast(y > 0, tf.int32), axis=1) % 3, tf.float32)

  def Metrics(y, w):
    per_example = tf.reduce_mean(tf.square(y - 0.5), axis=1)
    total = tf.reduce_sum(w)
    return py_utils.NestedMap(
        loss=(tf.reduce_sum(per_example * w) / total, total),
        big=(tf.reduce_mean(tf.cast(y > 0, tf.float32)), tf.constant(float(y.shape[0]))))

  def LossFn(out):
    return Metrics(out, Weights(out))

  with tf.GradientTape() as tape:
    ref = LossFn(_Reference(pipe, x))
  ref_grads = tape.gradient(ref.loss[0], pipe.trainable_variables)
  metrics, grads = pipe.ForwardBackward(pipe.theta, x, LossFn, loss_reduction='mean')
  for name in ('loss', 'big'):
    assert _RelErr(metrics[name][0], ref[name][0]) <= 1e-5
    assert float(metrics[name][1]) == pytest.approx(float(ref[name][1]))
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


def testFetchedActivations():
  cells = gpipe.PartitionSequentialLayers([_Res.Params() for _ in range(4)], 2,
                                          tf.TensorShape([BATCH, DIM]), cost='params')
  cells[0].act_fetch_layers = ['layer0']
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4).Instantiate()
  x = _Input()
  t0 = _LayerThetas(pipe)[0]
  ref_act = x + tf.nn.relu(x @ t0.w1) @ t0.w2
  out, acts = pipe(x)
  assert _RelErr(acts.layer0, ref_act) <= 1e-5
  assert _RelErr(out, _Reference(pipe, x)) <= 1e-5

  def Loss(y, a):
    return _Loss(y) + tf.reduce_mean(a.layer0 ** 3)

  with tf.GradientTape() as tape:
    h = x + tf.nn.relu(x @ t0.w1) @ t0.w2
    ref_loss = Loss(_Reference(pipe, x), py_utils.NestedMap(layer0=h))
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  with tf.GradientTape() as tape:
    loss = Loss(*pipe(x))
  _AssertGradsClose(tape.gradient(loss, pipe.trainable_variables), ref_grads)
  for sched in [name for name in named_schedules.SCHEDULE_NAMES if name not in _V]:
    p = pipe.params.Copy().Set(schedule=sched)
    other = p.Instantiate()
    for a, b in zip(other.variables, pipe.variables):
      a.assign(b)
    fb_loss, grads = other.ForwardBackward(other.theta, x, Loss, loss_reduction='mean')
    assert _RelErr(fb_loss, ref_loss) <= 1e-5
    by_name = {v.name: g for v, g in zip(tf.nest.flatten(other.theta), tf.nest.flatten(grads))}
    _AssertGradsClose([by_name[v.name] for v in other.trainable_variables], ref_grads)


def _StepOf(op_name):
  """'chunk{c}_{F|B|W|BW}{m}' for an op of a pipeline action (also its gradient ops), else
  None."""
  return next((part for part in op_name.split('/') if part.startswith('chunk') and '_' in part),
              None)


def _ChunkOf(step):
  return int(step[len('chunk'):step.index('_')])


def _StepOps(graph):
  """Step name scope -> ops, from a traced graph."""
  scopes = {}
  for op in graph.get_operations():
    step = _StepOf(op.name)
    if step:
      scopes.setdefault(step, []).append(op)
  return scopes


def _CalledNodes(library, node, caller_device=''):
  """(NodeDef, device) run by `node`: itself, and the bodies of functions it calls.

  A node without a device of its own runs where its function is called.
  """
  device = node.device or caller_device
  nodes = [(node, device)]
  for attr in node.attr.values():
    if attr.HasField('func') and attr.func.name in library:
      for inner in library[attr.func.name].node_def:
        nodes += _CalledNodes(library, inner, device)
  return nodes


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEveryOpOfCellKRunsOnDeviceK(sched):
  pipe = _Pipe(4, 4, 'always', sched)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  graph_def = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph.as_graph_def()
  library = {f.signature.name: f for f in graph_def.library.function}
  steps = {}
  for node in graph_def.node:
    step = _StepOf(node.name)
    if step:
      steps.setdefault(step, []).extend(_CalledNodes(library, node))
  actions = [s.action for s in pipe.GetSchedule(BATCH).steps if s.action.kind != 'L']
  assert len(steps) == len(actions)  # Every action but the loss has ops of its own.
  for step, nodes in steps.items():
    want = tf.DeviceSpec.from_string(pipe.devices[pipe.placement[_ChunkOf(step)]])
    if '_W' not in step:  # The cell's work is in the step (W's ops are named after B's).
      assert any(n.op == 'MatMul' for n, _ in nodes), step
    for n, device in nodes:
      got = tf.DeviceSpec.from_string(device)
      assert (got.device_type, got.device_index) == (want.device_type, want.device_index), (
          step, n.name, n.op, device)
  # The variables of cell c live on its device too.
  for c, cell in enumerate(pipe.cell):
    for v in cell.variables:
      assert tf.DeviceSpec.from_string(v.device).device_index == pipe.placement[c]


def _MatMulsRun(graph):
  """MatMul ops a traced step runs: those its outputs and stateful ops wait for (TensorFlow
  prunes the others from a function before it runs)."""
  seen, todo = set(), [t.op for t in graph.outputs] + list(graph.control_outputs)
  while todo:
    op = todo.pop()
    if op.name not in seen:
      seen.add(op.name)
      todo += [t.op for t in op.inputs] + list(op.control_inputs)
  return sum(graph.get_operation_by_name(name).type == 'MatMul' for name in seen)


def _FunctionMatMuls(graph, name):
  """MatMuls each traced function whose name holds `name` runs (its returned values and
  stateful ops need them; calls of other functions counted in), by function name."""
  library = {f.signature.name: f for f in graph.as_graph_def().library.function}

  def Count(fn):
    nodes = {n.name: n for n in fn.node_def}
    todo = [v.split(':')[0] for v in list(fn.ret.values()) + list(fn.control_ret.values())]
    seen, total = set(), 0
    while todo:
      node = nodes.get(todo.pop().lstrip('^'))
      if node is None or node.name in seen:
        continue
      seen.add(node.name)
      total += node.op == 'MatMul'
      if 'f' in node.attr and node.attr['f'].func.name in library:
        total += Count(library[node.attr['f'].func.name])
      todo += [x.split(':')[0] for x in node.input]
    return total

  return {n: Count(f) for n, f in library.items() if name in n}


class _ProjRes(base_layer.BaseLayer):
  """x + proj2(relu(proj1(x))): each weight used by a layer call of its own."""

  def __init__(self, params):
    super().__init__(params)
    proj = layers.ProjectionLayer.Params().Set(has_bias=False)
    self.CreateChild('proj1', proj.Copy().Set(input_dim=DIM, output_dim=HIDDEN))
    self.CreateChild('proj2', proj.Copy().Set(input_dim=HIDDEN, output_dim=DIM))

  def FProp(self, theta, x):
    return x + self.proj2.FProp(theta.proj2, tf.nn.relu(self.proj1.FProp(theta.proj1, x)))


@pytest.mark.parametrize('layer', [_ProjRes, _Res])
def testAStepRunsThePlainModelsMatMulsPerMicroBatch(layer):
  """Without re-materialization (1F1B) each micro-batch costs what the plain model's step
  costs: the forward's call keeps what its backward needs, and nothing is recomputed. (The
  backward TensorFlow makes of a call holds the gradient of every input: the first chunk's
  also that of the pipeline's input, which nothing uses; the backward call, unlike the
  actions' own, may be inlined, and its unused outputs pruned.)"""
  pipe = _Pipe(2, 4, 'never', '1f1b', layer=layer)
  spec = tf.TensorSpec([BATCH, DIM])

  @tf.function
  def Plain(x):
    with tf.GradientTape() as tape:
      for cell, theta in zip(pipe.cell, pipe.theta.cell):
        x = cell.FProp(theta, x)
      loss = _Loss(x)
    return tape.gradient(loss, pipe.trainable_variables)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  plain = _MatMulsRun(Plain.get_concrete_function(spec).graph)
  assert plain == 8 * 2 + 8 * 4 - 1  # Forward 2 per layer, backward 4 but the input's.
  graph = Step.get_concrete_function(spec).graph
  # The forward as it runs: TensorFlow's rewrite of it that also returns what its
  # backward needs.
  forwards = _FunctionMatMuls(graph, '_Forward')
  backwards = {n: c for n, c in forwards.items() if 'backward' in n}
  assert set(forwards.values()) == {8, 16}  # 4 layers a chunk, 2 and 4 matmuls each.
  assert sorted(backwards.values()) == [16, 16], backwards
  assert 2 * 8 + sum(backwards.values()) == plain + 1


@pytest.mark.parametrize('layer', [_ProjRes, _Res])
@pytest.mark.parametrize('sched', ['zb_h1', 'zbv'])
def testASplitWeightGradientWalksNoActivationChain(sched, layer):
  """W's function runs one matmul per weight, the weight gradient, from what B handed
  over, whether a layer's weights are each used by a layer call of its own (_ProjRes) or
  chained in one call's own ops (_Res); B recomputes the forward and walks the chain once."""
  pipe = _Pipe(2, 4, 'never', sched, layer=layer)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  graph = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph
  layers_per_chunk = 8 // pipe.num_chunks
  weights = _FunctionMatMuls(graph, '_WeightGrad')
  assert weights and set(weights.values()) == {2 * layers_per_chunk}, weights
  inputs = _FunctionMatMuls(graph, '_InputGrad')
  # Recompute 2 per layer but the last layer's output (its gradient is given), the
  # activation chain 2 per layer (the first chunk takes no gradient of the pipeline's input).
  assert sorted(inputs.values()) == sorted(
      4 * layers_per_chunk - 1 - (c == 0) for c in range(pipe.num_chunks)), inputs
  assert all(fn.splits for fn in pipe.cell_functions[0])


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testScheduleOrdersTheGraph(sched):
  """Each action's inputs wait on the device's previous action (control edges, or data
  when the previous action made them)."""
  pipe = _Pipe(3, 2 if sched == 'interleaved_1f1b' else 4, 'always', sched, num_layers=12)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  graph = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph
  scopes = _StepOps(graph)
  sched_obj = pipe.GetSchedule(BATCH)
  for order in sched_obj.orders:
    steps = [a for a in order if a.kind != 'L']
    for prev, step in zip(steps, steps[1:]):
      name = f'chunk{step.chunk}_{step.kind}{step.micro_batch}'
      prev_name = f'chunk{prev.chunk}_{prev.kind}{prev.micro_batch}'
      waits_on = {_StepOf(c.name) for op in scopes[name]  # Control or data: both wait.
                  for c in list(op.control_inputs) + [t.op for t in op.inputs]}
      assert prev_name in waits_on, (name, waits_on)


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testABatchHeldElsewhereReachesTheFirstDeviceAMicroBatchAtATime(sched):
  """Micro-batch m leaves the batch's device (CPU:3) once the first device has run its action
  two before F(m, 0), so that device holds the micro-batches it runs now and next, not the
  whole batch from the step's start; the step is still exact."""
  pipe = _Pipe(2, 4, 'always', sched, devices=['/device:CPU:0', '/device:CPU:1'])

  @tf.function
  def Step(x):
    with tf.device('/device:CPU:3'):
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  x = _Input()
  loss, grads = Step(x)
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)

  graph = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph
  released = {}
  for op in graph.get_operations():
    if op.name.startswith('released_input'):
      released[int(op.name.split('/')[0][len('released_input'):])] = op
  first = [a for a in pipe.GetSchedule(BATCH).orders[0] if a.kind != 'L']
  forwards = [(i, a.micro_batch) for i, a in enumerate(first) if a.kind == 'F' and a.chunk == 0]
  assert sorted(released) == [m for i, m in forwards if i >= 2]
  for i, m in forwards[2:]:
    op = released[m]
    assert tf.DeviceSpec.from_string(op.device).device_index == 3, op.device
    before_last = first[i - 2]
    # (An action that hands over to a device's first action also waits for that copy.)
    assert {_StepOf(c.name) for c in op.control_inputs
            if not c.name.startswith('hand_over_to_')} == {
                f'chunk{before_last.chunk}_{before_last.kind}{before_last.micro_batch}'}, (m, i)


def _DropoutCell():
  return layers.SequentialLayer.Params().Set(sub=[
      _Res.Params(), layers.DropoutLayer.Params().Set(keep_prob=0.5), _Res.Params()])


@pytest.mark.parametrize('remat', gpipe.REMAT_MODES)
def testDropoutMasksAreRedrawnIdenticallyInRecompute(remat):
  """The recomputed forward uses the mask of the first forward, per micro-batch."""
  num = 4
  cells = [_DropoutCell().Set(name=f'cell{k}') for k in range(2)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=num, remat=remat).Instantiate()
  x = _Input()

  def Reference():
    """The whole batch through the cells eagerly: each micro-batch's mask is its part of
    the whole batch's."""
    xm = x
    with py_utils.Context(step=7):
      for cell, th in zip(pipe.cell, pipe.theta.cell):
        xm = cell.FProp(th, xm)
    return xm

  with tf.GradientTape() as tape:
    ref_loss = _Loss(Reference())
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  with py_utils.Context(step=7):
    loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    with tf.GradientTape() as tape:
      tape_loss = _Loss(pipe(x))
    tape_grads = tape.gradient(tape_loss, pipe.trainable_variables)
  assert _RelErr(loss, ref_loss) <= 1e-5 and _RelErr(tape_loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)
  _AssertGradsClose(tape_grads, ref_grads)
  with py_utils.Context(step=8):
    assert _RelErr(_Loss(pipe(x)), ref_loss) > 1e-3  # Another step, other masks.



@pytest.mark.parametrize('sched', ['gpipe', 'zb_h1'])
def testTimeMajorDropoutIsThePlainRunsUnderItsBatchSlice(sched):
  """batch_dim=1 ([T, B, D]): masks are drawn batch-major, as a plain run of the layers draws
  them under a context whose batch slice names dimension 1 (a plain run without it takes
  dimension 0 as the batch: other masks)."""
  cells = [_DropoutCell().Set(name=f'cell{k}') for k in range(2)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=2, schedule=sched, batch_dim=1,
      remat='never').Instantiate()
  x = tf.random.stateless_normal([3, 6, DIM], [3, 4])

  def PlainLoss(batch_slice):
    y = x
    with py_utils.Context(step=7, batch_slice=batch_slice):
      for cell, th in zip(pipe.cell, pipe.theta.cell):
        y = cell.FProp(th, y)
    return _Loss(y)

  with py_utils.Context(step=7):
    loss, _ = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, PlainLoss(py_utils.BatchSlice(0, None, batch_dim=1))) <= 1e-5
  assert _RelErr(loss, PlainLoss(None)) > 1e-3

def testBatchNormMovingStatisticsEqualWholeBatch():
  """Per-micro-batch normalisation; moving averages from the whole batch, once."""
  bn = layers.BatchNormLayer.Params().Set(dim=DIM, decay=0.5)
  cells = [layers.SequentialLayer.Params().Set(name=f'cell{k}', sub=[_Res.Params(), bn])
           for k in range(2)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4).Instantiate()
  x = _Input()
  with tf.GradientTape() as tape:
    loss = _Loss(pipe(x))
  tape.gradient(loss, pipe.trainable_variables)  # Recomputes every cell: no extra updates.
  parts = tf.split(x, 4)
  for cell, th in zip(pipe.cell, pipe.theta.cell):
    res_parts = [cell.sub[0].FProp(th.sub[0], p) for p in parts]
    mean, var = tf.nn.moments(tf.concat(res_parts, 0), axes=[0])
    bn_vars = cell.sub[1].vars
    np.testing.assert_allclose(bn_vars.moving_mean.numpy(), 0.5 * mean.numpy(),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(bn_vars.moving_variance.numpy(), 0.5 + 0.5 * var.numpy(),
                               rtol=1e-5, atol=1e-6)
    with py_utils.Context(updates=[]):  # Normalise each micro-batch; discard its update.
      parts = [cell.sub[1].FProp(th.sub[1], r) for r in res_parts]


def _BnPipe(num_micro_batches=4, sched='gpipe'):
  """Two cells of [_Res, BatchNorm] (fresh BN paths per cell) and the plain layer list."""
  bn = layers.BatchNormLayer.Params().Set(dim=DIM, decay=0.5)
  layer_params = [_Res.Params().Set(name='r0'), bn.Copy().Set(name='bn0'),
                  _Res.Params().Set(name='r1'), bn.Copy().Set(name='bn1')]
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(layer_params, [2, 4]),
      num_micro_batches=num_micro_batches, schedule=sched).Instantiate()


def _DropoutPipe():
  """(2-stage pipeline of M=4 over two dropout blocks c0, c1; their layer params)."""
  layer_params = [_DropoutCell().Set(name=f'c{k}') for k in range(2)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(layer_params, [1, 2]),
      num_micro_batches=4).Instantiate()
  return pipe, layer_params


def testBatchNormStatisticsKeepUpdatingAfterAnEvalPass():
  """Regression: eval retraced the cell functions and training then dropped its statistics.

  Each training step must move the moving mean exactly as the whole batch's mean says.
  """
  pipe = _BnPipe()
  bn = pipe.cell[0].sub[1]
  res, res_theta = pipe.cell[0].sub[0], pipe.theta.cell[0].sub[0]

  def Train(x):
    before = bn.vars.moving_mean.numpy()
    with tf.GradientTape() as tape:
      loss = _Loss(pipe(x))
    tape.gradient(loss, pipe.trainable_variables)
    mean = tf.reduce_mean(res.FProp(res_theta, x), axis=0).numpy()
    np.testing.assert_allclose(bn.vars.moving_mean.numpy(), 0.5 * before + 0.5 * mean,
                               rtol=1e-5, atol=1e-6)

  for seed in range(2):
    Train(_Input(seed))
  with py_utils.EvalMode():
    pipe(_Input(5))
  for seed in range(2, 4):
    Train(_Input(seed))


def testDropoutDrawsNewMasksInAUsersOwnLoopAndMatchesThePlainLayers():
  """No context step: each training call of the pipeline draws the masks of its call count,
  as the same plain layers do, and its recompute redraws them (gradients match)."""
  pipe, layer_params = _DropoutPipe()
  plain = layers.SequentialLayer.Params().Set(name='pipe', sub=layer_params).Instantiate()
  x = _Input()
  outputs = []
  for _ in range(2):
    with tf.GradientTape() as tape:
      out = pipe(x)
      loss = _Loss(out)
    grads = tape.gradient(loss, pipe.trainable_variables)
    with tf.GradientTape() as tape:
      ref = plain(x)
      ref_loss = _Loss(ref)
    ref_grads = tape.gradient(ref_loss, plain.trainable_variables)
    assert _RelErr(out, ref) <= 1e-5
    _AssertGradsClose(grads, ref_grads)
    outputs.append(out.numpy())
  assert not np.allclose(outputs[0], outputs[1])


def testRecomputeUsesTheStepOfItsForwardWhereverTheTapeIsAsked():
  pipe, _ = _DropoutPipe()
  x = _Input()
  with tf.GradientTape() as tape:
    with py_utils.Context(step=7):
      loss = _Loss(pipe(x))
  grads = tape.gradient(loss, pipe.trainable_variables)  # Outside the step's context.
  with py_utils.Context(step=7):
    _, want = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(want))}
  _AssertGradsClose(grads, [by_name[v.name] for v in pipe.trainable_variables])


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testEveryScheduleGivesTheWholeBatchLossOfAScalarSumOrMean(sched):
  """A bare scalar merges as its declared loss_reduction says, also at M=1, where the one
  micro-batch is the batch."""
  for (loss_fn, reduction), m in itertools.product(
      ((lambda y: tf.reduce_sum(y ** 2), 'sum'), (lambda y: tf.reduce_mean(y ** 2), 'mean')),
      (1, 4)):
    pipe = _Pipe(2, m, sched=sched)
    x = _Input()
    with tf.GradientTape() as tape:
      ref_loss = loss_fn(_Reference(pipe, x))
    ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
    loss, grads = pipe.ForwardBackward(pipe.theta, x, loss_fn, loss_reduction=reduction)
    assert _RelErr(loss, ref_loss) <= 1e-5
    by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
    _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('sched', [n for n in named_schedules.SCHEDULE_NAMES if n != 'gpipe'])
def testABareScalarOfAMicroBatchScheduleNeedsADeclaredReduction(sched):
  """Not guessed: a bare scalar without loss_reduction is a ValueError naming the ways out;
  'gpipe', which calls the loss once on the whole batch, takes it; a pair needs none; an
  unknown reduction is refused by every schedule. loss_fn runs once per micro-batch."""
  x = _Input()
  pipe = _Pipe(2, 4, sched=sched)
  with pytest.raises(ValueError, match=r"bare scalar 'loss'.*loss_reduction='mean'"):
    pipe.ForwardBackward(pipe.theta, x, _Loss)
  for name in (sched, 'gpipe'):
    pipe = _Pipe(2, 4, sched=name)
    with pytest.raises(ValueError, match=r"loss_reduction='avg'; expected None, 'mean' or"):
      pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='avg')
  want = float(_Loss(_Reference(pipe, x)))
  assert _RelErr(pipe.ForwardBackward(pipe.theta, x, _Loss)[0], want) <= 1e-5
  pipe, calls = _Pipe(2, 4, sched=sched), []

  def Pair(y):
    calls.append(y.shape[0])
    return _Loss(y), tf.cast(tf.shape(y)[0], tf.float32)

  assert _RelErr(pipe.ForwardBackward(pipe.theta, x, Pair)[0], want) <= 1e-5
  assert calls == [BATCH // 4] * 4


@pytest.mark.parametrize('sched', ['gpipe', '1f1b', 'zb_h1'])
def testALossReadingThePipelinesWeightsIsRefused(sched):
  """A weight penalty in loss_fn: the backward starts from the outputs' gradients, so its
  gradient was silently lost (0.0074 against 48.7 in a review's repro)."""
  pipe = _Pipe(2, 2, sched=sched)
  weight = pipe.trainable_variables[0]
  with pytest.raises(ValueError, match=f'loss_fn reads weights of the pipeline .*{weight.name}'):
    pipe.ForwardBackward(pipe.theta, _Input(),
                         lambda y: _Loss(y) + tf.reduce_sum(tf.square(weight)),
                         loss_reduction='mean')


def testAMicroBatchLossReadingAWholeBatchTensorIsAClearError():
  pipe = _Pipe(2, 4, sched='1f1b')
  labels = tf.zeros([BATCH, DIM])  # A whole-batch tensor inside a per-micro-batch loss.

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, lambda y: tf.reduce_mean((y - labels) ** 2),
                                loss_reduction='mean')

  with pytest.raises(ValueError, match='calls loss_fn on each micro-batch'):
    Step(_Input())


@pytest.mark.parametrize('sched', [n for n in named_schedules.SCHEDULE_NAMES if n != 'gpipe'])
def testALossReadingATensorOfTheStepEqualsThePlainModel(sched):
  """A loss scaled by a tensor computed in the traced step: a mean on 16 and on 3 rows (one
  micro-batch empty), a sum and a (value, weight) pair on 10 (micro-batches 3, 3, 2, 2), in
  tf.function, equal plain TF at a scale of 3 and of 0 (the empty micro-batch's NaN, 0 times
  a mean over no rows, must not make the loss NaN)."""
  pipe = _Pipe(2, 4, sched=sched)
  scale = tf.Variable(2.0)
  losses = {'mean': lambda y, s: tf.reduce_mean(tf.square(y - 0.5)) * s,
            'sum': lambda y, s: tf.reduce_sum(tf.square(y - 0.5)) * s,
            'pair': lambda y, s: {'loss': (tf.reduce_mean(tf.square(y - 0.5)) * s,
                                           tf.cast(tf.shape(y)[0], tf.float32)),
                                  'one': (tf.ones([], tf.int32), tf.shape(y)[0])}}  # An int.
  for name, rows in (('mean', BATCH), ('mean', 3), ('sum', 10), ('pair', 10)):
    loss_fn = losses[name]
    x = _Input()[:rows]

    @tf.function
    def Step(x, loss_fn=loss_fn, reduction='sum' if name == 'sum' else 'mean'):
      s = scale * 1.5  # A tensor of the step.
      return pipe.ForwardBackward(pipe.theta, x, lambda y: loss_fn(y, s),
                                  loss_reduction=reduction)

    for value in (2.0, 0.0):
      scale.assign(value)
      with tf.GradientTape() as tape:
        ref_loss = tf.nest.flatten(loss_fn(_Reference(pipe, x), value * 1.5))[0]
      ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
      loss, grads = Step(x)
      loss = loss.loss[0] if isinstance(loss, dict) else loss
      assert abs(float(loss) - float(ref_loss)) <= 1e-5 * max(abs(float(ref_loss)), 1e-6), name
      by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
      _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


def _UnevenPipe(sched, remat, num_replicas=1, **kwargs):
  """K=2 devices, M=4, dropout in every cell: a batch of 10 runs micro-batches 3, 3, 2, 2."""
  v = _V.get(sched, 1)
  cells = [_DropoutCell().Set(name=f'cell{k}') for k in range(2 * v)]
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4, remat=remat, schedule=sched,
      virtual_stages=v, num_replicas=num_replicas, allow_device_reuse=True,
      **kwargs).Instantiate()


def _UnevenReference(pipe, x, loss_fn):
  """The whole batch through the cells on one device: loss and gradients."""
  with tf.GradientTape() as tape, py_utils.Context(step=7):
    y = x
    for cell, th in zip(pipe.cell, pipe.theta.cell):
      y = cell.FProp(th, y)
    loss = loss_fn(y)
  return loss, tape.gradient(loss[0] if isinstance(loss, tuple) else loss,
                             pipe.trainable_variables)


def _MeanPair(y):
  """A mean over the examples as Lingvo's (value, weight)."""
  return tf.reduce_mean(tf.square(y - 0.5)), tf.cast(tf.shape(y)[0], tf.float32)


def _SumLoss(y):
  return tf.reduce_sum(tf.square(y - 0.5))


def _LossOfSomeRows(y):
  """A mean that refuses a tensor of no rows, as Keras's max does eagerly."""
  tf.debugging.assert_positive(tf.shape(y)[0], message='a loss of no rows')
  return _Loss(y)


def _AssertUnevenExact(pipe, x, loss_fn, step_fn=None):
  ref_loss, ref_grads = _UnevenReference(pipe, x, loss_fn)
  reduction = 'sum' if loss_fn is _SumLoss else 'mean'
  with py_utils.Context(step=7):
    loss, grads = (step_fn or functools.partial(pipe.ForwardBackward,
                                                loss_reduction=reduction))(pipe.theta, x, loss_fn)
  if isinstance(ref_loss, tuple):
    loss, ref_loss = loss.loss[0] if isinstance(loss, dict) else loss, ref_loss[0]
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('remat', gpipe.REMAT_MODES)
@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testUnevenMicroBatchesAreExact(sched, remat):
  """Batch 10, M=4 (3, 3, 2, 2) with dropout: every schedule and remat mode equals the
  whole batch on one device; a mean loss is weighted by micro-batch size."""
  _AssertUnevenExact(_UnevenPipe(sched, remat), _Input()[:10], _Loss)


@pytest.mark.parametrize('sched', ['gpipe', '1f1b', 'zb_h1'])
def testXlaCompiledCellsWithDropoutEqualThePlainModel(sched):
  """jit_compile=True: XLA's random kernels give other numbers than TensorFlow's, yet the
  dropout masks are the uncompiled plain model's, also where a step runs uncompiled (zb_h1's
  split B recomputes the forward outside the compiled functions). A forward that saves for its
  backward (remat 'never', 'except_last') would run uncompiled: refused."""
  _AssertUnevenExact(_UnevenPipe(sched, 'always', jit_compile=True), _Input()[:10], _Loss)
  for remat in ('never', 'except_last'):
    with pytest.raises(ValueError, match=f"jit_compile=True needs remat='always', got "
                       f"remat='{remat}'"):
      _UnevenPipe(sched, remat, jit_compile=True)


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testUnevenMicroBatchesWithSumAndPairLossesAndUnevenReplicas(sched):
  """Sum and (value, weight) losses; 11 rows on 2 replicas: 6 (2, 2, 1, 1) and 5 (2, 1, 1, 1)."""
  pipe = _UnevenPipe(sched, 'always')
  for loss_fn in (_SumLoss, _MeanPair):
    _AssertUnevenExact(pipe, _Input()[:10], loss_fn)
  _AssertUnevenExact(_UnevenPipe(sched, 'always', num_replicas=2), _Input()[:11], _Loss)


def _LabelLoss(y, labels):
  """A mean squared error to targets, weighted per row: what a Keras loss takes."""
  targets, weights = labels
  return tf.reduce_mean(weights[:, None] * tf.square(y - targets))


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testLabelsAreSplitAsTheInputsAndOutputsAreReturned(sched):
  """11 rows on 2 replicas, M=4: each micro-batch's loss reads its own rows of the labels;
  with_outputs returns the whole batch's outputs."""
  pipe = _UnevenPipe(sched, 'always', num_replicas=2)
  x = _Input()[:11]
  labels = (tf.reverse(x, [0]), tf.range(1.0, 12.0))
  seen = []

  def RefLoss(y):
    seen.append(y)
    return _LabelLoss(y, labels)

  ref_loss, ref_grads = _UnevenReference(pipe, x, RefLoss)
  with py_utils.Context(step=7):
    loss, grads, outputs = pipe.ForwardBackward(pipe.theta, x, _LabelLoss, labels=labels,
                                                with_outputs=True, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5 and _RelErr(outputs, seen[0]) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('sched', ['gpipe', '1f1b'])
def testLabelsOfOtherRowsAreRefusedByEverySchedule(sched):
  """Labels of one row broadcast against a whole batch's outputs but cannot be split into
  micro-batches: refused by every schedule, so the loss does not depend on it."""
  pipe = _UnevenPipe(sched, 'always')
  x = _Input()[:10]
  for labels, match in [((x[:1], tf.ones([10])), r'A labels tensor of shape \(1, 8\) has 1 rows '
                         'at batch_dim=0; the inputs have 10'),
                        ((x, tf.ones([])), r'shape \(\) has no batch dimension 0')]:
    with pytest.raises(ValueError, match=match):
      pipe.ForwardBackward(pipe.theta, x, _LabelLoss, labels=labels, loss_reduction='mean')


@pytest.mark.parametrize('sched', ['gpipe', '1f1b', 'zb_h1'])
def testAMicroBatchOfWeightZeroAddsNothingEvenWhenItsValueIsNaN(sched):
  """A (value, weight) loss of weighted rows, 0 / 0 on a micro-batch whose rows all weigh 0
  (padding, say): its value and its gradient are NaN, yet the whole batch's are not, and
  neither are the pipeline's."""
  pipe = _UnevenPipe(sched, 'always')
  x = _Input()[:10]
  labels = (tf.reverse(x, [0]), tf.constant([1.0] * 8 + [0.0] * 2))  # Micro-batch 3: 0, 0.

  def PairLoss(y, labels):
    targets, weights = labels
    total = tf.reduce_sum(weights)
    return tf.reduce_sum(weights[:, None] * tf.square(y - targets)) / total, total

  ref_loss, ref_grads = _UnevenReference(pipe, x, lambda y: PairLoss(y, labels))
  with py_utils.Context(step=7):
    loss, grads = pipe.ForwardBackward(pipe.theta, x, PairLoss, labels=labels,
                                       loss_reduction='mean')
  assert _RelErr(loss, ref_loss[0]) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


# (loss, rows, replicas) of a batch smaller than M=4.
_SMALL_BATCHES = {'mean': (_Loss, 3, 1), 'sum': (_SumLoss, 3, 1), 'pair': (_MeanPair, 3, 1),
                  'fails_on_no_rows': (_LossOfSomeRows, 3, 1), 'one_row': (_Loss, 1, 1),
                  'two_replicas': (_Loss, 3, 2)}


@pytest.mark.parametrize('sched,batch,remat', pairwise.EveryPair(
    named_schedules.SCHEDULE_NAMES, list(_SMALL_BATCHES), gpipe.REMAT_MODES))
def testABatchSmallerThanMTrainsExactly(sched, batch, remat):
  """3 rows, M=4 (micro-batches 1, 1, 1 and an empty one), dropout: mean, sum and (value,
  weight) losses equal the whole batch on one device, and so does one that fails on no rows
  (the empty micro-batch's metrics are zeros, not loss_fn's); so do 3 rows on 2 replicas
  (1, 1, 0, 0 and 1, 0, 0, 0) and 1 row."""
  loss_fn, rows, replicas = _SMALL_BATCHES[batch]
  _AssertUnevenExact(_UnevenPipe(sched, remat, num_replicas=replicas), _Input()[:rows], loss_fn)


@pytest.mark.parametrize('sched', ['gpipe', '1f1b'])
def testACnnOfABatchSmallerThanMTrainsExactly(sched):
  """Convolutions and pooling on an empty micro-batch (3 rows, M=4): TensorFlow's CPU
  convolution returned its input on no rows, and its max-pooling gradient aborted."""
  cnn = [conv.Conv2DLayer.Params().Set(name='conv0', filter_shape=[3, 3, 3, 4], padding='VALID'),
         conv.PoolingLayer.Params().Set(name='pool'),
         conv.Conv2DLayer.Params().Set(name='conv1', filter_shape=[3, 3, 4, 4], padding='VALID'),
         conv.PoolingLayer.Params().Set(name='avg', pooling_type='AVG', window_stride=(1, 1)),
         conv.GlobalPoolingLayer.Params().Set(name='mean')]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(cnn, [2, 5]), num_micro_batches=4,
      schedule=sched).Instantiate()
  x = tf.random.stateless_normal([3, 10, 10, 3], [4, 5])
  with tf.GradientTape() as tape:
    y = x
    for cell, th in zip(pipe.cell, pipe.theta.cell):
      y = cell.FProp(th, y)
    ref_loss = _Loss(y)
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  loss, grads = tf.function(
      lambda x: pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean'))(x)
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


@pytest.mark.parametrize('sched', ['gpipe', 'zb_h1'])
def testBatchNormOfABatchSmallerThanMIsThatOfMicroBatchesOfOneRow(sched):
  """Batch norm normalizes each micro-batch: 3 rows at M=4 (one micro-batch empty) train as
  at M=3 (none empty), statically and at a size known only when the step runs; the
  empty micro-batch's NaN statistics move neither the moving averages nor the loss."""
  x = _Input()[:3]
  results = []
  for m, spec in ((3, None), (4, None), (4, tf.TensorSpec([None, DIM]))):
    pipe = _BnPipe(num_micro_batches=m, sched=sched)
    step = lambda x, pipe=pipe: pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    loss, grads = (tf.function(step, input_signature=[spec]) if spec else step)(x)
    results.append([loss] + tf.nest.flatten(grads) + [v.numpy() for v in pipe.variables])
  for got in results[1:]:
    for a, b in zip(got, results[0]):
      assert not np.isnan(a).any() and _RelErr(a, b) <= 1e-6


@pytest.mark.parametrize('sched', ['gpipe', '1f1b', 'zbv'])
def testBatchOfUnknownSizeAtTraceTime(sched):
  """One trace of a [None, DIM] signature trains any batch exactly, smaller than M too, and
  serves any batch, one example too."""
  pipe = _UnevenPipe(sched, 'except_last')
  spec = tf.TensorSpec([None, DIM])

  @tf.function(input_signature=[spec])
  def Train(x):
    with py_utils.Context(step=7):
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  for rows in (10, 5, 3, 1):
    _AssertUnevenExact(pipe, _Input()[:rows], _Loss, lambda theta, x, loss_fn: Train(x))
  if sched == 'gpipe':
    serve = tf.function(lambda x: pipe(x), input_signature=[spec])
    with py_utils.EvalMode():
      for rows in (1, 10):
        x = _Input()[:rows]
        want = x
        for cell, th in zip(pipe.cell, pipe.theta.cell):
          want = cell.FProp(th, want)
        assert _RelErr(serve(x), want) <= 1e-5


class _FailsAtRunTime(base_layer.BaseLayer):
  """An op that fails when the step runs, as a bad value deep in a model would."""

  def FProp(self, theta, x):
    tf.debugging.assert_less(tf.reduce_max(x), -1e9, message='the op that failed')
    return x


@pytest.mark.parametrize('sched', ['1f1b', 'zbv'])
def testInlinedCellFunctionsAreExactAndRaiseTheFailingOpsOwnError(sched):
  """With inline_cell_functions a traced step equals the plain model, and an op failing in
  a chunk of the middle raises its own InvalidArgumentError (not the other devices'
  cancelled receives)."""
  pipe = _Pipe(4, 4, 'always', sched, inline_cell_functions=True)
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  loss, grads = tf.function(
      lambda x: pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean'))(x)
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)

  v = _V.get(sched, 1)
  layer_params = [_Res.Params().Set(name=f'res{i}') for i in range(7)]
  layer_params.insert(5, _FailsAtRunTime.Params().Set(name='fails'))
  cells = gpipe.PartitionSequentialLayers(layer_params, 4 * v, tf.TensorShape([BATCH, DIM]),
                                          cost='params')
  failing = gpipe.PipeliningLayer.Params().Set(
      name='failing', cell_tpl=cells, num_micro_batches=4, schedule=sched, virtual_stages=v,
      inline_cell_functions=True).Instantiate()
  with pytest.raises(tf.errors.InvalidArgumentError, match='the op that failed'):
    tf.function(lambda x: failing.ForwardBackward(failing.theta, x, _Loss,
                                                  loss_reduction='mean'))(x)


def testInlinedCellFunctionsInASteadyStateLoopAreRefused():
  """Inlined into a loop's body, the calls lose the schedule's order (1F1B at K=4, M=16 gave
  gradients off by up to 8.9), so the pair is an error, not a silently wrong step."""
  with pytest.raises(ValueError, match="inline_cell_functions=True needs "
                     "loop_steady_state False or 'auto'"):
    _Pipe(4, 16, 'always', '1f1b', inline_cell_functions=True, loop_steady_state=True)


def testBadCellsAndDevicesAreClearErrors():
  with pytest.raises(ValueError, match=r'cell_tpl must be a list of layer params, one per '
                     r'stage; got InstantiableParams'):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=_Res.Params()).Instantiate()
  cells = [_Res.Params().Set(name=f'cell{k}') for k in range(2)]
  with pytest.raises(ValueError, match=r"Device '/device:GPU:3' does not exist here"):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                       devices=['/device:CPU:0', '/device:GPU:3']).Instantiate()
  # One device per stage: 2 cells as v=2 chunks run on one device, not on the two given.
  cpus = ['/device:CPU:0', '/device:CPU:1']
  with pytest.raises(ValueError, match=r'Got 2 devices .* runs 1 x 1 stages .* give 1'):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, devices=cpus,
                                       schedule='interleaved_1f1b',
                                       virtual_stages=2).Instantiate()
  # One device listed twice stacks two stages there, as reuse does: only when asked for.
  with pytest.raises(ValueError, match=r"lists one device twice \('/device:CPU:0' and "
                     r"'/cpu:0'\) .* allow_device_reuse=True"):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                       devices=['/device:CPU:0', '/cpu:0']).Instantiate()
  reused = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, devices=cpus[:1] * 2,
                                              allow_device_reuse=True).Instantiate()
  assert reused.ReplicaDevices(0) == cpus[:1] * 2
  with pytest.raises(ValueError, match=r"devices must be a list .* the string '/device:CPU:0'"):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                       devices='/device:CPU:0').Instantiate()


def testACheckpointRestoresIntoAnotherCut(tmp_path):
  two, four = _Pipe(2, 2), _Pipe(4, 8)
  x = _Input()
  for a, b in zip(two.trainable_variables, four.trainable_variables):  # Same initial weights.
    np.testing.assert_array_equal(a.numpy(), b.numpy())
  # Matmuls of other micro-batch sizes may round otherwise (oneDNN): not bitwise.
  assert _RelErr(four(x), two(x)) <= 1e-6
  for v in two.trainable_variables:
    v.assign_add(tf.ones_like(v))
  path = tf.train.Checkpoint(model=two).save(str(tmp_path / 'ckpt'))
  tf.train.Checkpoint(model=four).restore(path).assert_consumed()
  assert _RelErr(four(x), two(x)) <= 1e-6


def testEvalPathPipelinesForwardWithoutUpdates():
  bn = layers.BatchNormLayer.Params().Set(dim=DIM)
  cells = [layers.SequentialLayer.Params().Set(name=f'cell{k}', sub=[_Res.Params(), bn])
           for k in range(2)]
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=4).Instantiate()
  x = _Input()
  with py_utils.EvalMode():
    out = pipe(x)
    ref = x
    for cell, th in zip(pipe.cell, pipe.theta.cell):
      ref = cell.FProp(th, ref)
  assert _RelErr(out, ref) <= 1e-5
  assert np.all(pipe.cell[0].sub[1].vars.moving_mean.numpy() == 0)


def testBfloat16CrossesStagesWhileGradientsStayFloat32():
  pipe = _Pipe(2, 4, fprop_dtype=tf.bfloat16)
  x = _Input()

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, lambda y: _Loss(tf.cast(y, tf.float32)),
                                loss_reduction='mean')

  graph = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph
  # Tensors produced on stage 0 and consumed by stage 1's forward are bfloat16.
  crossing = [t for op in graph.get_operations() if op.name.startswith('chunk1_F')
              for t in op.inputs if t.op.name.startswith('chunk0_F')]
  assert crossing and all(t.dtype == tf.bfloat16 for t in crossing)
  loss, grads = Step(x)
  assert all(g.dtype == tf.float32 for g in tf.nest.flatten(grads))
  assert all(v.dtype == tf.float32 for v in pipe.variables)
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  assert _RelErr(loss, ref_loss) < 0.05
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  for v, r in zip(pipe.trainable_variables, ref_grads):
    assert _RelErr(by_name[v.name], r) < 0.1


@pytest.mark.parametrize('make,match', [
    (lambda: _Pipe(2, 2, remat='sometimes'), "Unknown remat 'sometimes'"),
    (lambda: _Pipe(2, 2, sched='zb'), "Unknown schedule 'zb'"),
    (lambda: gpipe.PipeliningLayer.Params().Set(name='p').Instantiate(), 'cell_tpl is empty'),
    (lambda: _Pipe(8, 2), r'needs 8 devices \(8 stages\) but only 4'),
    # Without a tape too: a training context is what picks fill-drain's differentiable run.
    (lambda: _Pipe(2, 2, sched='1f1b')(_Input()),
     r"FProp in training .* schedule='1f1b' trains through ForwardBackward, and runs FProp's "
     r'forwards in py_utils.EvalMode\(\)'),
    (lambda: _Pipe(2, 2, micro_batch_size=4), 'not both'),
])
def testBadInputsAreClearErrors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


def testMismatchedCellsNameTheCell():
  cells = [_Res.Params().Set(name='cell0'), _Res.Params().Set(name='cell1', dim=DIM + 1)]
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells).Instantiate()
  with pytest.raises(ValueError,
                     match=r'cell 1 \(pipe/cell1\) failed on the output of cell 0 \(shapes '):
    pipe.ForwardBackward(pipe.theta, _Input(), _Loss, loss_reduction='mean')


def testDeviceReuseAndMicroBatchSize():
  pipe = _Pipe(6, 1, allow_device_reuse=True, micro_batch_size=4)
  assert pipe.devices[4] == pipe.devices[0]
  assert pipe.GetSchedule(BATCH).num_micro_batches == 4
  x = _Input()
  assert _RelErr(pipe(x), _Reference(pipe, x)) <= 1e-5


def testCheckpointRoundTripOfAPipeline(tmp_path):
  a, b = _Pipe(2, 2), _Pipe(2, 2, random_seed=3)
  x = _Input()
  assert not np.allclose(a(x).numpy(), b(x).numpy())
  path = tf.train.Checkpoint(model=a).save(str(tmp_path / 'ckpt'))
  tf.train.Checkpoint(model=b).restore(path).assert_consumed()
  np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())


# -- partitioning ------------------------------------------------------------------


def _Projection(dim_in, dim_out):
  return layers.ProjectionLayer.Params().Set(input_dim=dim_in, output_dim=dim_out)


def testPartitionByFlopsGivesEqualStagesAndHeavyLayerAlone():
  equal = [_Projection(32, 32) for _ in range(16)]
  cells = gpipe.PartitionSequentialLayers(equal, 4, tf.TensorShape([8, 32]))
  assert [len(c.sub) for c in cells] == [4, 4, 4, 4]
  assert [c.name for c in cells] == ['cell0', 'cell1', 'cell2', 'cell3']
  heavy = [_Projection(32, 32) for _ in range(15)] + [_Projection(32, 32 * 16)]
  cells = gpipe.PartitionSequentialLayers(heavy, 4, tf.TensorShape([8, 32]), cost='flops')
  assert len(cells[-1].sub) == 1


def testPartitionDefaultsToParamsWithoutFPropMeta():
  costs = profiler.LayerCosts([_Res.Params()] * 3, tf.TensorShape([4, DIM]))
  assert costs == [2.0 * DIM * HIDDEN] * 3
  with pytest.raises(ValueError, match=r"needs FPropMeta on every layer; missing on \['_Res'\]"):
    profiler.LayerCosts([_Res.Params()], tf.TensorShape([4, DIM]), cost='flops')


def testPartitionByMeasuredTime():
  # 64 and 128 times the small layer's FLOPs: above the timing noise of a loaded machine.
  layer_params = [_Projection(64, 64), _Projection(64, 4096), _Projection(4096, 128)]
  costs = profiler.LayerCosts(layer_params, tf.TensorShape([1024, 64]), cost='time')
  assert len(costs) == 3 and all(c > 0 for c in costs)
  assert costs[1] > costs[0] and costs[2] > costs[0]


def testPartitionWithGivenCostsAndErrors():
  cells = gpipe.PartitionSequentialLayers([_Res.Params()] * 4, 2, None, cost=[5, 1, 1, 1])
  assert [len(c.sub) for c in cells] == [1, 3]
  with pytest.raises(ValueError, match='Got 2 costs for 4 layers'):
    gpipe.PartitionSequentialLayers([_Res.Params()] * 4, 2, None, cost=[1, 1])
  with pytest.raises(ValueError, match="Unknown cost 'speed'"):
    gpipe.PartitionSequentialLayers([_Res.Params()] * 4, 2, None, cost='speed')
  with pytest.raises(ValueError, match='Cannot split 4 layers into 5'):
    gpipe.PartitionSequentialLayers([_Res.Params()] * 4, 5, None, cost='params')


# -- memory: the allocator's peak is the reference ------------------------------------

MEM_ROWS, MEM_DIM, MEM_HIDDEN, MEM_LAYERS = 2048, 128, 512, 8


def _PeakBytes(step):
  """Peak allocator bytes above the live set while `step` runs (traced beforehand)."""
  tf.nest.map_structure(lambda t: t.numpy(), step())
  return memory_stats.PeakBytes(lambda: tf.nest.map_structure(lambda t: t.numpy(), step()))[1]


def _MemLayers():
  return [_Res.Params().Set(dim=MEM_DIM, hidden=MEM_HIDDEN) for _ in range(MEM_LAYERS)]


def _MemPipe(k, m, remat='always', sched='gpipe', loop='auto'):
  cells = gpipe.PartitionSequentialLayers(_MemLayers(), k, None, cost=[1.0] * MEM_LAYERS)
  return gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, num_micro_batches=m, remat=remat,
      schedule=sched, loop_steady_state=loop).Instantiate()


def _MemInput():
  return tf.random.stateless_normal([MEM_ROWS, MEM_DIM], [3, 4])


def _TapeStep(layer):
  x = _MemInput()

  @tf.function
  def Step():
    with tf.GradientTape() as tape:
      loss = _Loss(layer(x))
    return tape.gradient(loss, layer.trainable_variables)
  return Step


def _ForwardBackwardStep(pipe):
  x = _MemInput()
  return tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')[1])


def testPeakMemoryFallsWithMicroBatchesAndStaysFarBelowPlain():
  plain = gpipe.FeatureExtractionLayer.Params().Set(name='plain', sub=_MemLayers()).Instantiate()
  plain_peak = _PeakBytes(_TapeStep(plain))
  for make_step in (_TapeStep, _ForwardBackwardStep):
    peaks = {m: _PeakBytes(make_step(_MemPipe(4, m))) for m in (4, 8, 16)}
    assert peaks[8] <= 0.5 * plain_peak, (peaks, plain_peak)
    # Raising M at a fixed batch never raises the peak (weight gradients are summed as they
    # come instead of being held per micro-batch).
    assert peaks[16] <= 1.1 * peaks[8] <= 1.1 * 1.1 * peaks[4], peaks


def testOneFOneBBoundsActivationsByStagesNotMicroBatches():
  """Without remat, fill-drain keeps all M micro-batches' activations; 1F1B at most K."""
  def Peak(sched, m):
    return _PeakBytes(_ForwardBackwardStep(_MemPipe(2, m, remat='never', sched=sched)))

  fill_drain, one_f_one_b, one_f_one_b_few = Peak('gpipe', 16), Peak('1f1b', 16), Peak('1f1b', 4)
  assert one_f_one_b <= 0.5 * fill_drain, (one_f_one_b, fill_drain)
  assert one_f_one_b <= 1.2 * one_f_one_b_few, (one_f_one_b, one_f_one_b_few)


def testALoopedSteadyStateHoldsNoMoreSavedActivationsThanItsActionsOneByOne():
  """The loop takes what is in flight at its start (without remat, the forwards' saved
  activations) as it goes; held by a call until the loop ended, they raised 1F1B's peak 1.5x.
  (With remat='always' a loop's peak is still about 1.6 MB above the unrolled one, unexplained:
  docs/benchmarks/2026-12-08-saved-forward.md#memory.)"""
  looped, unrolled = (_PeakBytes(_ForwardBackwardStep(_MemPipe(4, 16, 'never', '1f1b', loop)))
                      for loop in (True, False))
  assert looped <= 1.1 * unrolled, (looped, unrolled)


@pytest.mark.parametrize('path', ['forward_backward', 'tape'])
def testADeepCellsBackwardHoldsOneGradientSum(path):
  """Weights, their gradient sum and about one layer's fresh gradient: the sum is added
  in place (a sum passed along as a value held the old and the new sum at once)."""
  num_layers, rows = 16, 16
  live_before = tf.config.experimental.get_memory_info('CPU:0')['current']
  cells = gpipe.CellsFromEnds([_Res.Params().Set(name=f'layer{i}', dim=MEM_DIM, hidden=MEM_HIDDEN)
                               for i in range(num_layers)], [num_layers])
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                            num_micro_batches=4).Instantiate()
  x = tf.random.stateless_normal([rows, MEM_DIM], [3, 4])

  @tf.function
  def Step():
    if path == 'forward_backward':
      return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')[1]
    with tf.GradientTape() as tape:
      loss = _Loss(pipe(x))
    return tape.gradient(loss, pipe.trainable_variables)

  Step()
  tf.config.experimental.reset_memory_stats('CPU:0')
  tf.nest.map_structure(lambda t: t.numpy(), Step())
  peak = tf.config.experimental.get_memory_info('CPU:0')['peak'] - live_before
  weights = 4 * sum(int(tf.size(v)) for v in pipe.trainable_variables)
  layer = weights // num_layers
  activations = 4 * rows * (MEM_DIM + MEM_HIDDEN) * num_layers
  # One more layer for the step's small tensors (offsets, losses, flags) and what other tests
  # of a shared process free or keep meanwhile; a second gradient sum would add num_layers.
  assert peak <= 2 * weights + 3 * layer + activations, peak / weights


def testGradientSumsAreNoPartOfTheModel(tmp_path):
  pipe = _Pipe(2, 2)
  names = [v.name for v in pipe.variables]
  keys = tf.train.list_variables(tf.train.Checkpoint(pipe=pipe).write(str(tmp_path / 'a')))
  pipe.ForwardBackward(pipe.theta, _Input(), _Loss, loss_reduction='mean')
  assert [v.name for v in pipe.variables] == names
  assert tf.train.list_variables(tf.train.Checkpoint(pipe=pipe).write(
      str(tmp_path / 'b'))) == keys


# -- conformance: every layer pipelines like its micro-batched plain run ----------------

def _PipelinableCases():
  """Conformance cases whose inputs and outputs all carry the batch on dimension 0.

  Left out: the positional embedding (its input is a length, not a batch) and
  the softmax (its outputs include whole-batch scalars such as total_xent).
  """
  from layer_conformance_test import ConformanceCases  # pylint: disable=g-import-not-at-top
  return [c for c in ConformanceCases() if c.name not in ('positional_embedding', 'softmax')]


@pytest.mark.parametrize('case', _PipelinableCases(), ids=lambda c: c.name)
def testEveryLayerPipelinesLikeItsMicroBatchedPlainRun(case):
  """A one-cell pipeline of M=2 equals the layer run on each micro-batch in turn."""
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=[case.params.Copy().Set(name='cell0')],
      num_micro_batches=2).Instantiate()
  inputs = case.make_inputs()

  def Loss(out):
    floats = [t for t in tf.nest.flatten(out) if t.dtype.is_floating]
    return tf.add_n([tf.reduce_sum(tf.sin(tf.cast(t, tf.float32))) for t in floats])

  with tf.GradientTape() as tape:
    pieces = []
    rows = inputs[0].shape[0] // 2
    for m, piece in enumerate(zip(*[tf.split(t, 2) for t in inputs])):
      # Step 0: the pipeline's first call; each micro-batch where it sits in the batch.
      with py_utils.Context(step=0, batch_slice=py_utils.BatchSlice(m * rows, rows),
                            updates=[]):
        pieces.append(pipe.cell[0].FProp(pipe.theta.cell[0], *piece))
    ref = tf.nest.map_structure(lambda *t: tf.concat(t, 0), *pieces)
    ref_loss = Loss(ref)
  ref_grads = tape.gradient(ref_loss, pipe.trainable_variables)
  with tf.GradientTape() as tape:
    out = pipe(*inputs)
    loss = Loss(out)
  grads = tape.gradient(loss, pipe.trainable_variables)
  for got, want in zip(tf.nest.flatten(out), tf.nest.flatten(ref)):
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertGradsClose(grads, ref_grads, tol=1e-5)


# -- data parallelism: R replicas of a K-stage pipeline --------------------------------


@pytest.mark.parametrize('sched', named_schedules.SCHEDULE_NAMES)
def testReplicasTrainLikeOneDeviceOnTheWholeBatch(sched):
  pipe = _Pipe(2, 2, 'always', sched, num_replicas=2)
  assert pipe.ReplicaDevices(1) == [pipe.devices[2 + k] for k in pipe.placement]
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)

  @tf.function
  def Step(x):
    stats = []
    with py_utils.Context(step_stats=stats):
      loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
    return loss, grads, stats

  loss, grads, stats = Step(x)
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)
  assert sorted({int(r.replica) for r in stats}) == [0, 1]
  if sched == 'gpipe':
    with tf.GradientTape() as tape:
      tape_loss = _Loss(pipe(x))
    _AssertGradsClose(tape.gradient(tape_loss, pipe.trainable_variables), ref_grads)
    with py_utils.EvalMode():
      assert _RelErr(pipe(x), _Reference(pipe, x)) <= 1e-5


def testReplicaStepsRunOnTheirOwnDevices():
  pipe = _Pipe(2, 2, num_replicas=2)

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  graph_def = Step.get_concrete_function(tf.TensorSpec([BATCH, DIM])).graph.as_graph_def()
  library = {f.signature.name: f for f in graph_def.library.function}
  seen = set()
  for node in graph_def.node:
    if node.name.startswith('replica'):
      replica, stage = int(node.name[len('replica')]), pipe.placement[_ChunkOf(_StepOf(node.name))]
      want = tf.DeviceSpec.from_string(pipe.devices[replica * 2 + stage]).device_index
      for n, device in _CalledNodes(library, node):
        assert tf.DeviceSpec.from_string(device).device_index == want, (node.name, n.name)
      seen.add((replica, stage))
  assert seen == {(0, 0), (0, 1), (1, 0), (1, 1)}


def testReplicaErrors():
  with pytest.raises(ValueError, match=r'needs 6 devices \(3 replicas x 2 stages\) but only 4'):
    _Pipe(2, 2, num_replicas=3)
  with pytest.raises(ValueError, match='num_replicas must be a positive int, got 0'):
    _Pipe(2, 2, num_replicas=0)


# -- a user's own schedule --------------------------------------------------------------

# A user's order: ZB-H1 at K=2, M=4, but device 1 runs each W right after its B, all but the
# last two, which end its order.
_USER_TEXT = """schedule mine K=2 M=4 v=1
device0: F0@0 F1@0 B0@0 W0@0 F2@0 B1@0 W1@0 F3@0 B2@0 W2@0 B3@0 W3@0
device1: F0@1 L0@1 B0@1 W0@1 F1@1 L1@1 B1@1 W1@1 F2@1 L2@1 B2@1 F3@1 L3@1 B3@1 W2@1 W3@1
"""


@pytest.mark.parametrize('remat', gpipe.REMAT_MODES)
def testAUsersOwnScheduleTextRunsAndEqualsThePlainModel(remat):
  pipe = _Pipe(2, 4, remat, sched=_USER_TEXT)
  assert pipe.GetSchedule(BATCH).ToText() == _USER_TEXT
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  loss, grads = tf.function(lambda x: pipe.ForwardBackward(pipe.theta, x, _Loss,
                                                           loss_reduction='mean'))(x)
  assert _RelErr(loss, ref_loss) <= 1e-5
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  _AssertGradsClose([by_name[v.name] for v in pipe.trainable_variables], ref_grads)


def testABadScheduleFailsWhenThePipelineIsBuilt():
  with pytest.raises(ValueError, match=r'The schedule text is for K=2 devices, M=4 '
                     r'micro-batches, v=1 chunks per device; this pipeline runs K=2, M=8, v=1'):
    _Pipe(2, 8, sched=_USER_TEXT)
  with pytest.raises(ValueError, match=r'this pipeline runs K=4, M=4'):
    _Pipe(4, 4, sched=_USER_TEXT)
  with pytest.raises(ValueError, match=r"The orders never run W3@1"):
    _Pipe(2, 4, sched=_USER_TEXT.replace(' W3@1', ''))
  # A text, not a name: what is wrong with its head, not 'Unknown schedule'.
  with pytest.raises(ValueError, match=r"must start with 'schedule <name> K=<devices>"):
    _Pipe(2, 4, sched=_USER_TEXT.replace('schedule ', 'Schedule ', 1))
  with pytest.raises(ValueError, match=r"schedule must be one of .* got \['1f1b'\]"):
    _Pipe(2, 4, sched=['1f1b'], virtual_stages=1)
  with pytest.raises(ValueError, match='num_micro_batches must be a positive int, got 0'):
    _Pipe(2, 0, sched='1f1b')
  with pytest.raises(ValueError, match='num_micro_batches=6 must be at most K or a multiple'):
    _Pipe(4, 6, sched='interleaved_1f1b')


def testATextWithMicroBatchSizeRunsItsMAndSaysWhereAnotherMCameFrom():
  """A text fixes M: micro_batch_size must cut the batch into as many; each M's schedule
  is built once."""
  pipe = _Pipe(2, 1, sched=_USER_TEXT, micro_batch_size=BATCH // 4)
  assert pipe.GetSchedule(BATCH) is pipe.GetSchedule(BATCH)
  x = _Input()
  ref_loss, _ = _ReferenceLossAndGrads(pipe, x)
  loss, _ = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  with pytest.raises(ValueError, match=r'this pipeline runs K=2, M=8, v=1 \(M = the rows of '
                     r"each replica's batch / micro_batch_size=4\)\."):
    pipe.ForwardBackward(pipe.theta, tf.concat([x, x], 0), _Loss, loss_reduction='mean')


@pytest.mark.parametrize('remat', gpipe.REMAT_MODES)
def testAWholeBatchLossTextWithSplitBackwardsTrainsUnderATape(remat):
  """L(*) after every forward, then B and W: FProp under a tape equals the plain model."""
  text = """schedule mine K=2 M=2 v=1
device0: F0@0 F1@0 B1@0 B0@0 W1@0 W0@0
device1: F0@1 F1@1 L*@1 B1@1 W1@1 B0@1 W0@1
"""
  pipe = _Pipe(2, 2, remat, sched=text)
  x = _Input()
  ref_loss, ref_grads = _ReferenceLossAndGrads(pipe, x)
  with tf.GradientTape() as tape:
    loss = _Loss(pipe(x))
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertGradsClose(tape.gradient(loss, pipe.trainable_variables), ref_grads)


@pytest.mark.parametrize('cell_cls', [gpipe.FeatureExtractionLayer, layers.SequentialLayer])
def testALayersOwnFPropDtypeHoldsAcrossCuts(cell_cls):
  """A bfloat16 pipeline whose last layer computes in float32 (a float32 head): its output is
  float32 and equals the layers run one after another, whatever kind of cell holds them."""
  def Proj(name, **kwargs):
    return layers.ProjectionLayer.Params().Set(name=name, input_dim=DIM, output_dim=DIM,
                                               **kwargs)
  cells = [cell_cls.Params().Set(name='c0', sub=[Proj('p0'), Proj('p1')]),
           cell_cls.Params().Set(name='c1', sub=[Proj('p2'), Proj('out', fprop_dtype=tf.float32)])]
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=1,
                                            fprop_dtype=tf.bfloat16).Instantiate()
  x = _Input()
  y = pipe(x)
  assert y.dtype == tf.float32
  by_path = pipe.LayersByPath()
  expected = tf.cast(x, tf.bfloat16)
  for c, names in enumerate((('p0', 'p1'), ('p2', 'out'))):
    for name in names:
      layer = by_path[f'pipe/{name}'] if cell_cls is gpipe.FeatureExtractionLayer else (
          by_path[f'pipe/c{c}/{name}'])
      expected = layer.FProp(layer.theta, expected)
  np.testing.assert_array_equal(y.numpy(), expected.numpy())


def testInterleavingOnOneDeviceIsSaid(caplog):
  """interleaved_1f1b with virtual_stages=2 on 2 cells runs on one device: a warning says so."""
  cells = gpipe.CellsFromEnds([_Res.Params().Set(name=f'layer{i}') for i in range(4)], [2, 4])
  gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=2,
                                     schedule='interleaved_1f1b', virtual_stages=2).Instantiate()
  assert any('pipe: interleaved_1f1b with virtual_stages=2 of 2 cells runs on one device' in
             r.getMessage() for r in caplog.records)


@pytest.mark.parametrize('sched,remat', [('zb_h1', 'always'), ('zbv', 'always'),
                                         ('1f1b', 'never')])
def testARunEagerlyGivesTheTracedNumbers(sched, remat):
  """Under tf.config.run_functions_eagerly (a user's debugging; the runners' rerun of a
  cancelled step) W has no graph to re-create B's ops in: B takes the weight gradients; a
  forward without remat saves what its backward takes as when traced."""
  pipe = _Pipe(2, 4, remat, sched)
  x = _Input()

  @tf.function
  def Step(x):
    return pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')

  loss, grads = Step(x)
  tf.config.run_functions_eagerly(True)
  try:
    eager_loss, eager_grads = Step(x)
  finally:
    tf.config.run_functions_eagerly(False)
  np.testing.assert_allclose(eager_loss.numpy(), loss.numpy(), rtol=1e-6)
  for a, b in zip(tf.nest.flatten(eager_grads), tf.nest.flatten(grads)):
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7)
  # The eager run left the traced step's split alone: traced again, it still splits.
  assert all(f.splits for f in pipe.cell_functions[0]) == sched.startswith('zb')
  loss_again, _ = Step(x)
  np.testing.assert_allclose(loss_again.numpy(), loss.numpy(), rtol=1e-6)
