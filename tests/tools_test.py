"""The tools in tools/: each has --help and finishes a tiny run with a table and its JSON.

All tiny runs start together when the module's first test asks for them, so
their TensorFlow start-ups overlap.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.insight import planner
from lingvo_gpipe.insight import simulator
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule

_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tools')
TOOLS = ('pipeline_benchmark', 'throughput_benchmark', 'memory_curves', 'capacity_benchmark',
         'print_model', 'plan_balance', 'simulate_schedule', 'cluster_benchmark', 'gpu_check')

_TINY_TRANSFORMER = ['--layers=2', '--width=16', '--hidden=32', '--rows=4', '--seq_len=8']


def _TinyArgs(tmp):
  return {
      'pipeline_benchmark': ['--model=mlp', '--layers=2', '--width=64', '--hidden=128',
                             '--rows=1024', '--stages=2', '--micro_batches=2', '--remat=always',
                             '--schedules=1f1b', '--steps=1'],
      'throughput_benchmark': [*_TINY_TRANSFORMER, '--stages=2', '--micro_batches=2',
                               '--steps=1', '--bubble_steps=1', f'--trace_dir={tmp}/traces'],
      'memory_curves': ['--layers=2', '--width=64', '--hidden=128', '--rows=1024',
                        '--fixed_stages=2', '--micro_batches=4', '--stages=2',
                        '--fixed_micro_batches=4', '--steps=1', '--remat_every=1',
                        '--remat_stages=2'],
      'capacity_benchmark': ['--budget_mb=16', '--widths=64', '--rows=32', '--seq_len=32',
                             '--micro_batches=4', '--probe_layers=1,2', '--max_layers=2',
                             '--remat_policies=none,every_layer'],
      'print_model': ['--model=lm.synthetic.GPipeTransformerLmTiny', '--noshow_params',
                      '--json'],
      'plan_balance': ['--model=mlp', '--layers=4', '--width=32', '--hidden=64', '--rows=16',
                       '--stages=2', '--micro_batches=2', '--repeats=1', f'--out={tmp}/plan.json',
                       '--remat_policy=none,every_layer', '--schedule=zb_h1'],
      'cluster_benchmark': ['--layers=2', '--width=32', '--hidden=64', '--rows=64',
                            '--micro_batches=1,2', '--schedules=gpipe,zb_h1', '--calls=1',
                            '--steps_per_call=1',
                            '--bubble_steps=1', '--nopin_workers'],
      'gpu_check': ['--quick', '--device=cpu', '--schedules=1f1b', '--micro_batches=4'],
      'simulate_schedule': ['--stages=2,4', '--micro_batches=4',
                            '--schedules=gpipe,1f1b,zb_h1,zbv',
                            f'--trace_out={tmp}/sim.json'],
  }


def _Start(tool, *args, tf_log_level='2'):
  """The tool running; tf_log_level None leaves TF_CPP_MIN_LOG_LEVEL to the tool."""
  env = {k: v for k, v in os.environ.items() if k != 'TF_CPP_MIN_LOG_LEVEL'}
  if tf_log_level is not None:
    env['TF_CPP_MIN_LOG_LEVEL'] = tf_log_level
  return subprocess.Popen([sys.executable, os.path.join(_TOOLS, f'{tool}.py'), *args], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _Finish(proc, timeout=300):
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err[-3000:]
  return out, err


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  """tool -> (tiny run's Popen, its output directory), all started at once."""
  tmp = str(tmp_path_factory.mktemp('tools'))
  return {tool: (_Start(tool, *args), tmp) for tool, args in _TinyArgs(tmp).items()}


def _Output(runs, tool, timeout=300):
  """(JSON after the table, the table's lines, stderr) of a tool's tiny run."""
  out, err = _Finish(runs[tool][0], timeout)
  lines = out.splitlines()
  first = next(i for i, line in enumerate(lines) if line in ('[', '{'))
  table = [line for line in lines[:first] if line.startswith('|')]
  assert len(table) >= 3, out
  return json.loads('\n'.join(lines[first:])), table, err


@pytest.mark.parametrize('tool', TOOLS)
def testHelp(tool):
  proc = _Start(tool, '--help')
  out, err = proc.communicate(timeout=60)
  assert proc.returncode == 0, err[-3000:]
  assert f'{tool}.py:' in out and '  --' in out
  # The flags bench_utils defines for the tool are in its help, as its own.
  assert ('  --out:' if tool == 'plan_balance' else '  --json_out:') in out, out


def testPipelineBenchmark(runs):
  results, table, err = _Output(runs, 'pipeline_benchmark')
  assert [r['stages'] for r in results] == [0, 2] and results[1]['schedule'] == '1f1b'
  assert all(r['peak_mb'] > 0 and r['step_s'] > 0 for r in results)
  assert '[2/2]' in err and len(table) == 4


def testThroughputBenchmark(runs):
  results, _, err = _Output(runs, 'throughput_benchmark')
  plain, point = results
  assert 'bubble' not in plain and '[2/2]' in err
  assert point['bubble_theory'] == pytest.approx(schedule.TheoreticalBubble(2, 2))
  assert 0 <= point['bubble'] <= 1 and 0 <= point['bubble_simulated'] <= 1
  with open(os.path.join(runs['throughput_benchmark'][1], 'traces', 'trace_K2_M2.json')) as f:
    spans = [e for e in json.load(f)['traceEvents'] if e['ph'] == 'X']
  assert len(spans) == 12  # F, R and B of 2 stages x 2 micro-batches.


def testMemoryCurves(runs):
  summary, table, _ = _Output(runs, 'memory_curves')
  plain, point, every = summary['points']
  assert plain['sweep'] == 'plain' and (point['stages'], point['micro_batches']) == (2, 4)
  assert 0 < point['peak_mb'] < plain['peak_mb']
  assert set(summary['fit']) == {'alpha_mb', 'beta_mb', 'gamma_mb', 'max_relative_error'}
  # The every_N sweep: against the same K and M without a policy, outside the fit.
  assert (every['sweep'], every['remat_policy'], every['stages']) == ('N', 'every_1', 2)
  assert every['peak_x_none'] == pytest.approx(every['peak_mb'] / point['peak_mb'])
  assert every['time_x_none'] == pytest.approx(every['step_s'] / point['step_s'])
  assert 'fit_mb' not in every and len(table) == 5


@pytest.mark.parametrize('tool,args,message', [
    ('memory_curves', ['--per_device'], '--per_device needs --schedules'),
    ('memory_curves',
     ['--schedules=1f1b', '--per_device', '--model=lm.synthetic.GPipeTransformerLmTiny'],
     'a built-in model'),
    ('memory_curves', ['--schedules=1f1b,bogus'], "--schedules=['1f1b', 'bogus']"),
    ('plan_balance', ['--choose', '--schedule=gpipe'], '--choose picks the schedule and remat'),
    ('plan_balance', ['--memory_cap_mb=0'], '--memory_cap_mb must be a positive number'),
    ('plan_balance', ['--stages=0'], 'flag --stages=0: 0 is not a positive integer'),
    ('plan_balance', ['--out=/nonexistent_dir/plan.json'],
     'flag --out=/nonexistent_dir/plan.json: its directory does not exist.'),
    ('simulate_schedule', ['--trace_out=/nonexistent_dir/x.json'],
     'flag --trace_out=/nonexistent_dir/x.json: its directory does not exist.'),
    ('throughput_benchmark', ['--json_out=/nonexistent_dir/x.json'],
     'flag --json_out=/nonexistent_dir/x.json: its directory does not exist.'),
    ('simulate_schedule', ['--plan=/nonexistent.json'],
     'simulate_schedule: error: Cannot read the balance plan /nonexistent.json'),
    ('simulate_schedule', ['--forward_ms=0', '--backward_ms=0'],
     'a step of no work'),
    ('plan_balance', ['--model=lm.synthetic.GPipeTransformerLmTiny', '--micro_batches=33'],
     'plan_balance: error: A batch of 32 examples is smaller than num_micro_batches=33'),
    ('plan_balance', ['--model=lm.synthetic.GPipeTransformerLmTiny', '--micro_batches=17',
                      '--model_params_override=task.stack.num_replicas : 2'],
     'A batch of 32 examples is smaller than num_micro_batches=17 x num_replicas=2'),
    ('plan_balance', ['--model=mlp', '--rows=16', '--micro_batches=100'],
     'plan_balance: error: A batch of 16 examples is smaller than num_micro_batches=100'),
    ('simulate_schedule', ['--stages=4,abc'],
     'flag --stages=4,abc: expected positive integers, e.g. 4,8.'),
    ('throughput_benchmark', ['--stages=0'], 'flag --stages=0: expected positive integers'),
    ('pipeline_benchmark', ['--micro_batches='],
     'flag --micro_batches=: expected positive integers'),
    ('simulate_schedule', ['--schedules=bogus'], "error: Unknown schedule 'bogus'"),
    ('simulate_schedule', ['--schedules='], '--schedules is empty'),
    ('simulate_schedule', ['--speedup=3'], '--speedup scales a --plan'),
    ('pipeline_benchmark', ['--schedules=1f1b,foo'], "--schedules=['1f1b', 'foo']: unknown"),
    ('pipeline_benchmark', ['--remat=al'], "--remat=['al']: unknown ['al']"),
    ('cluster_benchmark', ['--schedules=foo'], "--schedules=['foo']: unknown ['foo']"),
    ('pipeline_benchmark', ['--steps=0'], 'flag --steps=0: 0 is not a positive integer'),
    ('plan_balance', ['--model=lm.synthetic.GPipeTransformerLmTiny', '--layers=64',
                      '--hidden=8'], "--layers, --hidden size a built-in stack"),
    ('print_model', ['--model=lm.synthetic.GPipeTransformerLmTiny', '--stages=3'],
     "--stages size a built-in stack ('mlp' or 'transformer'), not the registered model"),
    ('throughput_benchmark', ['--steps=0'], 'flag --steps=0: 0 is not a positive integer'),
    ('memory_curves', ['--steps=0'], 'flag --steps=0: 0 is not a positive integer'),
    ('plan_balance', ['--model=lm.synthetic.GPipeTransformerLmTiny', '--stages=4', '--repeats=1'],
     'Cannot split 4 layers (softmax sharing a stage with the layer before) into 4 stages: '
     'expected at most 3 stages.'),
    ('plan_balance', ['--model=mlp', '--layers=4', '--stages=9'],
     'plan_balance: error: Cannot split 4 layers into 9 non-empty stages'),
    ('plan_balance', ['--schedule=zbv'], "flag --schedule=zbv: value should be one of"),
    ('plan_balance', ['--model=lm.synthetic.GPipeTransformerLmTiny',
                      "--model_params_override=task.stack.schedule : 'zbv'; "
                      'task.stack.virtual_stages : 2'],
     'runs schedule zbv (virtual_stages=2); a plan runs one chunk per device'),
])
def testBadFlagsStopBeforeAnythingRuns(tool, args, message):
  proc = _Start(tool, *args)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and message in err and not out, err[-2000:]


def testAPointsOwnErrorIsOneLine():
  """A point that cannot run (4 rows, M=8) stops the sweep with its ValueError, not the child's
  traceback wrapped in the parent's."""
  proc = _Start('throughput_benchmark', *_TINY_TRANSFORMER, '--stages=2', '--micro_batches=8',
                '--steps=1', '--bubble_steps=1')
  out, err = proc.communicate(timeout=300)
  assert proc.returncode != 0 and not out, err[-2000:]
  line = err.strip().splitlines()[-1]
  assert line.startswith(
      'throughput_benchmark.py: error: schedule=gpipe K=2 M=8 remat=always: A batch of 4 '
      'examples is smaller than num_micro_batches=8: every micro-batch needs at least one '
      'example (a configured batch that leaves some empty idles the pipeline every step). (its '
      'traceback: python ') and 'Traceback' not in err, err[-2000:]
  # The command it names runs that point alone, with its traceback.
  single = line[line.index('--single=') + len("--single='"):-2]
  proc = _Start('throughput_benchmark', f'--single={single}')
  _, err = proc.communicate(timeout=300)
  assert proc.returncode != 0 and 'Traceback' in err and 'A batch of 4 examples' in err


def testMemoryCurvesPerDeviceMeasuresEachWorkerOnItsOwn(tmp_path):
  """--per_device: each stage a worker process whose allocator logs its peak; every M runs
  as many micro-batches as --steps steps at the largest M."""
  out, _ = _Finish(_Start('memory_curves', '--schedules=zb_h1', '--per_device', '--layers=2',
                          '--width=32', '--hidden=64', '--fixed_stages=2', '--micro_batches=1,2',
                          '--micro_batch_rows=8', '--steps=1', '--remat=never',
                          f'--json_out={tmp_path}/m.json'))
  with open(tmp_path / 'm.json') as f:
    plain, one, point = json.load(f)['points']
  assert plain['sweep'] == 'plain' and point['per_device']
  assert (one['steps'], point['steps']) == (2, 1)
  assert one['device_at_once'] == [1, 1]
  assert plain['rows'] == one['rows'] == 8 and point['rows'] == 16  # Plain: the first batch.
  assert len(point['device_peaks_mb']) == 2 and min(point['device_peaks_mb']) > 0
  assert point['peak_mb'] == max(point['device_peaks_mb'])
  # ZB-H1, K=2, M=2: device 0 holds F0 and F1 before B0; device 1 holds F1 and B0's pending W.
  assert point['device_at_once'] == [2, 2]
  assert '| zb_h1 | 2 |' in out and 'each device MB' in out


def testCapacityBenchmark(runs):
  summary, table, _ = _Output(runs, 'capacity_benchmark')
  naive, pipeline, every_layer = summary['results']
  assert (naive['mode'], pipeline['mode'], every_layer['mode']) == ('naive',) + ('pipeline',) * 2
  assert [r['remat_policy'] for r in summary['results']] == ['none', 'none', 'every_layer']
  assert [row.split('|')[1].strip() for row in table[2:]] == [
      'naive', 'pipeline', 'pipeline every_layer']
  for r in (pipeline, every_layer):
    assert naive['fits'] and r['fits'] and r['capped']
    assert naive['peak_mb'] <= 16 and r['peak_mb'] <= 16
    assert r['mb_per_layer'] < naive['mb_per_layer']


def testPrintModel(runs):
  (summary,), table, _ = _Output(runs, 'print_model')
  assert summary['pipeline'] == 'stack'
  assert [r['name'] for r in summary['layers']] == ['tgt_emb', 'dec0', 'dec1', 'softmax']
  assert [s['layers'] for s in summary['stages']] == [['tgt_emb', 'dec0'], ['dec1', 'softmax']]
  assert sum(s['params'] for s in summary['stages']) == sum(r['params'] for r in
                                                            summary['layers'])
  assert len(table) == 2 + 4 + 2 + 2  # Layer table and stage table.


def testPrintModelPrintsJsonOnlyWhenAsked(tmp_path):
  json_out = tmp_path / 'model.json'
  out, _ = _Finish(_Start('print_model', '--model=mlp', '--layers=2', '--width=16',
                          '--hidden=32', '--rows=8', '--stages=2', '--micro_batches=2',
                          '--remat_policy=every_layer', f'--json_out={json_out}'), timeout=120)
  assert '| stage |' in out and 'cell_tpl[1].cls :' in out  # The tables and the params.
  assert "cell_remat_policy : 'every_layer'" in out and 'remat policy every_layer' in out
  assert not [line for line in out.splitlines() if line in ('[', '{')]
  (summary,) = json.loads(json_out.read_text())
  assert [s['layers'] for s in summary['stages']] == [['layer0'], ['layer1']], summary


def testPrintModelCountsTheMicroBatchesThePipelineRuns(tmp_path):
  """micro_batch_size gives M as the pipeline computes it (rounded up, per replica), and a
  replica's step FLOPs count its rows: the tiny LM's 32 rows with 2 replicas are half."""
  summaries = []
  for i, override in enumerate(['task.stack.micro_batch_size : 5',
                                'task.stack.micro_batch_size : 4; task.stack.num_replicas : 2']):
    json_out = tmp_path / f'model{i}.json'
    _Finish(_Start('print_model', '--model=lm.synthetic.GPipeTransformerLmTiny',
                   '--noshow_params', f'--model_params_override={override}',
                   f'--json_out={json_out}'), timeout=120)
    (summary,) = json.loads(json_out.read_text())
    summaries.append(summary)
  assert [s['num_micro_batches'] for s in summaries] == [
      microbatch.NumMicroBatches(32, micro_batch_size=5),
      microbatch.NumMicroBatches(32, micro_batch_size=4, num_replicas=2)] == [7, 4]
  one, two = (s['layers'][1] for s in summaries)
  assert one['name'] == 'dec0' and two['gflops'] == pytest.approx(one['gflops'] / 2)


@pytest.mark.parametrize('sched,devices', [('zbv', [0, 1, 1, 0]),
                                            ('interleaved_1f1b', [0, 1, 0, 1])])
def testPrintModelPlacesTwoCellsPerDevice(tmp_path, sched, devices):
  """With v=2 the 4 cells run on K=2 devices as the schedule places them, the bubble is that
  schedule's (equal cells: its bubble with a forward of 1 and a backward of 2, a split B
  recomputing the forward, within what the cells' uneven FLOPs move it), and memory is not
  estimated (the planner's model holds one cell per device)."""
  json_out = tmp_path / 'model.json'
  out, _ = _Finish(_Start(
      'print_model', '--model=lm.synthetic.GPipeTransformerLmTiny', '--noshow_params',
      f"--model_params_override=task.stack.schedule : '{sched}'; task.stack.virtual_stages : 2; "
      'task.stack.splits : 4; task.stack.num_decoder_layers : 4; task.stack.remat : "never"',
      f'--json_out={json_out}'), timeout=120)
  (summary,) = json.loads(json_out.read_text())
  assert [s['device'] for s in summary['stages']] == devices
  assert all(s['memory_mb'] is None for s in summary['stages'])
  assert f'4 cells on K=2 (v=2), M=2, {sched}' in out and 'No memory estimate' in out
  bubble = float(re.search(r'Bubble with FLOP-proportional stage costs: ([0-9.]+)', out)[1])
  expected = simulator.Simulate(simulator.Orders(sched, 2, 2, 2), 1.0, 2.0, input_grad_cost=2.0,
                                weight_grad_cost=1.0).bubble_fraction
  assert bubble == pytest.approx(expected, abs=0.03)


def testPlanBalance(runs):
  plan_json, table, err = _Output(runs, 'plan_balance')
  plan = balance_plan.LoadPlan(os.path.join(runs['plan_balance'][1], 'plan.json'))
  assert plan.ends == plan_json['ends'] and len(plan.ends) == 2 and plan.ends[-1] == 4
  assert [p.name for p in plan.layers] == [f'layer{i}' for i in range(4)]
  assert plan.remat_policy in ('none', 'every_layer') and '[4/4]' in err
  assert plan_json['remat_policy'] == plan.remat_policy
  assert plan.memory_cap_bytes is None  # On CPUs no cap by default (devices.DefaultMemoryCap).
  assert {row.split('|')[2].strip() for row in table[2:]} == {plan.remat_policy}
  # Tiny layers: a backward may drown in the timing noise. Such a layer is shown as not
  # measured, never as a time <= 0, and the stages holding it are marked as lower bounds.
  backward = dict(re.findall(r'\] (layer\d): forward [0-9.e-]+ ms, backward ([^,]+),', err))
  assert sorted(backward) == [p.name for p in plan.layers], err
  unmeasured = {name for name, text in backward.items() if text.startswith('not measured')}
  assert all(float(text.split()[0]) > 0 for name, text in backward.items()
             if name not in unmeasured), backward
  for row in table[2:]:
    cells = [c.strip() for c in row.strip('|').split('|')]
    marked = cells[5].endswith(' *')
    assert marked == bool(unmeasured.intersection(cells[3].split(', '))), (row, unmeasured)
  # The simulator predicts the plan's step as the planner did: B and W as measured (the
  # recompute with B), not half the backward each.
  out, err = _Finish(_Start('simulate_schedule', f'--plan={runs["plan_balance"][1]}/plan.json',
                            '--schedules=zb_h1', '--micro_batches=2', tf_log_level=None))
  lines = err.splitlines()  # Its progress only: no TensorFlow start-up lines.
  assert len(lines) == 1 and lines[0].startswith('[1/1] zb_h1 K=2 M=2: bubble'), err
  step_ms = json.loads(out[out.index('\n[') + 1:])[0]['step_ms']
  assert step_ms == pytest.approx(plan_json['predicted']['step_time_s'] * 1e3)


def testPlanBalanceChoosesMScheduleAndRemat(tmp_path):
  out, _ = _Finish(_Start('plan_balance', '--model=mlp', '--layers=4', '--width=32',
                          '--hidden=64', '--rows=16', '--stages=2', '--micro_batches=2',
                          '--repeats=1', '--choose', '--top=3', f'--out={tmp_path}/plan.json'))
  head = '| M | schedule | remat | remat policy | predicted step ms |'
  rows = out.split(head)[1].strip().splitlines()[2:5]  # After the header's rest and ---.
  assert len(rows) == 3 and 'chosen: the fastest predicted step that fits' in rows[0], out
  plan = balance_plan.LoadPlan(str(tmp_path / 'plan.json'))
  chosen = [c.strip() for c in rows[0].strip('|').split('|')]
  assert [str(plan.num_micro_batches), plan.schedule, plan.remat] == chosen[:3]
  assert 16 % plan.num_micro_batches == 0 and plan.schedule in planner.PLANNABLE_SCHEDULES


def _HandPlan(path, remat):
  """A plan of 4 hand-made layers on 2 stages, M=4, 1f1b: 1, 2, 3, 4 ms forward, twice that
  backward, 1 MiB of input and 3 MiB of activations per layer and micro-batch, and 0.5 ms per
  action besides."""
  layers = [profiler.LayerProfile(
      name=f'l{i}', forward_s=(i + 1) * 1e-3, backward_s=2 * (i + 1) * 1e-3, param_bytes=4096,
      input_bytes=2**20, activation_bytes=3 * 2**20) for i in range(4)]
  balance_plan.Plan(source='hand', layers=layers, ends=[2, 4], num_micro_batches=4,
                    schedule='1f1b', remat=remat, optimizer_slots=0,
                    action_overhead_s=0.5e-3).Save(str(path))


@pytest.mark.parametrize('remat', ['never', 'always'])
def testSimulateSchedulePredictsAPlanAtItsBatchAndRemat(tmp_path, remat):
  """By default the plan's own M and schedule; at another M the plan's batch in M
  micro-batches (layer times and activations scaled by the plan's M / M, not the per-action
  overhead); a micro-batch holds its stage's activations without remat, its input with it."""
  _HandPlan(tmp_path / 'plan.json', remat)
  rows = {}
  for name, args in (('own', []), ('m8', ['--micro_batches=8', '--schedules=1f1b,zb_h1'])):
    out, _ = _Finish(_Start('simulate_schedule', f'--plan={tmp_path}/plan.json', *args,
                            f'--json_out={tmp_path}/{name}.json'), timeout=120)
    rows[name] = json.loads((tmp_path / f'{name}.json').read_text())
  (own,) = rows['own']
  assert (own['schedule'], own['stages'], own['micro_batches']) == ('1f1b', 2, 4)
  held_mb = 2 * 3.0 if remat == 'never' else 1.0  # Two layers' activations, or the input.
  recompute = remat != 'never'
  for row, m in [(own, 4)] + [(r, 8) for r in rows['m8']]:
    scale = 4 / m
    forward = [3 * scale, 7 * scale]  # ms: layers 1 + 2 and 3 + 4.
    expected = simulator.Simulate(
        simulator.Orders(row['schedule'], 2, m), [f + 0.5 for f in forward],
        [(2 + recompute) * f + 0.5 for f in forward], activation_bytes=held_mb * scale,
        input_grad_cost=[(1 + recompute) * f + 0.5 for f in forward],
        weight_grad_cost=[f + 0.5 for f in forward])
    assert row['step_ms'] == pytest.approx(expected.step_time)
    assert row['peak_activation_mb'] == pytest.approx(expected.peak_activation_bytes.max())
  assert [r['schedule'] for r in rows['m8']] == ['1f1b', 'zb_h1']


@pytest.mark.parametrize('args,message', [
    (['--stages=8', '--forward_ms=3'], '--stages, --forward_ms with --plan'),
    (['--activation_mb=2'], '--activation_mb with --plan')])
def testSimulateScheduleRefusesFlagsAPlanReplaces(tmp_path, args, message):
  _HandPlan(tmp_path / 'plan.json', 'never')
  proc = _Start('simulate_schedule', f'--plan={tmp_path}/plan.json', *args)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode != 0 and message in err and 'Traceback' not in err, err


def testSimulateSchedule(runs):
  results, _, _ = _Output(runs, 'simulate_schedule')
  assert [(r['schedule'], r['stages']) for r in results] == [
      (name, k) for name in ('gpipe', '1f1b', 'zb_h1', 'zbv') for k in (2, 4)]
  for r in results:  # Uniform costs (B and W half the backward): the unit-cost bubble.
    v = 2 if r['schedule'] == 'zbv' else 1
    expected = schedule.Schedule(r['schedule'], r['stages'], 4, v)
    assert r['bubble'] == pytest.approx(expected.BubbleFraction())
    assert r['max_in_flight'] == max(expected.MaxInFlight(k) for k in range(r['stages']))
    # --activation_mb (1) is a stage's: each of zbv's two chunks keeps half of it.
    assert r['peak_activation_mb'] == pytest.approx(simulator.Simulate(
        simulator.Orders(r['schedule'], r['stages'], 4, v), 1.0 / v, 2.0 / v,
        activation_bytes=1.0 / v).peak_activation_bytes.max())
  with open(os.path.join(runs['simulate_schedule'][1], 'sim.json')) as f:
    assert len([e for e in json.load(f)['traceEvents'] if e['ph'] == 'X']) == 2 * 2 * 4
  # A trace over the size limit is refused before anything is written.
  trace = os.path.join(runs['simulate_schedule'][1], 'too_big.json')
  proc = _Start('simulate_schedule', '--stages=64', '--micro_batches=512',
                f'--trace_out={trace}', '--trace_max_actions=1000')
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == 1 and 'over --trace_max_actions=1000' in err, err[-2000:]
  assert not os.path.exists(trace)


def testClusterBenchmark(runs):
  summary, table, err = _Output(runs, 'cluster_benchmark')
  cases = [(p['schedule'], p['micro_batches']) for p in summary['pipelines']]
  assert cases == [('gpipe', 1), ('gpipe', 2), ('zb_h1', 1), ('zb_h1', 2)] and len(table) == 6
  # A baseline before the first case and after each; each takes the faster neighbour.
  baseline_s = [b['step_s'] for b in summary['baselines']]
  assert len(baseline_s) == 5 and min(baseline_s) > 0
  assert [p['baseline_s'] for p in summary['pipelines']] == [
      min(baseline_s[i:i + 2]) for i in range(4)]
  for point in summary['pipelines']:
    assert point['step_s'] > 0 and 0 <= point['bubble'] <= 1
    assert point['bubble_theory'] == pytest.approx(
        schedule.Schedule(point['schedule'], 2, point['micro_batches']).BubbleFraction())
    # The costs the simulation took: per chunk (2), per boundary (1).
    assert len(point['chunk_costs']['F']) == 2 and len(point['hand_over_times']) == 1
    split = point['schedule'] == 'zb_h1'
    assert all(point['chunk_costs']['W' if split else 'BW']) and not any(
        point['chunk_costs']['BW' if split else 'W'])
  assert ' W ' in table[-1] and 'hand-over' in table[-1]
  assert '[9/9]' in err  # Progress: 5 baselines and 4 pipelines.


def testGpuCheckDryRunOnCpus(runs):
  results, table, err = _Output(runs, 'gpu_check', timeout=900)
  assert '[4/4] throughput K=2 float16' in err
  by_section = {r['section']: r for r in results}
  assert sorted(by_section) == ['bubble', 'exact', 'memory', 'throughput'] and len(results) == 4
  assert all(r['device_kind'] == 'CPU' for r in results)
  exact = by_section['exact']  # check_pipeline: pipelined against unpipelined training.
  assert exact['ok'] and exact['weights_difference'] <= 1e-5 and exact['schedule'] == '1f1b'
  memory = by_section['memory']  # Logical CPUs share one allocator: the process's peak.
  assert not memory['per_device'] and memory['devices'] == ['CPU:0']
  assert memory['measured_bytes'][0] > 0 and memory['predicted_bytes'][0] > 0
  assert 0.0 <= by_section['bubble']['bubble'] < 1.0
  throughput = by_section['throughput']
  assert throughput['dtype'] == 'float16' and throughput['examples_per_s'] > 0
  # 'auto' scales float16 losses; 2^15 overflows, and the warm-up runs past those skips.
  assert throughput['warmup_skipped_steps'] >= 1 and throughput['skipped_steps'] == 0
  assert any('float16 skips: warm-up / timed' in line for line in table)
