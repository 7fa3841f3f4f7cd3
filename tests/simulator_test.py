"""Tests of lingvo_gpipe.core.simulator against schedule.Simulate and closed forms."""

import itertools
import time

import numpy as np
import pytest

from lingvo_gpipe.core import schedule
from lingvo_gpipe.core import simulator

F, B = schedule.FORWARD, schedule.BACKWARD


def _Reference(orders, forward, backward):
  """schedule.Simulate with [K, M] cost arrays, as (start, end) [2, K, M] arrays."""
  times = schedule.Simulate(orders, lambda k, m: forward[k, m], lambda k, m: backward[k, m])
  start, end = np.full((2,) + forward.shape, np.nan), np.full((2,) + forward.shape, np.nan)
  for ((m, kind), k), (s, e) in times.items():
    start[int(kind == B), k, m], end[int(kind == B), k, m] = s, e
  return start, end


@pytest.mark.parametrize('k,m', list(itertools.product([1, 2, 3, 5], [1, 2, 3, 7])))
@pytest.mark.parametrize('name', schedule.SCHEDULE_NAMES)
def testEveryStepEqualsScheduleSimulate(name, k, m):
  rng = np.random.default_rng(k * 100 + m)
  forward, backward = rng.uniform(0.1, 2.0, (k, m)), rng.uniform(0.1, 3.0, (k, m))
  orders = schedule.Schedule(name, k, m).orders
  ref_start, ref_end = _Reference(orders, forward, backward)
  for given in (orders, simulator.Orders(name, k, m)):
    got = simulator.Simulate(given, forward, backward)
    np.testing.assert_allclose(got.start, ref_start, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(got.end, ref_end, rtol=1e-12, atol=1e-12)
  busy = forward.sum(axis=1) + backward.sum(axis=1)
  np.testing.assert_allclose(got.busy, busy)
  assert got.step_time == pytest.approx(np.nanmax(ref_end))
  assert got.bubble_fraction == pytest.approx(1 - busy.sum() / (k * np.nanmax(ref_end)))


@pytest.mark.parametrize('k,m', [(1, 1), (2, 3), (4, 4), (4, 16), (8, 5)])
@pytest.mark.parametrize('name', schedule.SCHEDULE_NAMES)
def testUnitCostsGiveTheoreticalBubbleAndInFlight(name, k, m):
  sched = schedule.Schedule(name, k, m)
  got = simulator.Simulate(simulator.Orders(name, k, m))
  assert got.step_time == sched.num_clocks
  assert got.bubble_fraction == pytest.approx(sched.BubbleFraction())
  assert got.bubble_fraction == pytest.approx(schedule.TheoreticalBubble(k, m))
  assert got.max_in_flight.tolist() == [sched.MaxInFlight(s) for s in range(k)]


def testFillDrainMakespanIsTheFlowShopClosedForm():
  """Identical jobs through stages: sum of stage times + (M - 1) x the bottleneck, per phase."""
  rng = np.random.default_rng(7)
  k, m = 6, 11
  forward, backward = rng.uniform(0.5, 2.0, k), rng.uniform(1.0, 4.0, k)
  got = simulator.Simulate(simulator.Orders('gpipe', k, m), forward, backward)
  expected = forward.sum() + (m - 1) * forward.max() + backward.sum() + (m - 1) * backward.max()
  assert got.step_time == pytest.approx(expected)


def testHandComputedTimelineWithTransfers():
  # K=2, M=2 fill-drain, F=1, B=2, hand-over 0.5 between the stages:
  # stage 0: F0 0-1, F1 1-2, B1 6-8, B0 8-10;
  # stage 1: F0 1.5-2.5, F1 2.5-3.5, B1 3.5-5.5, B0 5.5-7.5.
  got = simulator.Simulate(simulator.Orders('gpipe', 2, 2), 1.0, 2.0, transfer_cost=0.5)
  np.testing.assert_allclose(got.start[0], [[0, 1], [1.5, 2.5]])
  np.testing.assert_allclose(got.start[1], [[8, 6], [5.5, 3.5]])
  np.testing.assert_allclose(got.end[1], [[10, 8], [7.5, 5.5]])
  assert got.step_time == 10.0
  np.testing.assert_allclose(got.busy, [6.0, 6.0])
  np.testing.assert_allclose(got.idle, [4.0, 4.0])
  assert got.bubble_fraction == pytest.approx(0.4)


def testPeakActivationMemory():
  got = simulator.Simulate(simulator.Orders('1f1b', 4, 8), activation_bytes=[10, 20, 30, 40],
                           step_bytes=5)
  np.testing.assert_array_equal(got.max_in_flight, [4, 3, 2, 1])
  np.testing.assert_allclose(got.peak_activation_bytes, [45, 65, 65, 45])
  fill_drain = simulator.Simulate(simulator.Orders('gpipe', 4, 8), activation_bytes=10)
  np.testing.assert_allclose(fill_drain.peak_activation_bytes, [80] * 4)


def testLargePipelineInSeconds():
  start = time.perf_counter()
  got = simulator.Simulate(simulator.Orders('gpipe', 256, 2048), 1.0, 2.0)
  assert time.perf_counter() - start < 20.0
  assert got.bubble_fraction == pytest.approx(schedule.TheoreticalBubble(256, 2048))


@pytest.mark.parametrize('kwargs,match', [
    (dict(forward_cost=[1.0, 2.0]), 'forward_cost has 2 per-stage values for 3 stages'),
    (dict(backward_cost=np.ones((3, 2))), r'backward_cost has shape \(3, 2\); expected'),
    (dict(forward_cost=-1.0), 'forward_cost must be finite and non-negative, got -1.0'),
    (dict(transfer_cost=[1.0]), 'transfer_cost has 1 values for 2 stage boundaries'),
    (dict(activation_bytes=[1, 2]), 'activation_bytes must be a scalar or 3 per-stage values'),
])
def testBadCosts(kwargs, match):
  with pytest.raises(ValueError, match=match):
    simulator.Simulate(simulator.Orders('gpipe', 3, 4), **kwargs)


def testBadSchedulesAndDeadlock():
  with pytest.raises(ValueError, match="Unknown schedule 'zb'"):
    simulator.Orders('zb', 2, 2)
  with pytest.raises(ValueError, match='num_micro_batches must be a positive int, got 0'):
    simulator.Orders('gpipe', 2, 0)
  with pytest.raises(ValueError, match='deadlocks'):
    simulator.Simulate([[(0, F), (0, B), (1, F), (1, B)], [(0, F), (1, F), (1, B), (0, B)]])
