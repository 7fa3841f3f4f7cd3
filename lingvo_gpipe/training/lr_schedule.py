"""Learning-rate schedules: the multiplier of the base learning rate at a step.

A schedule is configured by Params and evaluated on the global step inside the
training step, so the rate trained with is
`task.train.learning_rate * schedule.Value(global_step)`.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams


class BaseSchedule:
  """A multiplier of the learning rate as a function of the global step."""

  @classmethod
  def Params(cls):
    return hyperparams.InstantiableParams(cls)

  def __init__(self, params):
    self._params = params.Copy().Freeze()

  @property
  def params(self):
    return self._params

  def Value(self, step):
    """The float32 multiplier at `step` (an int or integer scalar tensor)."""
    raise NotImplementedError(f'{type(self).__name__}.Value')


class Constant(BaseSchedule):
  """The base learning rate at every step."""

  def Value(self, step):
    del step  # Unused: the rate does not change.
    return tf.constant(1.0)


class LinearWarmupRsqrtDecay(BaseSchedule):
  """Transformer training's schedule: linear warm-up, then decay as 1/sqrt(step).

  With t = step + 1 and w = warmup_steps the multiplier is
    scale * min(t / w, sqrt(w / t)),
  rising linearly to its peak `scale` at t = w. scale is 1, or, with model_dim
  set, (model_dim * w) ** -0.5, which gives Vaswani et al.'s
  model_dim**-0.5 * min(t**-0.5, t * w**-1.5) (learning_rate then is a factor
  such as 1.0 or 2.0).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('warmup_steps', 4000, 'Steps of linear warm-up; the peak is at step warmup_steps - 1.')
    p.Define('model_dim', None, 'If set, scale by (model_dim * warmup_steps) ** -0.5.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not isinstance(p.warmup_steps, int) or p.warmup_steps < 1:
      raise ValueError(f'warmup_steps must be a positive int, got {p.warmup_steps!r}.')
    if p.model_dim is not None and (not isinstance(p.model_dim, int) or p.model_dim < 1):
      raise ValueError(f'model_dim must be None or a positive int, got {p.model_dim!r}.')

  def Value(self, step):
    p = self.params
    t = tf.cast(step, tf.float32) + 1.0
    w = float(p.warmup_steps)
    scale = 1.0 if p.model_dim is None else (p.model_dim * w) ** -0.5
    return scale * tf.minimum(t / w, tf.sqrt(w / t))
