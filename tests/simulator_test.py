"""Tests of lingvo_gpipe.insight.simulator (and so of pipeline/cost_model.Time) against an event
loop and closed forms."""

import itertools
import time

import numpy as np
import pytest

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline import schedule_actions

A = schedule_actions.Action
NAMED = [('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1), ('zb_h2', 1),
         ('zbv', 2)]


def _Reference(sched, costs, transfer):
  """Every action's (start, end) as [4, C, M] arrays (F, B, W, BW), from an event loop of its
  own: a device runs its next action once its device is free and F(m, c-1) (a forward) or
  the input gradient of chunk c+1 (B, BW) has ended, plus transfer[boundary] when that ran
  on another device; losses take no time."""
  code = {'F': 0, 'B': 1, 'W': 2, 'BW': 3}
  last = sched.num_chunks - 1
  start, end = np.full(costs.shape, np.nan), np.full(costs.shape, np.nan)
  ready = {}  # ('F' or 'G', m, c) -> when that forward or input gradient ended.
  free, position = [0.0] * sched.num_stages, [0] * sched.num_stages
  progress = True
  while progress:
    progress = False
    for k, order in enumerate(sched.orders):
      while position[k] < len(order):
        kind, m, c = order[position[k]]
        dep = None
        if kind == 'F' and c > 0:
          dep, boundary = ('F', m, c - 1), c - 1
        elif kind in ('B', 'BW') and c < last:
          dep, boundary = ('G', m, c + 1), c
        if dep is not None and dep not in ready:
          break
        arrival = 0.0 if dep is None else ready[dep] + (
            transfer[boundary] if sched.placement[dep[2]] != sched.placement[c] else 0.0)
        position[k] += 1
        progress = True
        if kind == 'L':
          continue
        i = code[kind]
        start[i, c, m] = max(free[k], arrival)
        end[i, c, m] = free[k] = start[i, c, m] + costs[i, c, m]
        if kind != 'W':
          ready[('F' if kind == 'F' else 'G', m, c)] = end[i, c, m]
  assert position == [len(order) for order in sched.orders], 'the reference deadlocked'
  return start, end


@pytest.mark.parametrize('k,m', list(itertools.product([1, 2, 3, 5], [1, 2, 3, 7])))
@pytest.mark.parametrize('name,v', NAMED)
def testEveryActionEqualsAnEventLoop(name, v, k, m):
  """With random costs per action kind, chunk and micro-batch and random hand-overs, every
  start and end equals an event loop's, action by action."""
  if name == 'interleaved_1f1b' and m > k and m % k:
    m = k  # Groups of K: the nearest size it runs.
  rng = np.random.default_rng(k * 100 + m)
  c = k * v
  forward, backward = rng.uniform(0.1, 2.0, (c, m)), rng.uniform(0.1, 3.0, (c, m))
  input_grad, weight_grad = rng.uniform(0.1, 2.0, (c, m)), rng.uniform(0.1, 1.0, (c, m))
  transfer = rng.uniform(0.0, 0.5, c - 1)
  sched = schedule.Schedule(name, k, m, v)
  costs = np.stack([forward, input_grad, weight_grad, backward])
  ref_start, ref_end = _Reference(sched, costs, transfer)
  got = simulator.Simulate(simulator.Orders(name, k, m, v), forward, backward, transfer,
                           input_grad_cost=input_grad, weight_grad_cost=weight_grad)
  np.testing.assert_allclose(got.start, ref_start, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(got.end, ref_end, rtol=1e-12, atol=1e-12)
  ran = ~np.isnan(ref_end)
  busy = np.bincount(sched.placement, np.where(ran, costs, 0.0).sum(axis=(0, 2)), minlength=k)
  np.testing.assert_allclose(got.busy, busy)
  assert got.step_time == pytest.approx(np.nanmax(ref_end))
  assert got.bubble_fraction == pytest.approx(1 - busy.sum() / (k * np.nanmax(ref_end)))


@pytest.mark.parametrize('k,m', [(1, 1), (2, 2), (4, 4), (4, 16), (8, 8)])
@pytest.mark.parametrize('name,v', NAMED)
def testUnitCostsGiveTheScheduleBubbleAndMemory(name, v, k, m):
  sched = schedule.Schedule(name, k, m, v)
  got = simulator.Simulate(simulator.Orders(name, k, m, v), 1.0, 2.0)
  assert got.step_time == sched.num_clocks
  assert got.bubble_fraction == pytest.approx(sched.BubbleFraction())
  assert got.max_in_flight.tolist() == [sched.MaxInFlight(s) for s in range(k)]
  assert got.max_pending_weight_grads.tolist() == [sched.MaxPendingWeightGrads(s)
                                                   for s in range(k)]


def testFillDrainMakespanIsTheFlowShopClosedForm():
  """Identical jobs through stages: sum of stage times + (M - 1) x the bottleneck, per phase."""
  rng = np.random.default_rng(7)
  k, m = 6, 11
  forward, backward = rng.uniform(0.5, 2.0, k), rng.uniform(1.0, 4.0, k)
  got = simulator.Simulate(simulator.Orders('gpipe', k, m), forward, backward)
  expected = forward.sum() + (m - 1) * forward.max() + backward.sum() + (m - 1) * backward.max()
  assert got.step_time == pytest.approx(expected)


def testHandComputedTimelineWithTransfers():
  # K=2, M=2 fill-drain, F=1, BW=2, hand-over 0.5 between the stages:
  # stage 0: F0 0-1, F1 1-2, BW1 6-8, BW0 8-10;
  # stage 1: F0 1.5-2.5, F1 2.5-3.5, BW1 3.5-5.5, BW0 5.5-7.5.
  got = simulator.Simulate(simulator.Orders('gpipe', 2, 2), 1.0, 2.0, transfer_cost=0.5)
  bw = simulator.BACKWARD
  np.testing.assert_allclose(got.start[simulator.FORWARD], [[0, 1], [1.5, 2.5]])
  np.testing.assert_allclose(got.start[bw], [[8, 6], [5.5, 3.5]])
  np.testing.assert_allclose(got.end[bw], [[10, 8], [7.5, 5.5]])
  assert np.isnan(got.end[simulator.INPUT_GRAD]).all()
  assert got.step_time == 10.0
  np.testing.assert_allclose(got.busy, [6.0, 6.0])
  np.testing.assert_allclose(got.idle, [4.0, 4.0])
  assert got.bubble_fraction == pytest.approx(0.4)


def testNoHandOverBetweenChunksOfOneDevice():
  """ZB-V's chunks K-1 and K share a device: the V's turn costs no transfer."""
  orders = simulator.Orders('zbv', 2, 1, 2)
  got = simulator.Simulate(orders, 1.0, 2.0, transfer_cost=[0.5, 0.5, 0.5])
  f = got.start[simulator.FORWARD, :, 0]
  np.testing.assert_allclose(f, [0, 1.5, 2.5, 4.0])  # Chunk 2 right after chunk 1.


def testPeakActivationMemory():
  got = simulator.Simulate(simulator.Orders('1f1b', 4, 8), activation_bytes=[10, 20, 30, 40],
                           step_bytes=5)
  np.testing.assert_array_equal(got.max_in_flight, [4, 3, 2, 1])
  np.testing.assert_allclose(got.peak_activation_bytes, [45, 65, 65, 45])
  fill_drain = simulator.Simulate(simulator.Orders('gpipe', 4, 8), activation_bytes=10)
  np.testing.assert_allclose(fill_drain.peak_activation_bytes, [80] * 4)


def _PeakWalk(order, activation_bytes, weight_grad_bytes):
  """The most a device's order holds at once, walked action by action."""
  held = pending = peak = 0
  for a in order:
    held += {'F': 1, 'B': -1, 'BW': -1}.get(a.kind, 0)
    pending += {'B': 1, 'W': -1}.get(a.kind, 0)
    peak = max(peak, held * activation_bytes + pending * weight_grad_bytes)
  return peak


@pytest.mark.parametrize('name,v', NAMED)
@pytest.mark.parametrize('m', [1, 3, 8, 32])
def testPeakActivationMemoryIsWhatIsHeldAtOnce(name, v, m):
  sched = schedule.Schedule(name, 4, m, v)
  got = simulator.Simulate(simulator.Orders(name, 4, m, v), activation_bytes=[10, 20, 30, 40],
                           weight_grad_bytes=[3, 5, 7, 9])
  want = [_PeakWalk(order, a, w) for order, a, w in zip(sched.orders, [10, 20, 30, 40],
                                                          [3, 5, 7, 9])]
  np.testing.assert_allclose(got.peak_activation_bytes, want)


def testZeroBubbleHeldAndPendingPeakApart():
  """ZB-H1 (K=4) holds at most 4 micro-batch chunks at once on every device, whatever M:
  device k holds up to K - k between F and B and up to k + 1 pending Ws, not both at once."""
  for m in (8, 16, 32, 64):
    got = simulator.Simulate(simulator.Orders('zb_h1', 4, m), activation_bytes=1,
                             weight_grad_bytes=1)
    assert got.max_in_flight.tolist() == [4, 3, 2, 1]
    assert got.max_pending_weight_grads.tolist() == [1, 2, 3, 4]
    assert got.peak_activation_bytes.tolist() == [4, 4, 4, 4]


def testLargePipelineInSeconds():
  start = time.perf_counter()
  got = simulator.Simulate(simulator.Orders('gpipe', 128, 1024), 1.0, 2.0)
  assert time.perf_counter() - start < 30.0
  assert got.bubble_fraction == pytest.approx(schedule.TheoreticalBubble(128, 1024))


@pytest.mark.parametrize('kwargs,match', [
    (dict(forward_cost=[1.0, 2.0]), 'forward_cost has 2 per-chunk values for 3 chunks'),
    (dict(backward_cost=np.ones((3, 2))), r'backward_cost has shape \(3, 2\); expected'),
    (dict(forward_cost=-1.0), 'forward_cost must be finite and non-negative, got -1.0'),
    (dict(input_grad_cost=np.inf), 'input_grad_cost must be finite'),
    (dict(transfer_cost=[1.0]), 'transfer_cost has 1 values for 2 chunk boundaries'),
    (dict(activation_bytes=[1, 2]), 'activation_bytes must be a scalar or 3 per-device values'),
])
def testBadCosts(kwargs, match):
  with pytest.raises(ValueError, match=match):
    simulator.Simulate(simulator.Orders('gpipe', 3, 4), **kwargs)


def testBadSchedulesAndDeadlock():
  with pytest.raises(ValueError, match="Unknown schedule 'zb'"):
    simulator.Orders('zb', 2, 2)
  with pytest.raises(ValueError, match='num_micro_batches must be a positive int, got 0'):
    simulator.Orders('gpipe', 2, 0)
  with pytest.raises(ValueError, match="'zbv' runs 2 chunk"):
    simulator.Orders('zbv', 2, 2)
  orders = cost_model.ToArrays([[A('F', 0, 0), A('BW', 0, 0), A('F', 1, 0), A('BW', 1, 0)],
                               [A('F', 0, 1), A('F', 1, 1), A('BW', 1, 1), A('BW', 0, 1)]])
  with pytest.raises(ValueError, match='deadlock'):
    simulator.Simulate(orders)
