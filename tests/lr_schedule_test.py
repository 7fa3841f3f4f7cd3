"""Tests of lingvo_gpipe.training.lr_schedule against the schedules' formulas."""

import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.training import lr_schedule


def _Values(schedule, steps):
  return np.array([float(schedule.Value(tf.constant(s, tf.int64))) for s in steps])


def testConstantIsOneAtEveryStep():
  schedule = lr_schedule.Constant.Params().Instantiate()
  np.testing.assert_array_equal(_Values(schedule, [0, 1, 10**6]), [1.0, 1.0, 1.0])


def testWarmupRsqrtDecayFollowsFormulaAndPeaksAtOne():
  schedule = lr_schedule.LinearWarmupRsqrtDecay.Params().Set(warmup_steps=4).Instantiate()
  steps = list(range(12)) + [99, 9999]
  expected = [min((s + 1) / 4, math.sqrt(4 / (s + 1))) for s in steps]
  np.testing.assert_allclose(_Values(schedule, steps), expected, rtol=1e-6)
  assert _Values(schedule, [3])[0] == pytest.approx(1.0)
  assert _Values(schedule, [0])[0] == pytest.approx(0.25)  # Linear: 1/4 of the peak.


def testWarmupRsqrtDecayWithModelDimIsVaswaniSchedule():
  p = lr_schedule.LinearWarmupRsqrtDecay.Params().Set(warmup_steps=4000, model_dim=512)
  schedule = p.Instantiate()
  steps = [0, 999, 3999, 4000, 20000]
  expected = [512**-0.5 * min((s + 1)**-0.5, (s + 1) * 4000**-1.5) for s in steps]
  np.testing.assert_allclose(_Values(schedule, steps), expected, rtol=1e-5)


def testValueRunsInsideTfFunction():
  schedule = lr_schedule.LinearWarmupRsqrtDecay.Params().Set(warmup_steps=10).Instantiate()
  value = tf.function(schedule.Value)(tf.constant(39, tf.int64))
  assert float(value) == pytest.approx(0.5)


@pytest.mark.parametrize('field, value', [('warmup_steps', 0), ('warmup_steps', 2.5),
                                          ('model_dim', -1)])
def testBadParamsAreClearErrors(field, value):
  p = lr_schedule.LinearWarmupRsqrtDecay.Params().Set(**{field: value})
  with pytest.raises(ValueError, match=field):
    p.Instantiate()
