"""The Learner turns a task's gradients into training steps.

It owns what the trainer binary and the Estimator do alike with gradients:
global-norm clipping over all of them (so over every pipeline stage), the
learning-rate schedule, the optimizer, a guard that applies nothing when the
loss, the gradients or the updated weights would not be finite (so a saved
checkpoint is always finite), and the global step. `BuildLoop` makes
the device-side loop that runs several steps in one tf.function call
(TPUEstimator's iterations_per_loop).
"""

import tensorflow as tf

from lingvo_gpipe.core import pipeline_stats
from lingvo_gpipe.core import py_utils


def GradientsAndVariables(theta, grads):
  """[(gradient, variable)] of the trainable variables of `theta`, one per variable.

  Non-trainable leaves are skipped. A variable tied across pipeline stages
  appears in theta once per use; the gradients of its uses are summed.
  """
  pairs = {}
  for var, grad in zip(tf.nest.flatten(theta), tf.nest.flatten(grads)):
    if not (isinstance(var, tf.Variable) and var.trainable):
      continue
    grad = tf.convert_to_tensor(grad)
    key = var.ref()
    pairs[key] = (pairs[key][0] + grad, var) if key in pairs else (grad, var)
  return list(pairs.values())


class Learner:
  """Optimizer, learning-rate schedule and clipping of one task, and the global step.

  Args:
    train_params: base_model.TrainParams().
    variables: the trainable variables; their optimizer slots are made now.
    global_step: an int64 tf.Variable counting the applied steps.
  """

  def __init__(self, train_params, variables, global_step):
    self._train_params = train_params.Copy().Freeze()
    self.global_step = global_step
    self.optimizer = train_params.optimizer.Instantiate()
    self.optimizer.CreateSlots(variables)
    self._schedule = train_params.lr_schedule.Instantiate()

  def LearningRate(self, step):
    return self._train_params.learning_rate * self._schedule.Value(step)

  def Apply(self, step, metrics, grads_and_vars):
    """Applies one step's gradients, unless the loss, gradients or new weights are not finite.

    Args:
      step: the global step being computed (an int64 scalar tensor).
      metrics: NestedMap name -> (value, weight) holding 'loss'.
      grads_and_vars: [(gradient, variable)].

    Returns:
      NestedMap of loss, grad_norm (before clipping), learning_rate, finite (whether
      the step was applied: loss, gradients and every new weight and slot finite)
      and the metrics.
    """
    loss = metrics.loss[0]
    grads = [g for g, _ in grads_and_vars]
    grad_norm = tf.linalg.global_norm(grads)
    learning_rate = self.LearningRate(step)
    clip = self._train_params.clip_gradient_norm_to_value

    def Update():
      clipped = tf.clip_by_global_norm(grads, clip, use_norm=grad_norm)[0] if clip > 0 else grads
      applied = self.optimizer.Apply(learning_rate,
                                     [(g, v) for g, (_, v) in zip(clipped, grads_and_vars)])
      self.global_step.assign(step + tf.cast(applied, tf.int64))
      return applied

    finite = tf.cond(tf.math.is_finite(loss) & tf.math.is_finite(grad_norm), Update,
                     lambda: tf.constant(False))
    return py_utils.NestedMap(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate,
                              finite=finite, metrics=metrics)

  def BuildLoop(self, element_spec, forward_backward_fn):
    """A tf.function (iterator, num_steps) -> the last step's Apply outputs.

    Each step takes the next element of the iterator, runs
    forward_backward_fn(element) -> (metrics, grads_and_vars) under an FProp
    context whose step is the global step (so dropout differs per step), and
    applies the gradients. The loop stops after num_steps steps or after a
    step that was not finite (and so not applied); when the input ends, the
    call raises tf.errors.OutOfRangeError with the steps before it applied.
    """
    def Step(element, step):
      return self._TrainStep(forward_backward_fn, element, step)

    # Traced once; the loop body calls the traced step, whose output structure
    # gives the loop's initial state. Without AutoGraph: layers use Python
    # control flow on static values only, and converting them costs seconds.
    step_fn = tf.function(Step, autograph=False).get_concrete_function(element_spec,
                                                      tf.TensorSpec([], tf.int64))

    @tf.function(autograph=False)
    def Loop(iterator, num_steps):
      start = self.global_step.read_value()
      initial = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype),
                                      step_fn.structured_outputs)

      def Continue(i, out):
        return (i < num_steps) & ((i == 0) | out.finite)

      def Body(i, out):
        return i + 1, step_fn(next(iterator), start + i)

      _, out = tf.while_loop(Continue, Body, (tf.constant(0, tf.int64), initial))
      return out

    return Loop

  def _TrainStep(self, forward_backward_fn, element, step, step_stats=None):
    with py_utils.Context(step=step, step_stats=step_stats):
      metrics, grads_and_vars = forward_backward_fn(element)
    return self.Apply(step, metrics, grads_and_vars)

  def BuildMeasuredStep(self, forward_backward_fn):
    """A function iterator -> (Apply outputs, pipeline_stats.Timeline) of one training step.

    The step is BuildLoop's, run with the pipelines' step timing on
    (py_utils.Context(step_stats)) in its own tf.function: built only when
    statistics are asked for, so the usual loop carries no timing ops.
    """
    records = []  # Traced once: the steps' stage, pass and micro-batch.

    @tf.function(autograph=False)
    def Step(iterator):
      records.clear()  # A retrace records the steps afresh.
      out = self._TrainStep(forward_backward_fn, next(iterator),
                            self.global_step.read_value(), step_stats=records)
      return out, pipeline_stats.StackTimes(records)

    def Measured(iterator):
      out, times = Step(iterator)
      return out, pipeline_stats.Timeline.FromRecords(records, times.numpy())

    return Measured
