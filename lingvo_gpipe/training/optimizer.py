"""Optimizers as tf.Modules whose slot variables are checkpointed with the model.

An optimizer is configured by Params, creates its slots once for a list of
variables (`CreateSlots`, eagerly, before the training step is traced) and then
applies updates inside the step (`Apply`), each computed once, saying whether
every new weight and slot is finite. Each slot lives on its variable's
device, so a pipeline stage's optimizer state stays with that stage. Slots are
keyed by variable name, so checkpoints read the same whatever the order in which
variables are listed.
"""

import math

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils

# Intervals a param may lie in: (low, low open, high, high open).
_DECAY = (0.0, False, 1.0, True)  # [0, 1)
_POSITIVE = (0.0, True, math.inf, True)  # (0, inf)
_NON_NEGATIVE = (0.0, False, math.inf, True)  # [0, inf)


def _SlotKey(var):
  return var.name[:-2] if var.name.endswith(':0') else var.name


def _Rms(x):
  return tf.sqrt(tf.reduce_mean(tf.square(x)))


class BaseOptimizer(tf.Module):
  """Base class: slot bookkeeping, the update counter, per-variable updates."""

  # {param name: the interval (_DECAY ...) its value must lie in}, checked when built.
  INTERVALS = {}

  @classmethod
  def Params(cls):
    return hyperparams.InstantiableParams(cls)

  def __init__(self, params):
    super().__init__(name=type(self).__name__)
    for name, interval in self.INTERVALS.items():
      py_utils.CheckInterval(type(self).__name__, name, params.Get(name), interval)
    self._params = params.Copy().Freeze()
    self.iterations = tf.Variable(0, dtype=tf.int64, trainable=False, name='iterations')
    self._slots = {}

  @property
  def params(self):
    return self._params

  def CreateSlots(self, variables):
    """Creates the slots of `variables` (once each), on their devices."""
    for var in variables:
      key = _SlotKey(var)
      if key in self._slots:
        continue
      with tf.device(var.device):
        self._slots[key] = {
            name: tf.Variable(value, trainable=False, name=f'{key}/{name}')
            for name, value in self._SlotInitialValues(var).items()}

  def Slots(self, var):
    """The slot variables of `var`, by slot name."""
    key = _SlotKey(var)
    if key not in self._slots:
      raise KeyError(f'{type(self).__name__} has no slots for variable {key!r}: '
                     'call CreateSlots with it before Apply.')
    return self._slots[key]

  def Apply(self, learning_rate, grads_and_vars):
    """Updates the variables and slots; each new value is computed once.

    Nothing here waits for every device: each variable's update runs on its own
    device, and the one global value is the returned check. The caller (the
    Learner) applies only finite gradients and learning rates, and stops before
    saving a step whose update this reports as not finite (an overflow).

    Returns:
      A bool scalar tensor: whether every new value is finite.
    """
    finite = []
    for target, value in self._NewValues(learning_rate, grads_and_vars):
      target.assign(value)
      with tf.device(target.device):
        finite.append(tf.reduce_all(tf.math.is_finite(value)))
    self.iterations.assign_add(1)
    return tf.reduce_all(finite)

  def _NewValues(self, learning_rate, grads_and_vars):
    """[(variable or slot, its value after this update)] of every variable."""
    t = tf.cast(self.iterations + 1, tf.float32)
    values = []
    for grad, var in grads_and_vars:
      with tf.device(var.device):
        values += self._NewValuesOne(tf.cast(learning_rate, var.dtype), tf.cast(grad, var.dtype),
                                     var, self.Slots(var), tf.cast(t, var.dtype))
    return values

  def _SlotInitialValues(self, var):
    """Slot name -> initial value, for one variable."""
    del var  # Unused: no slots by default.
    return {}

  def _NewValuesOne(self, lr, grad, var, slots, t):
    """[(var or one of its slots, new value)]; t is the 1-based number of this update."""
    raise NotImplementedError(f'{type(self).__name__}._NewValuesOne')


class SGD(BaseOptimizer):
  """var -= lr * grad."""

  def _NewValuesOne(self, lr, grad, var, slots, t):
    return [(var, var - lr * grad)]


class Momentum(BaseOptimizer):
  """Heavy-ball momentum: m = momentum * m + grad; var -= lr * m.

  With use_nesterov, var -= lr * (grad + momentum * m) instead.
  """

  INTERVALS = {'momentum': _DECAY}

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('momentum', 0.9, 'Decay of the accumulated gradient.')
    p.Define('use_nesterov', False, 'Nesterov momentum.')
    return p

  def _SlotInitialValues(self, var):
    return {'m': tf.zeros(var.shape, var.dtype)}

  def _NewValuesOne(self, lr, grad, var, slots, t):
    mu = self.params.momentum
    m = mu * slots['m'] + grad
    return [(slots['m'], m), (var, var - lr * (grad + mu * m if self.params.use_nesterov else m))]


class Adam(BaseOptimizer):
  """Adam (Kingma & Ba), bias correction folded into the step size.

  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;
  var -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon).
  """

  INTERVALS = {'beta1': _DECAY, 'beta2': _DECAY, 'epsilon': _POSITIVE}

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('beta1', 0.9, 'Decay of the first moment.')
    p.Define('beta2', 0.999, 'Decay of the second moment.')
    p.Define('epsilon', 1e-8, 'Added to sqrt(v) so small moments do not divide by 0.')
    return p

  def _SlotInitialValues(self, var):
    return {'m': tf.zeros(var.shape, var.dtype), 'v': tf.zeros(var.shape, var.dtype)}

  def _NewValuesOne(self, lr, grad, var, slots, t):
    p = self.params
    m = p.beta1 * slots['m'] + (1 - p.beta1) * grad
    v = p.beta2 * slots['v'] + (1 - p.beta2) * tf.square(grad)
    step_size = lr * tf.sqrt(1 - p.beta2 ** t) / (1 - p.beta1 ** t)
    return [(slots['m'], m), (slots['v'], v), (var, var - step_size * m / (tf.sqrt(v) + p.epsilon))]


class Adafactor(BaseOptimizer):
  """Adafactor (Shazeer & Stern 2018): factored second moments, update clipping.

  For a matrix (last two dims both >= min_dim_size_to_factor) only row and
  column means of g^2 are kept, so the optimizer state is O(rows + cols):
    b2_t = 1 - t^-decay_exponent;  r = b2_t r + (1 - b2_t) mean_col(g^2 + eps1);
    c = b2_t c + (1 - b2_t) mean_row(g^2 + eps1);  v ~ r c^T / mean(r);
  other variables keep the full v. Then
    u = g / sqrt(v);  u /= max(1, rms(u) / clipping_threshold);
    optionally m = beta1 m + (1 - beta1) u, u = m;
    var -= lr * max(eps2, rms(var)) * u   (the max(...) only with multiply_by_parameter_scale).
  """

  INTERVALS = {'beta1': _DECAY, 'decay_exponent': _POSITIVE,
               'clipping_threshold': _NON_NEGATIVE, 'epsilon1': _POSITIVE,
               'epsilon2': _NON_NEGATIVE}

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('beta1', 0.0, 'Momentum of the update; 0 keeps no first moment.')
    p.Define('decay_exponent', 0.8, 'Second-moment decay is 1 - t ** -decay_exponent.')
    p.Define('clipping_threshold', 1.0, 'Scale updates whose RMS exceeds this; 0 disables.')
    p.Define('multiply_by_parameter_scale', True,
             'Scale the step by the RMS of the variable (at least epsilon2).')
    p.Define('factored', True, 'Factor the second moment of large enough matrices.')
    p.Define('min_dim_size_to_factor', 128, 'Factor only if both last dims are at least this.')
    p.Define('epsilon1', 1e-30, 'Added to g^2.')
    p.Define('epsilon2', 1e-3, 'Lower bound of the parameter scale.')
    return p

  def _IsFactored(self, var):
    p = self.params
    return (p.factored and var.shape.rank >= 2 and
            min(var.shape[-2:]) >= p.min_dim_size_to_factor)

  def _SlotInitialValues(self, var):
    shape = var.shape.as_list()
    if self._IsFactored(var):
      slots = {'vr': tf.zeros(shape[:-1], var.dtype),
               'vc': tf.zeros(shape[:-2] + shape[-1:], var.dtype)}
    else:
      slots = {'v': tf.zeros(shape, var.dtype)}
    if self.params.beta1 > 0:
      slots['m'] = tf.zeros(shape, var.dtype)
    return slots

  def _NewValuesOne(self, lr, grad, var, slots, t):
    p = self.params
    decay = 1 - t ** -p.decay_exponent
    grad_sq = tf.square(grad) + p.epsilon1
    if 'v' in slots:
      v = decay * slots['v'] + (1 - decay) * grad_sq
      new = [(slots['v'], v)]
      update = grad * tf.math.rsqrt(v)
    else:
      vr = decay * slots['vr'] + (1 - decay) * tf.reduce_mean(grad_sq, -1)
      vc = decay * slots['vc'] + (1 - decay) * tf.reduce_mean(grad_sq, -2)
      new = [(slots['vr'], vr), (slots['vc'], vc)]
      row_factor = tf.math.rsqrt(vr / tf.reduce_mean(vr, -1, keepdims=True))
      update = grad * row_factor[..., tf.newaxis] * tf.math.rsqrt(vc)[..., tf.newaxis, :]
    if p.clipping_threshold > 0:
      update /= tf.maximum(1.0, _Rms(update) / p.clipping_threshold)
    if p.multiply_by_parameter_scale:
      lr *= tf.maximum(tf.cast(p.epsilon2, var.dtype), _Rms(var))
    if 'm' in slots:
      update = p.beta1 * slots['m'] + (1 - p.beta1) * update
      new.append((slots['m'], update))
    return new + [(var, var - lr * update)]
