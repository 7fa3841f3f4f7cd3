"""A tiny pipelined regression experiment for the trainer and Estimator tests.

Registered as toy.regression.PipelinedRegression once this directory is
imported (LINGVO_GPIPE_PARAMS=tests/testdata/params or
model_registry.ImportParams). Two pipeline stages, two micro-batches, a few
hundred parameters: a step takes milliseconds, so tests pay mostly for
starting TensorFlow.
"""

import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.inputs import base_input_generator
from lingvo_gpipe.models import base_model
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.pipeline import gpipe


class RegressionInput(base_input_generator.BaseInputGenerator):
  """x ~ N(0, 1) of input_dim features; y = sum_i (i + 1) * x_i, learnable exactly."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 4, 'Features per example.')
    return p

  def ExampleAt(self, index):
    dim = self.params.input_dim
    x = tf.random.stateless_normal([dim], self.ExampleSeed(index))
    y = tf.reduce_sum(x * tf.range(1.0, dim + 1.0), keepdims=True)
    return py_utils.NestedMap(x=x, y=y)


class RegressionTask(base_model.BaseTask):
  """Squared error of a two-stage pipelined MLP."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 4, 'Features per example.')
    p.Define('hidden_dim', 8, 'Width of the hidden layer (the stage boundary).')
    p.Define('num_micro_batches', 2, 'Micro-batches per batch.')
    p.Define('nan_at_step', -1, 'If >= 0, the loss is NaN from this global step on, and in '
             'evaluation.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    cells = [
        layers.ProjectionLayer.Params().Set(name='hidden', input_dim=p.input_dim,
                                            output_dim=p.hidden_dim, activation='RELU'),
        layers.ProjectionLayer.Params().Set(name='out', input_dim=p.hidden_dim, output_dim=1),
    ]
    self.CreateChild('pipe', gpipe.PipeliningLayer.Params().Set(
        cell_tpl=cells, num_micro_batches=p.num_micro_batches))

  def _Metrics(self, predictions, targets):
    error = predictions - targets
    loss = tf.reduce_mean(tf.square(error))
    if self.params.nan_at_step >= 0:
      step = py_utils.CurrentContext().step  # None in evaluation.
      nan = True if step is None else step >= self.params.nan_at_step
      loss += tf.where(nan, float('nan'), 0.0)
    weight = tf.cast(tf.shape(targets)[0], tf.float32)
    return py_utils.NestedMap(loss=(loss, weight),
                              abs_error=(tf.reduce_mean(tf.abs(error)), weight))

  def ComputePredictions(self, theta, input_batch):
    return py_utils.NestedMap(y=self.pipe.FProp(theta.pipe, input_batch.x))

  def ComputeLoss(self, theta, predictions, input_batch):
    return self._Metrics(predictions.y, input_batch.y)

  def ForwardBackward(self, theta, input_batch):
    metrics, grads = self.pipe.ForwardBackward(
        theta.pipe, input_batch.x, lambda out: self._Metrics(out, input_batch.y))
    return metrics, py_utils.NestedMap(pipe=grads)


@model_registry.RegisterSingleTaskModel
class PipelinedRegression(base_model_params.SingleTaskModelParams):
  """Six steps, a checkpoint every two, summaries and logs every step."""

  def Train(self):
    return RegressionInput.Params().Set(batch_size=8, seed=1)

  def Dev(self):
    return RegressionInput.Params().Set(batch_size=8, seed=2, num_batches=2)

  def Test(self):
    return RegressionInput.Params().Set(batch_size=8, seed=3, num_batches=3)

  def Task(self):
    p = RegressionTask.Params().Set(name='regression')
    p.train.learning_rate = 0.05
    return p

  def Model(self):
    p = super().Model()
    p.train.Set(max_steps=6, save_interval_steps=2, summary_interval_steps=1,
                log_interval_steps=1)
    return p
