"""Tests of lingvo_gpipe.runners.elastic: the child's flags, the re-cut, and a client that
loses a worker, trains on, takes it back and ends with an uninterrupted run's weights (the
driver is tools/elastic_benchmark.py's)."""

import importlib.util
import os

import pytest

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


@pytest.mark.slow
def testALostWorkerCostsARestartNotTheRun(tmp_path, monkeypatch):
  """Three workers; one is killed after a checkpoint and started again later: the client
  trains on two, then on three, and ends with the weights and losses of a run never
  interrupted (in one process on three logical devices)."""
  monkeypatch.syspath_prepend(os.path.join(_ROOT, 'tools'))
  bench = _Tool('elastic_benchmark')
  logdir, straight = str(tmp_path / 'elastic'), str(tmp_path / 'straight')
  reference = bench.StartReference(straight, 60)
  with _Tool('local_cluster').LocalCluster(3, log_dir=str(tmp_path)) as workers:
    changes, lines = bench.RunSequence(workers, logdir, 60, kill_after=4, task=1)
  _, err = reference.communicate(timeout=300)
  assert reference.returncode == 0, err[-3000:]
  (two, lost_from, _, _), (three, back_from, _, _) = changes
  assert (two, three) == (2, 3)
  # After the loss, from the last periodic checkpoint; on the return, from the one the
  # stopped client saved after its step.
  assert lost_from % 3 == 0 and back_from >= lost_from
  assert bench.WeightError(bench.Weights(logdir), bench.Weights(straight)) < 1e-5
  want_losses = bench.Losses(straight)
  assert sorted(want_losses) == [20, 40, 60]
  assert bench.LossError(bench.Losses(logdir), want_losses) < 1e-5
  assert not any('Traceback' in line for line in lines)
