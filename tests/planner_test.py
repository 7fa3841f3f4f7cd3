"""Tests of lingvo_gpipe.insight.planner: plans against brute force, plans applied, profiles."""

import itertools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.insight import planner
from lingvo_gpipe.insight import simulator
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.pipeline import gpipe


def _Profiles(seed, n):
  rng = np.random.default_rng(seed)
  return [profiler.LayerProfile(
      name=f'l{i}', forward_s=float(rng.uniform(1, 3)), backward_s=float(rng.uniform(2, 6)),
      param_bytes=int(rng.integers(10, 100)), input_bytes=int(rng.integers(1, 10)),
      activation_bytes=int(rng.integers(10, 50))) for i in range(n)]


def _StageTimeAndMemory(profiles, ends, m, remat, slots):
  """Independent reference: per stage (seconds, bytes) by the formulas of the docstring."""
  out = []
  for j, i in zip([0] + list(ends[:-1]), ends):
    stage = profiles[j:i]
    forward = sum(p.forward_s for p in stage)
    backward = sum(p.backward_s for p in stage) + (forward if remat == 'always' else 0.0)
    acts = sum(p.activation_bytes for p in stage)
    kept = m * stage[0].input_bytes + acts if remat == 'always' else m * acts
    out.append((forward + backward, (2 + slots) * sum(p.param_bytes for p in stage) + kept))
  return out


def _AllSplits(n, k):
  for cuts in itertools.combinations(range(1, n), k - 1):
    yield list(cuts) + [n]


@pytest.mark.parametrize('seed,remat', [(0, 'always'), (1, 'always'), (2, 'never'),
                                        (3, 'never')])
def testPlanIsTheFastestSplitThatFitsByBruteForce(seed, remat):
  n, k, m, slots = 8, 3, 4, 2
  profiles = _Profiles(seed, n)
  splits = {tuple(e): _StageTimeAndMemory(profiles, e, m, remat, slots) for e in _AllSplits(n, k)}
  memories = sorted({max(mem for _, mem in s) for s in splits.values()})
  for cap in [None] + memories[::3]:
    fits = [s for s in splits.values() if cap is None or max(mem for _, mem in s) <= cap]
    best = min(max(t for t, _ in s) for s in fits)
    plan = planner.MakePlan(profiles, k, m, remat=remat, memory_cap_bytes=cap,
                            optimizer_slots=slots)
    stages = splits[tuple(plan.ends)]
    assert max(t for t, _ in stages) == pytest.approx(best)
    assert cap is None or max(mem for _, mem in stages) <= cap
    np.testing.assert_allclose(plan.StageMemory(), [mem for _, mem in stages])


def _Chunks(stage_names, policy):
  """Independent reference: a stage's segments (lists of positions) under a policy."""
  if policy.startswith('every_'):
    n = 1 if policy == 'every_layer' else int(policy[len('every_'):])
    return [list(range(a, min(a + n, len(stage_names)))) for a in range(0, len(stage_names), n)]
  chunks, current = [], []
  for pos, name in enumerate(stage_names):
    current.append(pos)
    if name in policy.split('+'):
      chunks.append(current)
      current = []
  return chunks + ([current] if current else [])


def _PolicyStages(profiles, ends, m, remat, slots, policy):
  """Independent reference with a remat policy: per stage (seconds, bytes)."""
  out = []
  for j, i in zip([0] + list(ends[:-1]), ends):
    stage = profiles[j:i]
    chunks = _Chunks([p.name for p in stage], policy)
    forward = sum(p.forward_s for p in stage)
    recomputes = (remat != 'never') + 1
    kept = sum(stage[c[0]].input_bytes for c in chunks)
    running = max(sum(stage[x].activation_bytes for x in c) for c in chunks)
    inputs = stage[0].input_bytes
    acts = {'never': m * kept, 'always': m * inputs + kept,
            'except_last': (m - 1) * inputs + 2 * kept}[remat] + running
    out.append((forward * (1 + recomputes) + sum(p.backward_s for p in stage),
                (2 + slots) * sum(p.param_bytes for p in stage) + acts))
  return out


@pytest.mark.parametrize('seed,remat,policy', [
    (0, 'always', 'every_layer'), (1, 'always', 'every_2'), (2, 'never', 'every_3'),
    (3, 'except_last', 'l2+l5'), (4, 'always', 'l0+l3+l4')])
def testPlanWithARematPolicyIsTheFastestSplitThatFitsByBruteForce(seed, remat, policy):
  n, k, m, slots = 8, 3, 4, 2
  profiles = _Profiles(seed, n)
  splits = {tuple(e): _PolicyStages(profiles, e, m, remat, slots, policy)
            for e in _AllSplits(n, k)}
  memories = sorted({max(mem for _, mem in s) for s in splits.values()})
  for cap in [None] + memories[::3]:
    fits = [s for s in splits.values() if cap is None or max(mem for _, mem in s) <= cap]
    best = min(max(t for t, _ in s) for s in fits)
    plan = planner.MakePlan(profiles, k, m, remat=remat, memory_cap_bytes=cap,
                            optimizer_slots=slots, remat_policy=policy)
    stages = splits[tuple(plan.ends)]
    assert max(t for t, _ in stages) == pytest.approx(best)
    np.testing.assert_allclose(plan.StageMemory(), [mem for _, mem in stages])
    np.testing.assert_allclose(plan.StageCosts()[0], [sum(
        p.forward_s for p in profiles[j:i]) for j, i in zip([0] + plan.ends[:-1], plan.ends)])


def testUnderATightCapAFinerPolicyWinsAndAnUnknownOneIsAnError():
  # Eight equal layers, activations 10x their inputs: at K=1 the whole stage's activations
  # (80) do not fit a cap of 50, every_layer's inputs plus one layer's (8 + 10) do.
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 1, 10) for i in range(8)]
  # M=1 of the profiled rows, fill-drain, remat always: only the remat policy is chosen.
  only = dict(micro_batches=[1], schedules=['gpipe'], remats=['always'])
  policies = ['none', 'every_layer', 'every_4']
  loose, _ = planner.ChoosePlan(profiles, 1, 1, 1, remat_policies=policies, **only)
  assert loose.remat_policy == 'none' and loose.StageMemory() == [81.0]
  tight, _ = planner.ChoosePlan(profiles, 1, 1, 1, remat_policies=policies,
                                memory_cap_bytes=50, **only)
  assert tight.remat_policy == 'every_layer' and tight.StageMemory() == [1.0 + 8.0 + 10.0]
  assert tight.StageCosts() == ([8.0], [16.0 + 8.0 + 8.0])  # Two recomputed forwards.
  with pytest.raises(planner.NoFitError, match='None of the 2 candidates') as e:
    planner.ChoosePlan(profiles, 1, 1, 1, remat_policies=['none', 'every_layer'],
                       memory_cap_bytes=10, **only)
  assert ('fits a memory cap of 10 bytes per device: the leanest, M=1, schedule gpipe, remat '
          'always, remat policy every_layer, needs 19 bytes on its fullest device') in str(
              e.value)
  with pytest.raises(ValueError, match="unknown remat policy 'l9'"):
    planner.MakePlan(profiles, 1, 1, remat_policy='l9')


def testCapTradesSpeedForMemoryAndTooSmallACapIsAClearError():
  # Four equal-time layers, the first two holding most activations. The fastest split
  # is [2, 4] (102 bytes on stage 0); under a cap of 60 it is [1, 4] (52 and 54 bytes).
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 1, a)
              for i, a in enumerate([50, 50, 1, 1])]
  fastest = planner.MakePlan(profiles, 2, 2)
  assert fastest.ends == [2, 4] and fastest.StageMemory() == [102.0, 4.0]
  capped = planner.MakePlan(profiles, 2, 2, memory_cap_bytes=60)
  assert capped.ends == [1, 4] and capped.StageMemory() == [52.0, 54.0]
  with pytest.raises(ValueError, match='No split into 2 stages fits a memory cap of 50 bytes '
                     'per device: the leanest split needs 54 bytes'):
    planner.MakePlan(profiles, 2, 2, memory_cap_bytes=50)


def testOneFOneBHoldsFewerMicroBatches():
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 10, 0) for i in range(4)]
  gpipe_plan = planner.MakePlan(profiles, 2, 8, schedule='gpipe')
  ofob_plan = planner.MakePlan(profiles, 2, 8, schedule='1f1b')
  assert gpipe_plan.StageMemory() == [80.0, 80.0]  # M=8 inputs of 10 bytes.
  assert ofob_plan.StageMemory() == [20.0, 20.0]  # At most K=2 in flight.


def testZeroBubbleCountsWhatPendingWeightGradientsHold():
  """ZB-H1 holds 1F1B's inputs and, per pending W, a micro-batch's activations: at K=2 a
  stage holds 2 micro-batches, or 1 and 1 pending W, or none and 2 pending, never more;
  the first costs most, as much as 1F1B."""
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 10, 3) for i in range(4)]
  ofob = planner.MakePlan(profiles, 2, 8, schedule='1f1b')
  zb = planner.MakePlan(profiles, 2, 8, schedule='zb_h1')
  assert ofob.StageMemory() == [2 * 10 + 6.0] * 2  # 2 inputs in flight, 1 cell's activations.
  assert zb.StageMemory() == [max(2 * 10 + 6.0, 10 + 6 + 6.0, 6 + 2 * 6.0)] * 2
  # Per micro-batch: F 2, B 4 (the recompute and half the backward), W 2 (the other half,
  # layer call by layer call), against F 2 and BW 6: the same work, split.
  np.testing.assert_allclose(zb.Predict().busy, [8 * (2 + 4 + 2)] * 2)
  np.testing.assert_allclose(ofob.Predict().busy, [8 * (2 + 6)] * 2)


def testChoosePlanCallsNearlyEqualTimesATieThatTheLeastMemoryWins(monkeypatch):
  """Within TIE_FRACTION of the fastest (25.5), the least memory ranks first: once 10% is a
  tie, 1f1b at M=8 (27.0, 60 bytes) ranks before gpipe at M=16 (25.5, 224)."""
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 10, 30) for i in range(4)]
  monkeypatch.setattr(planner, 'TIE_FRACTION', 0.1)
  plan, candidates = planner.ChoosePlan(profiles, 2, batch_size=16, profiled_rows=4)
  assert (plan.num_micro_batches, plan.schedule, plan.remat) == (16, '1f1b', 'never')
  ties = [c for c in candidates if c['step_time_s'] <= 25.5 * 1.1]
  assert len(ties) == 4
  assert candidates[:len(ties)] == sorted(ties, key=lambda c: c['memory_bytes'])
  rank = {(c['num_micro_batches'], c['schedule'], c['remat']): i
          for i, c in enumerate(candidates)}
  assert rank[(8, '1f1b', 'never')] < rank[(16, 'gpipe', 'never')]
  rest = [c['step_time_s'] for c in candidates[len(ties):]]
  assert rest == sorted(rest)


def testChoosePlanTakesTheFastestCandidateThatFits():
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 2.0, 0, 10, 30) for i in range(4)]
  plan, candidates = planner.ChoosePlan(profiles, 2, batch_size=16, profiled_rows=4)
  assert [c['num_micro_batches'] for c in candidates].count(16) == 4 * 3  # Schedules x remats.
  assert (plan.num_micro_batches, plan.schedule, plan.remat) == (
      candidates[0]['num_micro_batches'], candidates[0]['schedule'], candidates[0]['remat'])
  assert candidates[0]['step_time_s'] == min(c['step_time_s'] for c in candidates)
  # gpipe ties 1f1b at M=16 with more memory. (Without remat nothing is recomputed; a
  # zero-bubble schedule's B recomputes its chunk, and the bubble it saves is smaller here.)
  assert (plan.schedule, plan.remat, candidates[1]['schedule']) == ('1f1b', 'never', 'gpipe')
  assert candidates[1]['step_time_s'] == candidates[0]['step_time_s']
  # Times scale with the micro-batch's rows: M=4 (4 rows each, as profiled) takes the
  # profiles as they are.
  at4 = next(c for c in candidates if (c['num_micro_batches'], c['schedule'], c['remat']) ==
             (4, 'gpipe', 'never'))
  assert at4['step_time_s'] == pytest.approx(
      planner.MakePlan(profiles, 2, 4, 'gpipe', 'never').Predict().step_time)
  cap = 100
  capped, capped_candidates = planner.ChoosePlan(profiles, 2, 16, 4, memory_cap_bytes=cap)
  assert max(capped.StageMemory()) <= cap
  assert any('why' in c for c in capped_candidates)
  assert all(c['step_time_s'] >= capped_candidates[0]['step_time_s']
             for c in capped_candidates)
  with pytest.raises(planner.NoFitError, match=r'None of the \d+ candidates \(M in \[1, 2, 4'):
    planner.ChoosePlan(profiles, 2, 16, 4, memory_cap_bytes=1)
  with pytest.raises(planner.NoFitError, match='No split into 2 stages fits a memory cap of 1 '
                     'bytes per device: .* remat never'):
    planner.ChoosePlan(profiles, 2, 16, 4, memory_cap_bytes=1, micro_batches=[4],
                       schedules=['1f1b'], remats=['never'])
  assert planner._Size(64 * 2**20) == '64.0 MiB' and planner._Size(1536) == '1.5 KiB'
  # A cost per action (dispatch) makes many small micro-batches lose.
  costly, _ = planner.ChoosePlan(profiles, 2, 16, 4, action_overhead_s=5.0)
  assert costly.num_micro_batches < plan.num_micro_batches
  assert costly.action_overhead_s == 5.0


def testGluedLayerStaysWithTheLayerBefore():
  profiles = [profiler.LayerProfile(f'l{i}', 1.0, 1.0, 0, 1, 1) for i in range(4)]
  profiles.append(profiler.LayerProfile('softmax', 10.0, 10.0, 0, 1, 1))
  assert planner.MakePlan(profiles, 2, 4).ends == [4, 5]
  assert planner.MakePlan(profiles, 2, 4, glued=[4]).ends == [3, 5]


def testSaveLoadAndPrediction(tmp_path):
  plan = planner.MakePlan(_Profiles(5, 6), 3, 4, schedule='1f1b', memory_cap_bytes=1e9,
                          source='test', remat_policy='every_2')
  path = str(tmp_path / 'plan.json')
  plan.Save(path)
  loaded = balance_plan.LoadPlan(path)
  assert loaded == plan
  forward, backward = plan.StageCosts()
  expected = simulator.Simulate(simulator.Orders('1f1b', 3, 4), forward, backward)
  assert loaded.Predict().step_time == pytest.approx(expected.step_time)
  assert loaded.ToJson()['predicted']['bubble_fraction'] == pytest.approx(
      expected.bubble_fraction)
  older = plan.ToJson()
  del older['remat_policy']  # A plan saved before remat policies: none.
  assert balance_plan.Plan.FromJson(older).remat_policy == 'none'
  (tmp_path / 'bad.json').write_text('{"format": "other"}')
  with pytest.raises(ValueError, match="Not a balance plan: format 'other'"):
    balance_plan.LoadPlan(str(tmp_path / 'bad.json'))
  with pytest.raises(ValueError, match='Cannot read the balance plan'):
    balance_plan.LoadPlan(str(tmp_path / 'missing.json'))


def _StackParams():
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=16, num_heads=2, hidden_dim=32, num_decoder_layers=3,
      max_seq_len=8, splits=2, num_micro_batches=2)
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 12
  return p


def _PlanFor(names, ends):
  return balance_plan.Plan(source='test', ends=ends, num_micro_batches=2, schedule='gpipe',
                           remat='always', optimizer_slots=2,
                           layers=[profiler.LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names])


def testApplyPlanToAStackAndToCells():
  p = _StackParams().Set(num_micro_batches=4, schedule='1f1b')
  names = ['tgt_emb', 'dec0', 'dec1', 'dec2', 'softmax']
  # The plan's M, schedule and remat are applied and reported.
  assert balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack') == [
      "task.stack.num_micro_batches=2 (was 4)", "task.stack.schedule='gpipe' (was '1f1b')"]
  assert (p.num_micro_batches, p.schedule) == (2, 'gpipe')
  stack = p.Instantiate()
  assert [[layer.params.name for layer in cell.sub] for cell in stack.cell] == [
      ['tgt_emb'], ['dec0', 'dec1'], ['dec2', 'softmax']]

  cells = gpipe.CellsFromEnds(
      [layers.ProjectionLayer.Params().Set(name=f'p{i}', input_dim=4, output_dim=4)
       for i in range(4)], [2, 4])
  pipe = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells, num_micro_batches=2)
  assert balance_plan.ApplyPlan(pipe, _PlanFor(['p0', 'p1', 'p2', 'p3'], [1, 3, 4])) == []
  assert [[q.name for q in c.sub] for c in pipe.cell_tpl] == [['p0'], ['p1', 'p2'], ['p3']]
  plan = _PlanFor(['p0', 'p1', 'p2', 'p3'], [4])
  plan.remat_policy = 'every_2'
  assert balance_plan.ApplyPlan(pipe, plan, 'pipe') == [
      "pipe.cell_remat_policy='every_2' (was 'none')"]
  assert [c.params.remat_policy for c in pipe.Instantiate().cell] == ['every_2']
  with pytest.raises(ValueError, match=r"is for layers \['a', 'b'\], but pipe has"):
    balance_plan.ApplyPlan(pipe, _PlanFor(['a', 'b'], [1, 2]))
  with pytest.raises(ValueError, match='no PipeliningLayer'):
    balance_plan.ApplyPlan(layers.ProjectionLayer.Params(), _PlanFor(['a'], [1]))


def testApplyPlanRefusesToChangeWhatTheUserSet():
  """A value the user set (`fixed`) that the plan would change is an error naming both; the
  same value, or a setting the plan does not make, passes."""
  names = ['tgt_emb', 'dec0', 'dec1', 'dec2', 'softmax']
  p = _StackParams().Set(num_micro_batches=4, schedule='gpipe')
  with pytest.raises(ValueError, match=r"task.stack.num_micro_batches is set to 4, but the "
                     r"balance plan of test was made for 2"):
    balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack',
                      fixed=['task.stack.num_micro_batches'])
  assert p.num_micro_batches == 4
  fixed = ['task.stack.schedule', 'task.stack.model_dim']
  assert balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack', fixed=fixed) == [
      'task.stack.num_micro_batches=2 (was 4)']
  # A micro_batch_size giving the plan's M for the batch (16 rows of 8: M=2) stays; for 32
  # rows (M=4) it is refused.
  fixed = ['task.stack.micro_batch_size']
  p.Set(micro_batch_size=8, num_micro_batches=1)
  assert balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack', fixed=fixed,
                           batch_size=16) == []
  assert (p.micro_batch_size, p.num_micro_batches) == (8, 1)
  with pytest.raises(ValueError, match=r'task.stack.micro_batch_size is set to 8 \(M=4 for 32 '
                     r'rows\), but the balance plan of test was made for num_micro_batches=2'):
    balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack', fixed=fixed, batch_size=32)
  # A cut the user set: refused unless it is the plan's.
  p.Set(splits=[2, 5], micro_batch_size=None, num_micro_batches=2)
  with pytest.raises(ValueError, match=r'task.stack.splits cuts the layers at \[2, 5\], but the '
                     r'balance plan of test cuts them at \[1, 3, 5\]: drop one'):
    balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack', fixed=['task.stack.splits'])
  assert p.splits == [2, 5]
  balance_plan.ApplyPlan(p, _PlanFor(names, [2, 5]), 'task.stack', fixed=['task.stack.splits'])
  p.splits = 3  # A stage count: a plan of 3 stages keeps it; one of 2 does not.
  balance_plan.ApplyPlan(p, _PlanFor(names, [1, 3, 5]), 'task.stack', fixed=['task.stack.splits'])
  p.splits = 3
  with pytest.raises(ValueError, match=r'task.stack.splits cuts the layers into 3 stages, but '
                     r'the balance plan of test cuts them at \[2, 5\]'):
    balance_plan.ApplyPlan(p, _PlanFor(names, [2, 5]), 'task.stack', fixed=['task.stack.splits'])



def testApplyPlanRunsItsScheduleOnOneChunkPerDevice():
  """A plan's ends are one cell per device: a zbv stack (two chunks per device) takes it with
  virtual_stages 1."""
  p = _StackParams().Set(splits=[1, 2, 3, 5], schedule='zbv', virtual_stages=2)
  names = ['tgt_emb', 'dec0', 'dec1', 'dec2', 'softmax']
  assert balance_plan.ApplyPlan(p, _PlanFor(names, [2, 5]), 'task.stack')[:2] == [
      'task.stack.virtual_stages=1 (was 2)', "task.stack.schedule='gpipe' (was 'zbv')"]
  assert (p.virtual_stages, p.splits) == (1, [2, 5])
  assert len(p.Instantiate().cell) == 2

def testAnEvalerTakesTheTrainersPlanAndMicroBatchSize(tmp_path):
  """An override's micro_batch_size gives the plan's M for the training batch (16 rows / 4):
  the trainer and the evaler of the same command line both take it, though the evaler's
  batch (8 rows) would give another M."""
  names = ['tgt_emb', 'dec0', 'dec1', 'dec2', 'dec3', 'softmax']
  path = str(tmp_path / 'plan.json')
  balance_plan.Plan(source='byte', ends=[3, 6], num_micro_batches=4, schedule='gpipe',
                    remat='always', optimizer_slots=2,
                    layers=[profiler.LayerProfile(n, 1.0, 1.0, 0, 0, 0) for n in names]).Save(path)
  for job in ('controller,trainer', 'evaler_dev'):
    proc = subprocess.run(
        [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', '--mode=inspect_params',
         '--model=lm.text.GPipeByteLm', f'--job={job}', f'--balance_file={path}',
         '--model_params_override=task.stack.micro_batch_size : 4'],
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'), capture_output=True, text=True,
        check=False)
    assert proc.returncode == 0, (job, proc.stderr[-2000:])
    assert 'task.stack.splits : [3, 6]' in proc.stdout


def testProfileLayersMeasuresBytesExactly():
  dims = [8, 16, 4]
  layer_params = [layers.ProjectionLayer.Params().Set(name=f'p{i}', input_dim=a, output_dim=b)
                  for i, (a, b) in enumerate(zip(dims, dims[1:]))]
  seen = []
  profiles = profiler.ProfileLayers(layer_params, tf.TensorSpec([1, 8]), batch_size=32,
                                    repeats=2, progress=lambda i, n, p: seen.append((i, n)))
  assert seen == [(0, 2), (1, 2)]
  assert [p.name for p in profiles] == ['p0', 'p1']
  assert [p.param_bytes for p in profiles] == [4 * (8 * 16 + 16), 4 * (16 * 4 + 4)]
  assert [p.input_bytes for p in profiles] == [4 * 32 * 8, 4 * 32 * 16]
  assert all(p.forward_s > 0 and p.backward_s >= 0 and p.activation_bytes >= 0
             for p in profiles)


def testStackProfilesGlueTheSoftmaxAndTheTrainerTakesThePlan(tmp_path):
  p = _StackParams()
  profiles, glued = planner.PipelineProfiles(p, batch_size=2, repeats=1)
  assert [q.name for q in profiles] == ['tgt_emb', 'dec0', 'dec1', 'dec2', 'softmax']
  assert glued == [4]
  # Profiled in the stack's dtype, which its layers inherit in the pipeline.
  wide, _ = planner.PipelineProfiles(p.Copy().Set(dtype=tf.float64), batch_size=2, repeats=1)
  assert [q.param_bytes for q in wide] == [2 * q.param_bytes for q in profiles]
  plan = planner.MakePlan(profiles, 3, 2, glued=glued, source='test')
  assert plan.ends[-1] == 5 and plan.ends[-2] <= 3
  path = str(tmp_path / 'plan.json')
  # The registered tiny LM has 2 decoder layers: a plan of this stack's layers does not fit.
  plan.Save(path)
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  trainer = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', '--mode=inspect_params',
             '--model=lm.synthetic.GPipeTransformerLmTiny']
  proc = subprocess.run(trainer + [f'--balance_file={path}'], env=env, capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 1
  assert "trainer: error: --balance_file: The balance plan of" in proc.stderr
  tiny = balance_plan.Plan(
      source='tiny', ends=[2, 4], num_micro_batches=2, schedule='gpipe', remat='always',
      optimizer_slots=2, layers=[profiler.LayerProfile(n, 1.0, 1.0, 0, 0, 0)
                                 for n in ['tgt_emb', 'dec0', 'dec1', 'softmax']])
  tiny.Save(path)
  proc = subprocess.run(trainer + [f'--balance_file={path}'], env=env, capture_output=True,
                        text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert 'task.stack.splits : [2, 4]' in proc.stdout
  # An override the plan would replace is refused, not dropped.
  override = "--model_params_override=task.stack.schedule : '1f1b'"
  proc = subprocess.run(trainer + [f'--balance_file={path}', override], env=env,
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 1
  assert ("trainer: error: --balance_file: task.stack.schedule is set to '1f1b', but the "
          "balance plan of tiny was made for 'gpipe'") in proc.stderr


def testProfilesWithABackwardBelowHalfTheForwardAreCalledImplausible():
  """A loaded machine measured backwards 5-7x below their forwards once: such times are
  named as noise, not planned from without a word."""
  def Profiles(backward_s):
    return [profiler.LayerProfile(f'l{i}', 1.0, backward_s, 0, 1, 10) for i in range(4)]

  assert profiler.ImplausibleTimes(Profiles(2.0)) is None
  assert profiler.ImplausibleTimes(Profiles(0.5)) is None
  message = profiler.ImplausibleTimes(Profiles(0.15))
  assert message.startswith('The profiled backward (600 ms) is 0.15x the forward (4e+03 ms), '
                            'where about 2x is expected')
