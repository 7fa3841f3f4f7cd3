"""Tests of lingvo_gpipe.runners.pipeline_check (the trainer's --mode=check_pipeline)."""

import os
import subprocess
import sys

import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.inputs import base_input_generator
from lingvo_gpipe.models import base_model
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.runners import pipeline_check

DIM = 6


class _Input(base_input_generator.BaseInputGenerator):
  """x ~ N(0, 1) of DIM features."""

  def ExampleAt(self, index):
    return tf.random.stateless_normal([DIM], self.ExampleSeed(index))


class _StatefulNoise(base_layer.BaseLayer):
  """A user's layer with the classic mistake: stateful random noise, redrawn by a recompute."""

  def FProp(self, theta, x):
    del theta
    return x + 0.1 * tf.random.uniform(tf.shape(x)) if py_utils.CurrentContext().training else x


class _Task(base_model.BaseTask):
  """Mean square of a pipeline's outputs; the pipeline is in the params (`pipe`)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('pipe', None, 'PipeliningLayer params.')
    return p

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('pipe', self.params.pipe)

  def ForwardBackward(self, theta, input_batch):
    loss, grads = self.pipe.ForwardBackward(theta.pipe, input_batch,
                                            lambda y: tf.reduce_mean(y ** 2), loss_reduction='mean')
    return py_utils.NestedMap(loss=(loss, 1.0)), py_utils.NestedMap(pipe=grads)


def _ModelParams(extra_layer=None, **pipe_settings):
  layer_params = [layers.ProjectionLayer.Params().Set(name='p0', input_dim=DIM, output_dim=DIM),
                  layers.DropoutLayer.Params().Set(name='drop', keep_prob=0.7),
                  layers.BatchNormLayer.Params().Set(name='bn', dim=DIM, decay=0.5),
                  layers.ProjectionLayer.Params().Set(name='p1', input_dim=DIM, output_dim=DIM)]
  if extra_layer:
    layer_params.insert(1, extra_layer)
  pipe = gpipe.PipeliningLayer.Params().Set(
      cell_tpl=gpipe.CellsFromEnds(layer_params, [2, len(layer_params)]), **pipe_settings)
  task = _Task.Params().Set(name='toy', pipe=pipe)
  task.train.learning_rate = 0.1
  return base_model.SingleTaskModel.Params().Set(
      name='Toy', task=task, input=_Input.Params().Set(batch_size=16, seed=3))


def testAPipelineOfDropoutAndBatchNormPasses():
  report = pipeline_check.CheckPipeline(
      _ModelParams(num_micro_batches=2, num_replicas=2, schedule='1f1b', remat='except_last',
                   cell_remat_policy='every_layer'),
      num_steps=3)
  assert report.ok and report.same_start, report.Text()
  assert report.loss_difference < 1e-5 and report.weights[0] < 1e-5
  assert report.statistics[1] == 'toy/pipe/bn'  # Moving statistics are compared.
  assert ('task.pipe: K=2, M=2, 1f1b, remat except_last, remat policy every_layer, R=2' in
          report.Text())
  assert 'gpipe, remat never, remat policy none, the same micro-batches' in report.Text()
  assert report.Text().endswith('PASS (tolerance 0.0001)')



@pytest.mark.parametrize('sched, cut', [('zbv', [1, 2, 3, 4]), ('interleaved_1f1b', [2, 4])])
def testAPipelineOfSeveralChunksPerDeviceIsCheckedOnOneChunk(sched, cut):
  """The unpipelined twin is one cell: one chunk, whatever virtual_stages the pipeline has."""
  model = _ModelParams(num_micro_batches=2, schedule=sched, virtual_stages=2)
  pipeline_params.Recut(model.task.pipe, cut)
  report = pipeline_check.CheckPipeline(model, num_steps=2)
  assert report.ok and report.same_start, report.Text()
  assert report.loss_difference < 1e-5 and report.weights[0] < 1e-5

def testStatefulRandomOpsFailTheCheck():
  tf.random.set_seed(None)  # Under a global seed a recompute would draw the same noise.
  noisy = _StatefulNoise.Params().Set(name='noise')
  report = pipeline_check.CheckPipeline(_ModelParams(noisy, num_micro_batches=4), num_steps=2)
  assert not report.ok
  assert report.loss_difference > 1e-3
  assert report.Text().splitlines()[-1] == 'FAIL (tolerance 0.0001)'


def testTheTrainerRunsTheCheckOnARegisteredModel(tmp_path):
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')
  command = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', '--mode=check_pipeline',
             '--model=lm.synthetic.GPipeTransformerLmTiny', '--check_steps=2']
  proc = subprocess.run(command + ["--model_params_override=task.stack.schedule : '1f1b'"],
                        env=env, capture_output=True, text=True, check=False, cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert 'task.stack: K=2, M=2, 1f1b' in proc.stdout
  assert proc.stdout.rstrip().endswith('PASS (tolerance 0.0001)')
  proc = subprocess.run(command + ['--check_tolerance=-1'], env=env, capture_output=True,
                        text=True, check=False, cwd=tmp_path)
  assert proc.returncode == 1
  assert proc.stderr.strip().splitlines()[-1] == (
      'trainer: error: check_pipeline needs num_steps >= 1 and tolerance > 0; got 2 and -1.0.')
