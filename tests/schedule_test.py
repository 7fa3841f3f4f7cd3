"""Tests of lingvo_gpipe.core.schedule."""

import itertools

import pytest

from lingvo_gpipe.core import schedule

F, B = schedule.FORWARD, schedule.BACKWARD
SIZES = list(itertools.product([1, 2, 3, 4, 8], [1, 2, 4, 5, 8, 32]))


def _CheckDependencies(sched):
  start = {(s.micro_batch, s.kind, s.stage): s.clock for s in sched.steps}
  for s in sched.steps:
    if s.kind == F and s.stage > 0:
      assert start[(s.micro_batch, F, s.stage - 1)] < s.clock
    if s.kind == B:
      assert start[(s.micro_batch, F, s.stage)] < s.clock
      if s.stage + 1 < sched.num_stages:
        assert start[(s.micro_batch, B, s.stage + 1)] < s.clock
  # A stage runs one step per clock.
  assert len({(s.stage, s.clock) for s in sched.steps}) == len(sched.steps)


@pytest.mark.parametrize('k,m', SIZES)
@pytest.mark.parametrize('name', schedule.SCHEDULE_NAMES)
def testEveryStepOnceAndDependenciesHold(name, k, m):
  sched = schedule.Schedule(name, k, m)
  assert sorted((s.stage, s.micro_batch, s.kind) for s in sched.steps) == sorted(
      itertools.product(range(k), range(m), [F, B]))
  _CheckDependencies(sched)
  assert sched.steps == sorted(sched.steps, key=lambda s: (s.clock, s.stage))


@pytest.mark.parametrize('k,m', SIZES)
def testFillDrainClocksAndBubble(k, m):
  sched = schedule.Schedule('gpipe', k, m)
  for s in sched.steps:
    if s.kind == F:
      assert s.clock == s.micro_batch + s.stage
    else:  # Backwards start after the last forward, last micro-batch first.
      assert s.clock == (m + k - 1) + (m - 1 - s.micro_batch) + (k - 1 - s.stage)
  assert sched.BubbleFraction() == pytest.approx(schedule.TheoreticalBubble(k, m))
  assert all(sched.MaxInFlight(stage) == m for stage in range(k))
  assert max(s.clock for s in sched.ForwardSteps()) < min(s.clock for s in sched.BackwardSteps())


@pytest.mark.parametrize('k,m', SIZES)
def testOneFOneBBoundsInFlightByStages(k, m):
  sched = schedule.Schedule('1f1b', k, m)
  for stage in range(k):
    assert sched.MaxInFlight(stage) == min(k - stage, m)
  # Same makespan as fill-drain with unit costs; the gain is memory.
  assert sched.num_clocks == schedule.Schedule('gpipe', k, m).num_clocks


def testStageOrderOfOneFOneB():
  steps = [(s.kind, s.micro_batch) for s in schedule.Schedule('1f1b', 3, 4).StageSteps(0)]
  assert steps == [(F, 0), (F, 1), (F, 2), (B, 0), (F, 3), (B, 1), (B, 2), (B, 3)]


def testPrintedGrid():
  text = str(schedule.Schedule('gpipe', 2, 2))
  assert text.splitlines() == [
      'gpipe schedule, K=2 stages, M=2 micro-batches, bubble 0.333',
      'stage0   F0 F1  .  . B1 B0',
      'stage1    . F0 F1 B1 B0  .',
  ]


@pytest.mark.parametrize('args,match', [
    (('zb', 2, 2), "Unknown schedule 'zb'"),
    (('gpipe', 0, 2), 'num_stages must be a positive int, got 0'),
    (('1f1b', 2, 1.5), 'num_micro_batches must be a positive int, got 1.5'),
])
def testBadArguments(args, match):
  with pytest.raises(ValueError, match=match):
    schedule.Schedule(*args)


def testSimulateWithCostsAndBadOrders():
  orders = schedule.FillDrainOrder(2, 2)
  times = schedule.Simulate(orders, forward_cost=1.0, backward_cost=2.0)
  assert times[((1, B), 1)] == (3.0, 5.0)
  assert times[((1, B), 0)] == (5.0, 7.0)
  assert times[((0, B), 0)] == (7.0, 9.0)
  with pytest.raises(ValueError, match='B0 comes before F0'):
    schedule.Simulate([[(0, B), (0, F)]])
  with pytest.raises(ValueError, match='deadlocks'):
    # Stage 0 waits for B1 from stage 1, which waits for stage 0's F1.
    schedule.Simulate([[(0, F), (0, B), (1, F), (1, B)], [(0, F), (1, F), (1, B), (0, B)]])
