"""The Learner turns a task's gradients into training steps.

It owns what the trainer binary and the Estimator do alike with gradients:
global-norm clipping over all of them (so over every pipeline stage), the
learning-rate schedule, the optimizer, float16 loss scaling (loss_scale.py), a
guard that applies nothing when the loss, the gradients or the learning rate are
not finite, and the global step. The guard tells a float16 overflow (a skipped
step: the scale goes down, training goes on) from a real NaN (training stops). An
update that makes a weight or slot not finite is reported as not finite, so that
the runner stops before saving it: a saved checkpoint is always finite.
`BuildLoop` makes the device-side loop that runs several steps in one
tf.function call (TPUEstimator's iterations_per_loop).
"""

from typing import Any, Callable, Sequence

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.insight import pipeline_stats


def GradientsAndVariables(theta: py_utils.NestedMap,
                          grads: py_utils.NestedMap) -> list[tuple[tf.Tensor, tf.Variable]]:
  """[(gradient, variable)] of the trainable variables of `theta`, one per variable.

  Non-trainable leaves are skipped. A variable tied across pipeline stages
  appears in theta once per use; the gradients of its uses are summed. `grads` must mirror
  theta: they are paired by position.
  """
  try:
    tf.nest.assert_same_structure(theta, grads)
  except (ValueError, TypeError) as e:
    raise ValueError(f'The gradients do not mirror theta, so they cannot be paired with its '
                     f'variables: {e}') from None
  pairs = {}
  for var, grad in zip(tf.nest.flatten(theta), tf.nest.flatten(grads)):
    if not (isinstance(var, tf.Variable) and var.trainable):
      continue
    grad = tf.convert_to_tensor(grad)
    key = var.ref()
    pairs[key] = (pairs[key][0] + grad, var) if key in pairs else (grad, var)
  return list(pairs.values())


class Learner:
  """Optimizer, learning-rate schedule, clipping and loss scale of one task, and the global step.

  Args:
    train_params: base_model.TrainParams(), its loss_scale.mode decided
      (BaseTask.train_params); an undecided 'auto' scales nothing.
    variables: the trainable variables; their optimizer slots are made now.
    global_step: an int64 tf.Variable counting the steps done (applied or skipped).
  """

  def __init__(self, train_params: hyperparams.Params, variables: Sequence[tf.Variable],
               global_step: tf.Variable):
    self._train_params = train_params.Copy().Freeze()
    self.global_step = global_step
    self.optimizer = train_params.optimizer.Instantiate()
    self.optimizer.CreateSlots(variables)
    self._schedule = train_params.lr_schedule.Instantiate()
    scaling = train_params.loss_scale
    self.loss_scale = scaling.Instantiate() if scaling.mode == 'dynamic' else None

  @property
  def state(self):
    """What a checkpoint keeps of the Learner besides the global step: name -> tf.Module."""
    state = {'optimizer': self.optimizer}
    if self.loss_scale is not None:
      state['loss_scale'] = self.loss_scale
    return state

  def LearningRate(self, step: tf.Tensor) -> tf.Tensor:
    return self._train_params.learning_rate * self._schedule.Value(step)

  def Apply(self, step: tf.Tensor, metrics: py_utils.NestedMap,
            grads_and_vars: Sequence[tuple[tf.Tensor, tf.Variable]]) -> py_utils.NestedMap:
    """Applies one step's gradients, unless the loss, gradients or learning rate are not finite.

    Args:
      step: the global step being computed (an int64 scalar tensor).
      metrics: NestedMap name -> (value, weight) holding 'loss'.
      grads_and_vars: [(gradient, variable)], unscaled.

    Returns:
      NestedMap of loss, grad_norm (before clipping), learning_rate, finite (the step
      went well: applied with every new weight and slot finite, or skipped for a float16
      overflow), skipped (that skip), the metrics, and with loss scaling loss_scale (the
      scale after this step: the next step's) and skipped_steps (all skips so far).
    """
    loss = metrics.loss[0]
    grads = [g for g, _ in grads_and_vars]
    grad_norm = tf.linalg.global_norm(grads)
    learning_rate = self.LearningRate(step)
    clip = self._train_params.clip_gradient_norm_to_value

    def Update():
      clipped = tf.clip_by_global_norm(grads, clip, use_norm=grad_norm)[0] if clip > 0 else grads
      return self.optimizer.Apply(learning_rate,
                                  [(g, v) for g, (_, v) in zip(clipped, grads_and_vars)])

    loss_finite = tf.math.is_finite(loss)
    grads_finite = tf.math.is_finite(grad_norm)
    usable = loss_finite & grads_finite & tf.math.is_finite(
        tf.cast(learning_rate, tf.float32))
    updated_finite = tf.cond(usable, Update, lambda: tf.constant(False))
    out = py_utils.NestedMap(loss=loss, grad_norm=grad_norm, learning_rate=learning_rate,
                             metrics=metrics)
    skipped = tf.constant(False)
    if self.loss_scale is not None:
      skipped = tf.cond(loss_finite, lambda: self.loss_scale.Update(grads_finite),
                        lambda: tf.constant(False))
      out.loss_scale = self.loss_scale.scale.read_value()
      out.skipped_steps = self.loss_scale.skipped_steps.read_value()
    out.skipped = skipped
    out.finite = updated_finite | skipped
    self.global_step.assign(step + tf.cast(out.finite, tf.int64))
    return out

  def StepForwardBackward(self, forward_backward_fn: Callable[[Any], tuple], element, step,
                          step_stats=None) -> tuple:
    """forward_backward_fn(element) under the FProp context of training step `step`, as
    the loop runs it; also how a failed step is run again (errors.ExplainingCancelledSteps)."""
    scale = None if self.loss_scale is None else self.loss_scale.scale.read_value()
    with py_utils.Context(step=step, step_stats=step_stats, loss_scale=scale):
      return forward_backward_fn(element)

  def _TrainStep(self, forward_backward_fn, element, step, step_stats=None):
    metrics, grads_and_vars = self.StepForwardBackward(forward_backward_fn, element, step,
                                                       step_stats)
    return self.Apply(step, metrics, grads_and_vars)

  def BuildLoop(self, element_spec, forward_backward_fn: Callable[[Any], tuple]) -> Callable:
    """A tf.function (iterator, num_steps) -> the last step's Apply outputs, and `skips`:
    the steps of this call skipped for a float16 overflow.

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
    # control flow on static values only, and converting them only adds trace time.
    step_fn = tf.function(Step, autograph=False).get_concrete_function(element_spec,
                                                      tf.TensorSpec([], tf.int64))

    @tf.function(autograph=False)
    def Loop(iterator, num_steps):
      start = self.global_step.read_value()
      initial = tf.nest.map_structure(lambda t: tf.zeros(t.shape, t.dtype),
                                      step_fn.structured_outputs)

      def Continue(i, skips, out):
        del skips  # Counted only.
        return (i < num_steps) & ((i == 0) | out.finite)

      def Body(i, skips, out):
        out = step_fn(next(iterator), start + i)
        return i + 1, skips + tf.cast(out.skipped, tf.int64), out

      zero = tf.constant(0, tf.int64)
      _, skips, out = tf.while_loop(Continue, Body, (zero, zero, initial))
      out.skips = skips
      return out

    return Loop

  def BuildMeasuredStep(self, forward_backward_fn: Callable[[Any], tuple]) -> Callable:
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
      out.skips = tf.cast(out.skipped, tf.int64)
      return out, pipeline_stats.StackTimes(records)

    def Measured(iterator):
      out, times = Step(iterator)
      return out, pipeline_stats.Timeline.FromRecords(records, times.numpy())

    return Measured
