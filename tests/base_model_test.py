"""Tests of lingvo_gpipe.models.base_model."""

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import base_model
from lingvo_gpipe.training import learner


class _Tied(base_layer.BaseLayer):
  """Uses weight w twice: as its own and as the shared `tied` of a child."""

  def __init__(self, params):
    super().__init__(params)
    w = self.CreateVariable('w', py_utils.WeightParams([3, 3]))
    self.CreateChild('child', base_layer.BaseLayer.Params())
    self.child.AddSharedVariable('tied', w)


class _Task(base_model.BaseTask):
  """Loss sum((x @ w @ tied)^2): w is used twice through two theta entries."""

  def __init__(self, params):
    super().__init__(params)
    self.CreateChild('model', _Tied.Params())

  def ComputePredictions(self, theta, input_batch):
    return input_batch.x @ theta.model.w @ theta.model.child.tied

  def ComputeLoss(self, theta, predictions, input_batch):
    return py_utils.NestedMap(loss=(tf.reduce_sum(predictions ** 2), 1.0))


def testTiedWeightGradientIsCountedOnce():
  task = _Task.Params().Set(name='task').Instantiate()
  batch = py_utils.NestedMap(x=tf.random.stateless_normal([4, 3], [1, 1]))
  w = task.model.vars.w
  assert task.vars.model.child.tied is w
  with tf.GradientTape() as tape:
    loss = tf.reduce_sum((batch.x @ w @ w) ** 2)
  want = tape.gradient(loss, w)
  metrics, grads = task.ForwardBackward(task.theta, batch)
  np.testing.assert_allclose(float(metrics.loss[0]), float(loss), rtol=1e-6)
  pairs = learner.GradientsAndVariables(task.vars, grads)
  assert len(pairs) == 1 and pairs[0][1] is w
  np.testing.assert_allclose(pairs[0][0].numpy(), want.numpy(), rtol=1e-5)


def testInferenceRunsInEvalMode():
  class _Probe(_Task):

    def ComputePredictions(self, theta, input_batch):
      return tf.constant(py_utils.CurrentContext().training)

  task = _Probe.Params().Set(name='task').Instantiate()
  assert not bool(task.Inference(task.theta, py_utils.NestedMap()))
  assert bool(task.ComputePredictions(task.theta, py_utils.NestedMap()))
