"""Tests of lingvo_gpipe.runners.elastic: the child's flags, the re-cut, and a client that
loses a worker, trains on, takes it back and ends with an uninterrupted run's weights (the
driver is tools/elastic_benchmark.py's)."""

import importlib.util
import os
import subprocess
import sys

import pytest

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.insight import planner
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.runners import elastic

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MODEL = 'lm.synthetic.GPipeTransformerLmTiny'


def _Tool(name):
  spec = importlib.util.spec_from_file_location(name, os.path.join(_ROOT, 'tools', f'{name}.py'))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def testChildArgsDropWhatTheSupervisorSets():
  argv = ['--job=trainer_client', '--elastic', '--cluster_spec', 'worker=a:1,b:2',
          '--elastic_min_workers=2', '--model=x', '--elastic_wait_secs', '5', '--noelastic',
          '--cluster_spec=worker=c:3', '--logdir=/tmp/y']
  assert elastic.ChildArgs(argv) == ['--job=trainer_client', '--model=x', '--logdir=/tmp/y']


def _TinyParams(**stack):
  params = model_registry.GetParams(_MODEL, 'Train')
  params.task.stack.Set(**stack)
  return params


def testRecutCutsEveryPipelineEvenly():
  params = _TinyParams(num_decoder_layers=4, splits=3)
  layers, _ = pipeline_params.LayersAndEnds(params.task.stack)
  (line,) = elastic.Recut(params.task, 2)
  ends = [round(len(layers) / 2), len(layers)]
  assert list(pipeline_params.LayersAndEnds(params.task.stack)[1]) == ends
  assert line == f'stack: K=2, layers cut at {ends}'


def testRecutRefusesWhatItCannotCut():
  with pytest.raises(ValueError, match='too few for 99 stages'):
    elastic.Recut(_TinyParams().task, 99)
  with pytest.raises(ValueError, match='virtual_stages=2'):
    elastic.Recut(_TinyParams(virtual_stages=2, schedule='interleaved_1f1b').task, 2)


def testReadWorkersFileSkipsCommentsAndNamesABadLine(tmp_path):
  path = tmp_path / 'workers.txt'
  path.write_text('# the pipeline\nlocalhost:1000\n\n  localhost:1001  # joined later\n')
  assert elastic.ReadWorkersFile(str(path)) == ['localhost:1000', 'localhost:1001']
  path.write_text('# none yet\n')
  assert elastic.ReadWorkersFile(str(path)) == []
  path.write_text('localhost:1000\nlocalhost\n')
  with pytest.raises(cluster_lib.ClusterError, match="'localhost' of job 'worker' is not host"):
    elastic.ReadWorkersFile(str(path))
  with pytest.raises(cluster_lib.ClusterError, match='cannot read .*missing.txt'):
    elastic.ReadWorkersFile(str(tmp_path / 'missing.txt'))


def _TinyPlan(params, num_stages, forward_s, param_bytes=1000):
  """A balance plan of the tiny LM's layers with the given forward seconds (backward twice
  those), planned for `num_stages` stages without a memory cap."""
  layers, _ = pipeline_params.LayersAndEnds(params.task.stack)
  profiles = [profiler.LayerProfile(q.name, f, 2 * f, param_bytes, 1, 0)
              for q, f in zip(layers, forward_s)]
  return planner.MakePlan(profiles, num_stages, 2, glued=[len(layers) - 1], source=_MODEL)


def testReplanCutsByThePlannerFromTheBalancePlan():
  params = _TinyParams(num_decoder_layers=4, splits=3)
  # Layers tgt_emb, dec0..dec3, softmax (glued to dec3): on two stages, the even split of
  # the time is 3 + 3 seconds, cut after dec1.
  plan = _TinyPlan(params, 3, [1, 1, 1, 1, 1, 1])
  lines = elastic.Replan(params, 2, plan, batch_size=32)
  stack = params.task.stack
  assert list(pipeline_params.LayersAndEnds(stack)[1]) == [3, 6]
  assert lines[0].startswith('planned K=2, layers cut at [3, 6], ')
  assert 32 % stack.num_micro_batches == 0 and stack.virtual_stages == 1
  assert stack.schedule in planner.PLANNABLE_SCHEDULES
  # A schedule the user set stays, one the planner would not choose; the planner chooses
  # the rest around it.
  own = next(name for name in planner.PLANNABLE_SCHEDULES if name != stack.schedule)
  params = _TinyParams(num_decoder_layers=4, splits=3, schedule=own)
  elastic.Replan(params, 2, plan, 32, fixed={'task.stack.schedule'})
  assert params.task.stack.schedule == own
  assert list(pipeline_params.LayersAndEnds(params.task.stack)[1]) == [3, 6]


def testReplanSaysWhenTheModelDoesNotFitTheWorkersLeft():
  params = _TinyParams(num_decoder_layers=4, splits=3)
  plan = _TinyPlan(params, 3, [1] * 6, param_bytes=10**6)
  plan.memory_cap_bytes = max(plan.StageMemory()) * 1.01  # Fits three stages, not one.
  elastic.Replan(params, 3, plan, 32)
  with pytest.raises(elastic.NoFitError, match='--elastic on 1 worker.*memory cap'):
    elastic.Replan(params, 1, plan, 32)


def testReplanWithoutAPlanCutsEvenly():
  params = _TinyParams(num_decoder_layers=4, splits=3)
  assert elastic.Replan(params, 2, None, 32) == ['stack: K=2, layers cut at [3, 6]']
  assert elastic.Replan(params, 3, None, None) == ['stack: K=3, layers cut at [2, 4, 6]']


def testReplanByAPlanNeedsTheBatchSize():
  params = _TinyParams(num_decoder_layers=4, splits=3)
  plan = _TinyPlan(params, 3, [1] * 6)
  with pytest.raises(ValueError, match='the planner needs the batch size.*no batch_size'):
    elastic.Replan(params, 2, plan, None)


def testAClientThatDoesNotFitExitsNoFitInOneLine(tmp_path):
  """The child's exit status that has the supervisor wait for more workers (no worker is
  reached: the cut comes first)."""
  params = _TinyParams(num_decoder_layers=4, splits=3)
  plan = _TinyPlan(params, 3, [1] * 6, param_bytes=10**6)
  plan.memory_cap_bytes = max(plan.StageMemory()) * 1.01
  plan.Save(str(tmp_path / 'plan.json'))
  result = subprocess.run(
      [sys.executable, '-m', 'lingvo_gpipe.trainer', f'--model={_MODEL}',
       '--model_params_override=task.stack.num_decoder_layers : 4; task.stack.splits : 3',
       '--job=trainer_client', '--cluster_spec=worker=localhost:1', '--elastic_stages=1',
       f'--balance_file={tmp_path / "plan.json"}', f'--logdir={tmp_path / "log"}'],
      capture_output=True, text=True, timeout=120, check=False,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'))
  assert result.returncode == elastic.NO_FIT, result.stderr[-3000:]
  errors = [line for line in result.stderr.splitlines() if line.startswith('trainer: error:')]
  assert len(errors) == 1 and '--elastic on 1 worker(s): None of the' in errors[0]
  assert 'fits a memory cap' in errors[0]
  assert 'Traceback' not in result.stderr


@pytest.mark.slow
def testALostWorkerCostsARestartNotTheRun(tmp_path, monkeypatch):
  """Three workers, two listed at first: one of them is killed after a checkpoint and
  started again later, then the third is listed: the client trains on two, one, two and
  three, and ends with the weights and losses of a run never interrupted (in one process
  on three logical devices)."""
  monkeypatch.syspath_prepend(os.path.join(_ROOT, 'tools'))
  bench = _Tool('elastic_benchmark')
  logdir, straight = str(tmp_path / 'elastic'), str(tmp_path / 'straight')
  reference = bench.StartReference(straight, 60)
  with _Tool('local_cluster').LocalCluster(3, log_dir=str(tmp_path)) as workers:
    changes, lines = bench.RunSequence(workers, logdir, 60, kill_after=4, task=1, listed=2)
  _, err = reference.communicate(timeout=300)
  assert reference.returncode == 0, err[-3000:]
  (one, lost_from, _, _), (two, back_from, _, _), (three, listed_from, _, _) = changes
  assert (one, two, three) == (1, 2, 3)
  # After the loss, from the last periodic checkpoint; on a return or a newly listed
  # worker, from the one the stopped client saved after its step.
  assert lost_from % 3 == 0 and listed_from >= back_from >= lost_from
  assert bench.WeightError(bench.Weights(logdir), bench.Weights(straight)) < 1e-5
  want_losses = bench.Losses(straight)
  assert sorted(want_losses) == [20, 40, 60]
  assert bench.LossError(bench.Losses(logdir), want_losses) < 1e-5
  assert not any('Traceback' in line for line in lines)
