"""BaseTask: a trainable model, seen by trainers as metrics and their gradients.

A task computes predictions from an input batch and metrics from predictions.
Metrics are Lingvo-style (value, weight) pairs: `value` is a mean over `weight`
items (tokens, examples), so metrics of several batches or micro-batches merge
exactly as sum(value * weight) / sum(weight). The metric named 'loss' is the
one trained.

Trainers only call ForwardBackward (training) and FPropTower / Inference
(evaluation, prediction). A pipelined task overrides ForwardBackward to run its
PipeliningLayer's schedule.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.training import loss_scale
from lingvo_gpipe.training import lr_schedule
from lingvo_gpipe.training import optimizer


def TrainParams():
  """How a task is trained: optimizer, learning rate, clipping."""
  p = hyperparams.Params()
  p.Define('optimizer', optimizer.Adam.Params(),
           'Optimizer params: SGD, Momentum, Adam or Adafactor of lingvo_gpipe.training.optimizer.')
  p.Define('learning_rate', 1e-3, 'Base learning rate.')
  p.Define('lr_schedule', lr_schedule.Constant.Params(),
           'Learning-rate schedule params (lingvo_gpipe.training.lr_schedule): the multiplier of '
           'learning_rate at each step.')
  p.Define('clip_gradient_norm_to_value', 0.0,
           'If > 0, scale gradients so their global norm (over all stages) is at most this.')
  p.Define('loss_scale', loss_scale.Params(),
           'float16 loss scaling (lingvo_gpipe.training.loss_scale): mode auto, dynamic or none.')
  return p


def _CheckTrainParams(where, t):
  """Raises a ValueError naming a learning rate or clipping value no run can use."""
  for key in ('learning_rate', 'clip_gradient_norm_to_value'):
    value = t.Get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
        0 <= value < float('inf')):
      raise ValueError(f'{where}.train.{key}={value!r}: expected a finite number >= 0.')
  loss_scale.CheckParams(f'{where}.train.loss_scale', t.loss_scale)


class BaseTask(base_layer.BaseLayer):
  """Base class of tasks."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('train', TrainParams(), 'Training settings of this task.')
    return p

  def __init__(self, params):
    super().__init__(params)
    _CheckTrainParams(self.path, self.params.train)

  @property
  def train_params(self):
    """params.train with loss_scale.mode 'auto' decided: 'dynamic' when a layer of this
    task computes in float16."""
    train = self.params.train.Copy()
    train.loss_scale = loss_scale.Resolved(train.loss_scale, self)
    return train.Freeze()

  def ComputePredictions(self, theta, input_batch):
    """Predictions (a NestedMap) of the batch."""
    raise NotImplementedError(f'{type(self).__name__}.ComputePredictions')

  def ComputeLoss(self, theta, predictions, input_batch):
    """NestedMap of metrics name -> (value, weight), holding 'loss'."""
    raise NotImplementedError(f'{type(self).__name__}.ComputeLoss')

  def FPropTower(self, theta, input_batch):
    """Metrics of one batch."""
    return self.ComputeLoss(theta, self.ComputePredictions(theta, input_batch), input_batch)

  def ForwardBackward(self, theta, input_batch):
    """(metrics, grads): grads of metrics.loss, a NestedMap shaped like theta; unscaled (a
    float16 loss scale of the FProp context is applied to the loss and taken off again).

    A leaf occurring several times in theta (tied weights) holds its gradient
    at its first occurrence and zeros at the others, so that summing per
    variable (learner.GradientsAndVariables) counts it once, as it must for a
    pipeline's per-occurrence gradient shares.
    """
    with tf.GradientTape() as tape:
      metrics = self.FPropTower(theta, input_batch)
    leaves = tf.nest.flatten(theta)
    grads = py_utils.ScaledGradients(tape, metrics.loss[0], leaves)
    seen = set()
    for i, leaf in enumerate(leaves):
      if leaf.ref() in seen:
        grads[i] = tf.zeros_like(grads[i])
      seen.add(leaf.ref())
    return metrics, tf.nest.pack_sequence_as(theta, grads)

  def Inference(self, theta, input_batch):
    """Predictions for serving: evaluation mode, no loss."""
    with py_utils.EvalMode():
      return self.ComputePredictions(theta, input_batch)


class SingleTaskModel(base_layer.BaseLayer):
  """What `model_registry.GetParams(key, dataset).Instantiate()` builds: the task.

  Transparent (base_layer): the task's variables are named as when it is built
  alone ('lm/stack/...'), so checkpoints do not depend on how it was built.
  """

  TRANSPARENT = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('task', None, 'Params of the task.')
    p.Define('train', None, 'Training-loop settings (max_steps, save_interval_steps, ...).')
    p.Define('input', None, 'Input-generator params of the dataset being run.')
    return p

  def __init__(self, params):
    super().__init__(params)
    task = self.params.task
    self._task = self.CreateChild(task.name, task)

  @property
  def task(self):
    return self._task

  def GetTask(self):
    """The task (Lingvo's name)."""
    return self._task
