"""Dynamic loss scaling, so that float16 gradients neither underflow nor stay lost.

float16 holds magnitudes from about 6e-8 to 65504. A backward in float16 loses the
small gradients of a deep stack to zero unless the loss is scaled up first. The
scale is dynamic: a step whose gradients are not finite (they overflowed float16 at
this scale) is skipped and the scale divided by `factor`; after `growth_interval`
finite steps in a row it is multiplied by `factor`. A skipped step is not a failure,
unless it happens at `min_scale`: gradients that are not finite at the smallest
scale are not an overflow, and the Learner's guard stops training on them.

How the scale reaches the backward: the Learner puts it into the FProp context
(py_utils.FPropContext.loss_scale); BaseTask.ForwardBackward and a pipeline's
ForwardBackward differentiate scale * loss and divide their gradients by it again,
so the gradients they return are unscaled, and a ForwardBackward of one's own that
does not read the scale just gets none.
"""

import math

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils

MODES = ('auto', 'dynamic', 'none')


def Params() -> hyperparams.InstantiableParams:
  """How a task's loss is scaled (TrainParams.loss_scale)."""
  p = hyperparams.InstantiableParams(DynamicLossScale)
  p.Define('mode', 'auto',
           "'auto': 'dynamic' when any layer of the task computes in float16 (its "
           "fprop_dtype), else 'none'; 'dynamic'; 'none' (no scaling: float32, bfloat16).")
  p.Define('initial_scale', 2.0 ** 15, 'The scale of the first step.')
  p.Define('growth_interval', 2000,
           'Finite steps in a row after which the scale is multiplied by factor.')
  p.Define('factor', 2.0, 'What the scale is divided by on an overflow and multiplied by '
           'on growth (> 1).')
  p.Define('min_scale', 1.0,
           'The smallest scale: gradients that are not finite at it stop training.')
  return p


def CheckParams(where: str, p: hyperparams.Params) -> None:
  """Raises a ValueError naming a loss-scale value no run can use."""
  if p.mode not in MODES:
    raise ValueError(f'{where}.mode={p.mode!r}: expected one of {", ".join(MODES)}.')
  for key, low in (('initial_scale', 0.0), ('min_scale', 0.0), ('factor', 1.0)):
    py_utils.CheckInterval(where, key, p.Get(key), (low, True, math.inf, True))
  if p.min_scale > p.initial_scale:
    raise ValueError(f'{where}.min_scale={p.min_scale!r} is above initial_scale='
                     f'{p.initial_scale!r}.')
  interval = p.growth_interval
  if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
    raise ValueError(f'{where}.growth_interval={interval!r}: expected an integer >= 1.')


def ComputesInFloat16(layer: tf.Module) -> bool:
  """Whether `layer` or any layer below it computes in float16 (its fprop_dtype)."""
  layers = [layer] + list(layer.submodules)
  return any(tf.as_dtype(getattr(l, 'fprop_dtype', None) or tf.float32) == tf.float16
             for l in layers if hasattr(l, 'fprop_dtype'))


def Resolved(p: hyperparams.Params, layer: tf.Module) -> hyperparams.Params:
  """Loss-scale params `p` with mode 'auto' decided for task `layer`."""
  if p.mode != 'auto':
    return p
  return p.Copy().Set(mode='dynamic' if ComputesInFloat16(layer) else 'none')


class DynamicLossScale(tf.Module):
  """The scale and its counters: tf.Variables, saved in checkpoints with the optimizer."""

  def __init__(self, params: hyperparams.Params):
    super().__init__(name='loss_scale')
    CheckParams('loss_scale', params)
    self.params = params.Copy().Freeze()
    self.scale = tf.Variable(float(params.initial_scale), dtype=tf.float32, trainable=False,
                             name='scale')
    self.good_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name='good_steps')
    self.skipped_steps = tf.Variable(0, dtype=tf.int64, trainable=False, name='skipped_steps')

  def Update(self, grads_finite: tf.Tensor) -> tf.Tensor:
    """Adjusts the scale after a step whose loss was finite; returns whether the step is a
    skip (its gradients overflowed, and the scale was above min_scale)."""
    p = self.params
    scale = self.scale.read_value()
    skip = ~grads_finite & (scale > p.min_scale)
    grow = grads_finite & (self.good_steps + 1 >= p.growth_interval)
    new_scale = tf.where(skip, tf.maximum(scale / p.factor, p.min_scale),
                         tf.where(grow, scale * p.factor, scale))
    self.scale.assign(new_scale)
    self.good_steps.assign(tf.where(grads_finite & ~grow, self.good_steps + 1, 0))
    self.skipped_steps.assign_add(tf.cast(skip, tf.int64))
    return skip
