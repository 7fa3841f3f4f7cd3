"""Tests of re-materialization inside a stack (lingvo_gpipe/layers/remat.py) against the plain
layers without it."""

import numpy as np
import pytest
import tensorflow as tf

import pairwise
from lingvo_gpipe import layers
from lingvo_gpipe.foundation import memory_stats
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import remat
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules

DIM, BATCH = 8, 8
POLICIES = ['none', 'every_layer', 'every_2', 'r1+r3']


def _Ff(name):
  return layers.TransformerFeedForwardLayer.Params().Set(name=name, input_dim=DIM, hidden_dim=16)


def _LayerParams(batch_norm=False):
  """Six layers: feed-forward blocks, a dropout and optionally a batch norm."""
  middle = (layers.BatchNormLayer.Params().Set(name='bn', dim=DIM, decay=0.5) if batch_norm
            else layers.DropoutLayer.Params().Set(name='drop', keep_prob=0.5))
  return [_Ff('r0'), _Ff('r1'), middle, _Ff('r2'), _Ff('r3'), _Ff('r4')]


def _Input(seed=1):
  return tf.random.stateless_normal([BATCH, DIM], [seed, 2])


def _Loss(y):
  return tf.reduce_mean(tf.square(y - 0.5))


def _Plain(layer_params, policy='none'):
  """The layers as one SequentialLayer: named 'pipe' like the pipelines, so the same weights."""
  return layers.SequentialLayer.Params().Set(
      name='pipe', sub=layer_params, remat_policy=policy).Instantiate()


def _TapeLossAndGrads(model, x):
  with tf.GradientTape() as tape:
    loss = _Loss(model(x))
  return loss, tape.gradient(loss, model.trainable_variables)


def _RelErr(a, b):
  a, b = (np.asarray(tf.convert_to_tensor(t), np.float64) for t in (a, b))
  return np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-12)


def _AssertClose(values, ref_values, tol=1e-5):
  """Each relative error <= tol, on the scale of the largest reference value (float32
  sums in another order differ by ~1e-7 of it)."""
  assert len(values) == len(ref_values)
  scale = max(np.max(np.abs(np.asarray(r))) for r in ref_values)
  for v, r in zip(values, ref_values):
    assert np.max(np.abs(np.asarray(v, np.float64) - np.asarray(r))) <= tol * scale


def _ByVariable(pipe, grads):
  """ForwardBackward's gradients (mirroring theta) in trainable_variables' order."""
  by_name = {v.name: g for v, g in zip(tf.nest.flatten(pipe.theta), tf.nest.flatten(grads))}
  return [by_name[v.name] for v in pipe.trainable_variables]


# -- policies -------------------------------------------------------------------------------


@pytest.mark.parametrize('policy,start,end,segments', [
    ('none', 0, 5, []),
    ('every_layer', 0, 5, [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]),
    ('every_2', 0, 5, [(0, 2), (2, 4), (4, 5)]),
    ('every_2', 1, 5, [(1, 3), (3, 5)]),
    ('every_9', 0, 5, [(0, 5)]),
    ('b+d', 0, 5, [(0, 2), (2, 4), (4, 5)]),
    ('d+b', 2, 5, [(2, 4), (4, 5)]),
    ('e', 0, 5, [(0, 5)]),
])
def testStageSegments(policy, start, end, segments):
  assert remat.StageSegments(policy, list('abcde'), start, end) == segments


@pytest.mark.parametrize('policy', ['every_0', 'every_x', 'every_', 'b+z', 'b+', '', None, 2])
def testUnknownPolicyIsAValueErrorNamingItAndTheChoices(policy):
  with pytest.raises(ValueError) as e:
    _Plain([_Ff('a'), _Ff('b')], policy)
  assert repr(policy) in str(e.value)
  assert "expected 'none', 'every_layer', 'every_N'" in str(e.value)
  with pytest.raises(ValueError, match="expected 'none', 'every_layer'"):
    gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=gpipe.CellsFromEnds([_Ff('a'), _Ff('b')], [1, 2]),
        cell_remat_policy=policy).Instantiate()


def testEachCellTakesItsShareOfThePipelinesPolicy():
  cells = gpipe.CellsFromEnds(_LayerParams(), [2, 4, 6])  # r0 r1 | drop r2 | r3 r4
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, cell_remat_policy='r1+r3+r4').Instantiate()
  assert [c.params.remat_policy for c in pipe.cell] == ['r1', 'every_2', 'r3+r4']
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, cell_remat_policy='every_layer').Instantiate()
  assert [c.params.remat_policy for c in pipe.cell] == ['every_layer'] * 3


def testACellsOwnPolicyOrACellWithoutOneIsAnError():
  cells = gpipe.CellsFromEnds(_LayerParams(), [3, 6])
  cells[1].remat_policy = 'every_2'
  with pytest.raises(ValueError, match=r"cell 1 \(cell1\) sets remat_policy='every_2'; set the "
                     "pipeline's cell_remat_policy instead"):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells).Instantiate()
  with pytest.raises(ValueError, match=r"cell_remat_policy='every_layer' needs cells that are "
                     r"SequentialLayers .* cells \['a', 'b'\] are not"):
    gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=[_Ff('a'), _Ff('b')],
                                       cell_remat_policy='every_layer').Instantiate()


# -- exactness --------------------------------------------------------------------------------


@pytest.mark.parametrize('policy', POLICIES)
def testSequentialLayerEqualsThePlainLayersStepAfterStep(policy):
  """Under a user's tape with no context step: the dropout masks of each call (the layers'
  own call counts) and the gradients are the plain layers', call after call."""
  plain, model = _Plain(_LayerParams()), _Plain(_LayerParams(), policy)
  for seed in range(2):
    ref_loss, ref_grads = _TapeLossAndGrads(plain, _Input(seed))
    loss, grads = _TapeLossAndGrads(model, _Input(seed))
    assert _RelErr(loss, ref_loss) <= 1e-5
    _AssertClose(grads, ref_grads)


@pytest.mark.parametrize('policy', POLICIES)
def testBatchNormStatisticsAreRecordedOnceAsWithoutRemat(policy):
  """The recompute in the backward (outside any FProp context) updates nothing."""
  plain, model = _Plain(_LayerParams(True)), _Plain(_LayerParams(True), policy)
  ref_loss, ref_grads = _TapeLossAndGrads(plain, _Input())
  loss, grads = _TapeLossAndGrads(model, _Input())
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertClose(grads, ref_grads)
  bn, ref_bn = model.sub[2].vars, plain.sub[2].vars
  _AssertClose([bn.moving_mean, bn.moving_variance],
               [ref_bn.moving_mean, ref_bn.moving_variance])


@pytest.mark.parametrize('policy,sched,remat_mode', pairwise.EveryPair(
    POLICIES, named_schedules.SCHEDULE_NAMES, gpipe.REMAT_MODES))
def testPipelineEqualsThePlainModel(policy, sched, remat_mode):
  """Every policy with every remat mode and every schedule, and every remat mode with
  every schedule: loss and gradients of the plain layers on the whole batch, dropout
  included (each micro-batch draws its part of the batch's mask)."""
  plain = _Plain(_LayerParams())
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=gpipe.CellsFromEnds(_LayerParams(), [3, 6]), num_micro_batches=2,
      remat=remat_mode, schedule=sched, cell_remat_policy=policy,
      virtual_stages=2 if sched == 'zbv' else 1).Instantiate()  # zbv: 2 cells on 1 device.
  x = _Input()
  with py_utils.Context(step=3):
    ref_loss, ref_grads = _TapeLossAndGrads(plain, x)
    loss, grads = pipe.ForwardBackward(pipe.theta, x, _Loss, loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertClose(_ByVariable(pipe, grads), ref_grads)


@pytest.mark.parametrize('policy', POLICIES[1:])
def testPipelineBatchNormAndFetchedActivationsEqualThePlainModel(policy):
  """M=1 (batch norm sees the whole batch): gradients, moving statistics and a fetched
  activation inside a segment are the plain model's."""
  plain = _Plain(_LayerParams(True))
  cells = gpipe.CellsFromEnds(_LayerParams(True), [3, 6], act_fetch_layers=['r2'])
  pipe = gpipe.PipeliningLayer.Params().Set(
      name='pipe', cell_tpl=cells, cell_remat_policy=policy).Instantiate()
  x = _Input()
  with tf.GradientTape() as tape:
    out, acts = plain.FPropAndOutputs(plain.theta, (x,), ['r2'])
    ref_loss = _Loss(out) + tf.reduce_mean(acts.r2)
  ref_grads = tape.gradient(ref_loss, plain.trainable_variables)
  loss, grads = pipe.ForwardBackward(pipe.theta, x,
                                     lambda y, acts: _Loss(y) + tf.reduce_mean(acts.r2),
                                     loss_reduction='mean')
  assert _RelErr(loss, ref_loss) <= 1e-5
  _AssertClose(_ByVariable(pipe, grads), ref_grads)
  bn, ref_bn = pipe.cell[0].sub[2].vars, plain.sub[2].vars
  _AssertClose([bn.moving_mean, bn.moving_variance],
               [ref_bn.moving_mean, ref_bn.moving_variance])


# -- memory ------------------------------------------------------------------------------------


def _MlpPeak(policy, stages):
  """Allocator peak of a training step of 8 activation-heavy blocks per cell: K stages and
  M=1 (the stages never run at once), or the plain stack of 8 (K=0)."""
  mlp = [layers.TransformerFeedForwardLayer.Params().Set(name=f'l{i}', input_dim=32,
                                                         hidden_dim=512)
         for i in range(8 * max(stages, 1))]
  x = tf.random.stateless_normal([512, 32], [1, 2])
  if stages:
    pipe = gpipe.PipeliningLayer.Params().Set(
        name='pipe', cell_tpl=gpipe.CellsFromEnds(mlp, [8 * (k + 1) for k in range(stages)]),
        cell_remat_policy=policy).Instantiate()
    step = tf.function(lambda: pipe.ForwardBackward(pipe.theta, x, _Loss,
                                                    loss_reduction='mean'), autograph=False)
  else:
    model = _Plain(mlp, policy)
    step = tf.function(lambda: _TapeLossAndGrads(model, x), autograph=False)
  step()
  return memory_stats.PeakBytes(step)[1]


@pytest.mark.parametrize('stages', [0, 1, 2])
def testCheckpointsLowerThePeak(stages):
  """A re-materialized cell (or the plain stack) of 8 blocks with 1 MB hidden activations:
  keeping every layer's output holds a block's activations at a time (two while one's
  weight gradients and the next one's recompute overlap), not the cell's; segments of half
  a cell hold more than that, less than the cell's."""
  none, every_layer, halves = (_MlpPeak(p, stages) for p in ('none', 'every_layer', 'every_4'))
  assert every_layer < 0.6 * none
  assert every_layer < halves < none
