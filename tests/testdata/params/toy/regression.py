"""A tiny pipelined regression experiment for the trainer and Estimator tests.

Registered as toy.regression.PipelinedRegression (and FailsOnBatch2, whose step 2 fails
inside a chunk) once this directory is
imported (LINGVO_GPIPE_PARAMS=tests/testdata/params or
model_registry.ImportParams). Two pipeline stages, two micro-batches, a few
hundred parameters: a step takes milliseconds, so tests pay mostly for
starting TensorFlow.
"""

import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.inputs import base_input_generator
from lingvo_gpipe.models import base_model
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks
from lingvo_gpipe.pipeline import gpipe


class RegressionInput(base_input_generator.BaseInputGenerator):
  """x ~ N(0, 1) of input_dim features; y = sum_i (i + 1) * x_i, learnable exactly."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 4, 'Features per example.')
    p.Define('infinite_example', -1, 'If >= 0, the index of an example whose x is infinite.')
    return p

  def ExampleAt(self, index):
    dim = self.params.input_dim
    x = tf.random.stateless_normal([dim], self.ExampleSeed(index))
    x = tf.where(index == self.params.infinite_example, float('inf'), x)
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


class FailsOnNonFinite(base_layer.BaseLayer):
  """x, or an InvalidArgumentError when the step runs on a non-finite x: an op deep in a
  model that fails on bad data."""

  def FProp(self, theta, x):
    del theta  # No variables.
    return tf.debugging.assert_all_finite(x, 'FailsOnNonFinite: a non-finite activation')


@model_registry.RegisterSingleTaskModel
class FailsOnBatch2(PipelinedRegression):
  """Four stages under 1F1B, the third's first layer failing on training batch 2 and Dev
  batch 1 (whose first x is infinite): TensorFlow reports those steps as CancelledError."""

  def Train(self):
    return super().Train().Set(infinite_example=16)

  def Dev(self):
    return super().Dev().Set(infinite_example=8)

  def Task(self):
    def Projection(name, output_dim=8, input_dim=8):
      return layers.ProjectionLayer.Params().Set(name=name, input_dim=input_dim,
                                                 output_dim=output_dim)
    stack = [Projection('in', input_dim=4), Projection('a'), Projection('b'),
             FailsOnNonFinite.Params().Set(name='fails'), Projection('c'),
             Projection('out', output_dim=1)]
    p = tasks.SequentialStackTask.Params().Set(
        name='regression', loss='mse', stack=gpipe.PipeliningLayer.Params().Set(
            cell_tpl=gpipe.CellsFromEnds(stack, [2, 3, 5, 6]), num_micro_batches=4,
            schedule='1f1b'))
    p.train.learning_rate = 0.05
    return p
