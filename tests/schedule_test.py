"""Tests of lingvo_gpipe.pipeline.schedule, schedule_actions and named_schedules: the action IR,
its checker and the named schedules."""

import itertools

import pytest

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import program
from lingvo_gpipe.pipeline import schedule
from lingvo_gpipe.pipeline import schedule_actions

A = schedule_actions.Action
F, B, W, BW, L = 'F', 'B', 'W', 'BW', 'L'
ALL = schedule_actions.ALL
UNIT = {F: 1, B: 1, W: 1, BW: 2, L: 0}  # The printed run's durations.
# Each named schedule with the chunks per device it runs in these tests.
NAMED = [('gpipe', 1), ('1f1b', 1), ('interleaved_1f1b', 2), ('interleaved_1f1b', 3),
         ('zb_h1', 1), ('zb_h2', 1), ('zbv', 2)]


def _Runs(name, k, m, v):
  """Whether Schedule(name, k, m, v) is a configuration the schedule supports."""
  return not (name == 'interleaved_1f1b' and m > k and m % k)


def _CheckRun(sched):
  """An independent check of the printed run: every action once, on its chunk's device, one
  unit action per device per clock, each after what it needs has ended."""
  ends, busy = {}, set()
  for s in sched.steps:
    a = s.action
    assert s.stage == sched.placement[a.chunk]
    cost = UNIT[a.kind]
    for t in range(s.clock, s.clock + cost):
      assert (s.stage, t) not in busy, s
      busy.add((s.stage, t))
    keys = [(B, a.micro_batch, a.chunk), (W, a.micro_batch, a.chunk)] if a.kind == BW else [
        (a.kind, a.micro_batch, a.chunk)]
    for key in keys:
      assert key not in ends, s
      ends[key] = s.clock + cost
  last, m_all = sched.num_chunks - 1, range(sched.num_micro_batches)
  for s in sched.steps:
    kind, m, c = s.action
    needs = []
    if kind == F and c > 0:
      needs = [(F, m, c - 1)]
    elif kind == L:
      needs = [(F, i, c) for i in (m_all if m == ALL else [m])]
    elif kind in (B, BW):
      loss = (L, ALL, last) if (L, ALL, last) in ends else (L, m, last)
      needs = [(F, m, c), loss if c == last else (B, m, c + 1)]
    elif kind == W:
      needs = [(B, m, c)]
    assert all(ends[n] <= s.clock for n in needs), (s, needs)
  expected = {(kind, m, c) for kind in (F, B, W) for m in m_all for c in range(last + 1)}
  assert expected <= set(ends)


@pytest.mark.parametrize('name,v', NAMED)
def testEveryConfigurationUpToEightDevicesAnd64MicroBatchesIsCheckedAndRuns(name, v):
  """K <= 8, M <= 64, M < K included: the constructor's checker and unit-time run accept
  every order; a sample is also checked independently."""
  for k, m in itertools.product(range(1, 9), range(1, 65)):
    if not _Runs(name, k, m, v):
      with pytest.raises(ValueError, match='must be at most K or a multiple of K'):
        schedule.Schedule(name, k, m, v)
      continue
    sched = schedule.Schedule(name, k, m, v)
    assert len(sched.orders) == k and sched.num_chunks == k * v
    if m <= 9 or m % 16 == 0:
      _CheckRun(sched)


@pytest.mark.parametrize('k,m', [(1, 1), (2, 2), (4, 2), (4, 8), (8, 3)])
def testFillDrainClocksAndBubble(k, m):
  sched = schedule.Schedule('gpipe', k, m)
  for s in sched.steps:
    kind, mb, c = s.action
    if kind == F:
      assert s.clock == mb + c
    elif kind == BW:  # After every forward and the whole batch's loss, last micro-batch first.
      assert s.clock == (m + k - 1) + 2 * (m - 1 - mb) + 2 * (k - 1 - c)
  assert sched.whole_batch_loss
  assert sched.BubbleFraction() == pytest.approx(schedule.TheoreticalBubble(k, m))
  assert all(sched.MaxInFlight(stage) == m for stage in range(k))


@pytest.mark.parametrize('k,m', [(1, 1), (2, 5), (4, 2), (4, 8), (4, 32), (8, 16)])
def testOneFOneBMatchesFillDrainTimeWithMemoryBoundedByStages(k, m):
  sched = schedule.Schedule('1f1b', k, m)
  assert not sched.whole_batch_loss
  assert [sched.MaxInFlight(s) for s in range(k)] == [min(k - s, m) for s in range(k)]
  assert sched.num_clocks == schedule.Schedule('gpipe', k, m).num_clocks


def testOrderOfOneFOneB():
  assert schedule.Schedule('1f1b', 3, 4).orders[0] == [
      A(F, 0, 0), A(F, 1, 0), A(F, 2, 0), A(BW, 0, 0), A(F, 3, 0), A(BW, 1, 0), A(BW, 2, 0),
      A(BW, 3, 0)]
  # The loss of a micro-batch follows its forward on the last device.
  assert schedule.Schedule('1f1b', 2, 2).orders[1][:3] == [A(F, 0, 1), A(L, 0, 1), A(BW, 0, 1)]


def testBubblesAtFourDevicesAndEightMicroBatches():
  """The unit-cost bubbles (F, B, W one unit each) the issue compares with theory."""
  bubble = {(n, v): schedule.Schedule(n, 4, 8, v).BubbleFraction() for n, v in NAMED}
  assert bubble[('gpipe', 1)] == pytest.approx(9 / 33)  # (K-1) x 3 of 3M + 3(K-1) units.
  assert bubble[('1f1b', 1)] == pytest.approx(9 / 33)
  assert bubble[('interleaved_1f1b', 2)] == pytest.approx(9 / 57)  # (K-1) x 3 / v idle.
  # Zero bubble within one step: devices idle only while the first forward reaches them and
  # while the last backward leaves, (K-1) units of 3M + K-1; ZB-V halves the unit.
  assert bubble[('zb_h1', 1)] == pytest.approx(3 / 27)
  assert bubble[('zb_h2', 1)] == pytest.approx(3 / 27)
  assert bubble[('zbv', 2)] == pytest.approx(3 / 51)


@pytest.mark.parametrize('k', [2, 3, 4, 8])
def testZeroBubbleReachesTheOneStepBoundFromMEqualsK(k):
  for m in range(k, 65, 3):
    bound = (k - 1) / (3 * m + k - 1)  # No v=1 order can start device k-1 before k-1 units.
    assert schedule.Schedule('zb_h1', k, m).BubbleFraction() == pytest.approx(bound)
    assert schedule.Schedule('zb_h2', k, m).BubbleFraction() == pytest.approx(bound)
    zbv = schedule.Schedule('zbv', k, m, 2).BubbleFraction()
    assert zbv >= (k - 1) / (6 * m + k - 1) - 1e-9  # ZB-V's bound: half-size units.
    if m % k == 0:
      assert zbv < bound


@pytest.mark.parametrize('k', range(2, 9))
def testZbvReachesItsBoundFromMEqualsK(k):
  """(K-1) / (6M + K-1) in half-size units: device K-1 cannot start before K-1 of them. A
  greedy run that always took a ready B before a ready F left more idle in 57 of these
  (e.g. K=6, M=15: 3 units, K=8, M=20: 5), since a device ran its B or, at its cap of
  pending Ws, a W while the next device waited for its F."""
  for m in range(k, 65):
    zbv = schedule.Schedule('zbv', k, m, 2)
    assert zbv.BubbleFraction() == pytest.approx((k - 1) / (6 * m + k - 1)), m
    for stage in range(k):
      assert zbv.MaxInFlight(stage) <= 2 * k  # Still 1F1B's first device's activations.
      assert zbv.MaxPendingWeightGrads(stage) <= 4 * k


@pytest.mark.parametrize('k, m', [(3, 4), (5, 7), (6, 8), (7, 9), (7, 10), (8, 11)])
def testZbvKeepsTheFewestPendingWeightGradsOfTheRunsThatReachItsBound(k, m):
  """Here forwards first reaches the bound at a lower cap than input gradients first, with more
  pending Ws (K=6, M=8: 16 against 12); the order kept holds 2K, as input gradients first."""
  zbv = schedule.Schedule('zbv', k, m, 2)
  assert zbv.BubbleFraction() == pytest.approx((k - 1) / (6 * m + k - 1))
  assert max(zbv.MaxPendingWeightGrads(stage) for stage in range(k)) == 2 * k


@pytest.mark.parametrize('k', [2, 4, 8])
def testMemoryOfEachScheduleIsFlatInMicroBatches(k):
  """Activations held (forward to input gradient) and pending Ws per device, M = 8..64."""
  for m in (8, 16, 32, 64):
    for stage in range(k):
      one_f_one_b = min(k - stage, m)
      assert schedule.Schedule('1f1b', k, m).MaxInFlight(stage) == one_f_one_b
      zb_h1 = schedule.Schedule('zb_h1', k, m)
      assert zb_h1.MaxInFlight(stage) == one_f_one_b
      assert zb_h1.MaxPendingWeightGrads(stage) == stage + 1
      zb_h2 = schedule.Schedule('zb_h2', k, m)
      assert zb_h2.MaxInFlight(stage) == min(2 * (k - stage) - 1, m)
      assert zb_h2.MaxPendingWeightGrads(stage) <= 2 * stage + 1
      zbv = schedule.Schedule('zbv', k, m, 2)  # Half-size chunks: 2K is 1F1B's first device.
      assert zbv.MaxInFlight(stage) <= 2 * k and zbv.MaxPendingWeightGrads(stage) <= 3 * k
      assert schedule.Schedule('gpipe', k, m).MaxInFlight(stage) == m


@pytest.mark.parametrize('k', range(1, 9))
def testZeroBubbleHoldsTheGivenMicroBatchesBetweenForwardAndWeightGradient(k):
  """ZB-H1's memory is 1F1B's first device's on every device, ZB-H2's the paper's 2K - 1 at
  most, for every M (M < K too); both reach ZB-H1's unit-cost bubble (from M = K, the least)."""
  for m in range(1, 65):
    held, pending = simulator.Orders('zb_h1', k, m).HeldCounts()
    assert (held + pending).max() == min(k, m), (k, m)
    held, pending = simulator.Orders('zb_h2', k, m).HeldCounts()
    assert (held + pending).max() <= min(2 * k - 1, m), (k, m)
    assert schedule.Schedule('zb_h2', k, m).BubbleFraction() <= schedule.Schedule(
        'zb_h1', k, m).BubbleFraction() + 1e-9, (k, m)


@pytest.mark.parametrize('k,m', [(2, 8), (4, 8), (4, 16), (8, 32)])
def testZbH2FillsWhatUnevenCostsLeaveToZbH1(k, m):
  """W cheaper than B and hand-overs that take time open bubbles that ZB-H2's extra warm-up
  forwards and later Ws fill (unit costs cannot show it: both reach the bound there)."""
  def Bubble(name):
    return simulator.Simulate(simulator.Orders(name, k, m), forward_cost=1.0, backward_cost=2.0,
                              input_grad_cost=1.2, weight_grad_cost=0.8,
                              transfer_cost=0.2).bubble_fraction
  assert Bubble('zb_h2') < 0.8 * Bubble('zb_h1') < 0.8 * Bubble('1f1b')


def testPlacements():
  assert schedule.Schedule('interleaved_1f1b', 2, 4, 3).placement == [0, 1, 0, 1, 0, 1]
  assert schedule.Schedule('zbv', 3, 4, 2).placement == [0, 1, 2, 2, 1, 0]
  assert schedule.Schedule('zb_h1', 3, 4).placement == [0, 1, 2]


def testPrintedGrid():
  assert str(schedule.Schedule('gpipe', 2, 2)).splitlines() == [
      'gpipe schedule, K=2 devices, M=2 micro-batches, bubble 0.333',
      'stage0    F0  F1   .   .   . BW1 BW1 BW0 BW0',
      'stage1     .  F0  F1 BW1 BW1 BW0 BW0   .   .',
  ]
  # 1F1B's order, each BW split, device k running W(m - k) after B(m).
  assert str(schedule.Schedule('zb_h1', 2, 3)).splitlines()[1:] == [
      'stage0   F0 F1  . B0 W0 F2 B1 W1 B2 W2',
      'stage1    . F0 B0 F1 B1 W0 F2 B2 W1 W2',
  ]
  # Device k: 2(K-k)-2 warm-up forwards, W(m - 2k) after B(m) (fewer with M < 3K - 3).
  assert str(schedule.Schedule('zb_h2', 2, 4)).splitlines()[1:] == [
      'stage0   F0 F1 F2 B0 W0 F3 B1 W1 B2 W2 B3 W3  .',
      'stage1    . F0 B0 F1 B1 F2 B2 W0 F3 B3 W1 W2 W3',
  ]
  grid = str(schedule.Schedule('zbv', 2, 1, 2)).splitlines()
  assert grid[0].startswith('zbv schedule, K=2 devices, v=2, M=1 micro-batches')
  assert 'F0.0' in grid[1].split() and 'F0.3' in grid[1].split()  # Chunks named with v > 1.


@pytest.mark.parametrize('name,v', NAMED)
def testTextRoundTrip(name, v):
  sched = schedule.Schedule(name, 4, 4 if v < 3 else 4, v)
  again = schedule.Schedule.FromText(sched.ToText())
  assert (again.orders, again.placement, again.steps) == (sched.orders, sched.placement,
                                                          sched.steps)
  assert again.BubbleFraction() == sched.BubbleFraction()


def testAUsersOwnOrder():
  """Fill-drain's forwards, then per micro-batch losses and split backwards, written by hand."""
  text = '''schedule mine K=2 M=2 v=1
            device0: F0@0 F1@0 B0@0 B1@0 W0@0 W1@0
            device1: F0@1 L0@1 F1@1 L1@1 B0@1 W0@1 B1@1 W1@1'''
  sched = schedule.Schedule.FromText(text)
  assert sched.name == 'mine' and not sched.whole_batch_loss
  _CheckRun(sched)
  assert sched.num_clocks == 9
  assert sched.MaxPendingWeightGrads(0) == 2


@pytest.mark.parametrize('text,match', [
    ('device0: F0@0', "must start with 'schedule <name>"),
    ('schedule x K=1 M=1 v=1\ndevice0: F0@0 X0@0', "'X0@0' is not an action"),
    ('schedule x K=1 M=1 v=1\ndevice1: F0@0', "expected 'device0: ...'"),
    ('schedule x K=2 M=1 v=1\ndevice0: F0@0 L0@0 BW0@0\ndevice1:', 'chunk 1 of 2 has no actions'),
    ('schedule x K=3 M=1 v=1\ndevice0: F0@0 BW0@0\ndevice1: F0@1 L0@1 BW0@1',
     'K=3 devices in its first line, but 2 device lines follow'),
    ('schedule x K=1 M=0 v=1\ndevice0:', 'M=0 in its first line; expected at least 1'),
    # The header's K and v are what runs: a device idle, or with other than v chunks, is not.
    ('schedule x K=2 M=1 v=1\ndevice0: F0@0 F0@1 L0@1 BW0@1 BW0@0\ndevice1:',
     r'Schedule text: placement puts chunks \[0, 1\] on device 0; v=1 gives each of the K=2 '
     'devices 1'),
    ('schedule x K=2 M=1 v=2\ndevice0: F0@0 F0@1 F0@2 BW0@2 BW0@1 BW0@0\n'
     'device1: F0@3 L0@3 BW0@3', r'placement puts chunks \[0, 1, 2\] on device 0; v=2 gives'),
    # Refused before the checker lists the 60 billion actions such an M implies.
    ('schedule x K=1 M=20000000000 v=1\ndevice0: F0@0 L0@0 BW0@0',
     r'M=20000000000 micro-batches through K=1 x v=1 chunks need 20000000000 forwards; the '
     r'orders have 3 actions'),
])
def testBadText(text, match):
  with pytest.raises(ValueError, match=match):
    schedule.Schedule.FromText(text)


@pytest.mark.parametrize('orders,placement,m,match', [
    ([[A(BW, 0, 0), A(F, 0, 0), A(L, 0, 0)]], [0], 1, 'BW0@0 comes before F0@0'),
    ([[A(F, 0, 0), A(L, 0, 0), A(B, 0, 0), A(W, 0, 0), A(W, 0, 0)]], [0], 1, 'W0@0 runs twice'),
    ([[A(F, 0, 0), A(L, 0, 0), A(B, 0, 0)]], [0], 1, 'never run W0@0'),
    ([[A(F, 0, 0), A(L, 0, 0), A(W, 0, 0), A(B, 0, 0)]], [0], 1, 'W0@0 comes before B0@0'),
    ([[A(L, 0, 0), A(F, 0, 0), A(BW, 0, 0)]], [0], 1, 'L0@0 comes before F0@0'),
    ([[A(F, 0, 0), A(BW, 0, 0), A(L, 0, 0)]], [0], 1, 'BW0@0 comes before L0@0'),
    ([[A(F, 0, 0), A(L, ALL, 0), A(F, 1, 0), A(BW, 0, 0), A(BW, 1, 0)]], [0], 2,
     r'L\*@0 comes before F1@0'),
    ([[A(F, 0, 0), A(F, 0, 1)], []], [0, 1], 1, 'F0@1 belongs on device 1'),
    ([[A(F, 0, 0), A(L, 0, 0)], [A(F, 0, 1)]], [0, 1], 1, 'the loss belongs to the last chunk'),
    ([[A(F, 2, 0)]], [0], 2, 'F2@0 is not an action of 1 chunks and 2 micro-batches'),
    ([[A(F, 0, 0), A(L, ALL, 0), A(L, 0, 0), A(BW, 0, 0)]], [0], 1,
     r'The orders run L0@0 besides a whole-batch loss L\*@0: a schedule has either'),
])
def testCheckerRefusesBadOrders(orders, placement, m, match):
  with pytest.raises(ValueError, match=match):
    schedule.Schedule('mine', len(orders), m, orders=orders, placement=placement)


@pytest.mark.parametrize('kwargs,match', [
    # The name heads the text: with a space it would not read back.
    (dict(name='my order'), "one word .* got 'my order'"),
    (dict(name=''), "one word .* got ''"),
    (dict(placement=None), 'both orders .* and placement'),
    # Two chunks on two devices are v=1: v=2 printed a text that did not read back.
    (dict(virtual_stages=2), r'placement has 2 chunks; K=2 devices x v=2 chunks each need 4'),
    (dict(placement=[0, 0]), r'placement puts chunks \[0, 1\] on device 0; v=1 gives each'),
])
def testOwnOrdersAreCheckedBeforeTheyRun(kwargs, match):
  orders = [[A(F, 0, 0), A(BW, 0, 0)], [A(F, 0, 1), A(L, 0, 1), A(BW, 0, 1)]]
  args = dict(name='mine', num_stages=2, num_micro_batches=1, orders=orders, placement=[0, 1])
  args.update(kwargs)
  with pytest.raises(ValueError, match=match):
    schedule.Schedule(**args)
  good = schedule.Schedule('mine', 2, 1, orders=orders, placement=[0, 1])
  assert schedule.Schedule.FromText(good.ToText()).orders == good.orders


def testCheckerFindsADeadlock():
  # Device 0 waits for B1 from device 1, which waits for device 0's F1.
  orders = [[A(F, 0, 0), A(BW, 0, 0), A(F, 1, 0), A(BW, 1, 0)],
            [A(F, 0, 1), A(L, 0, 1), A(F, 1, 1), A(L, 1, 1), A(BW, 1, 1), A(BW, 0, 1)]]
  with pytest.raises(ValueError, match='deadlock'):
    schedule.Schedule('mine', 2, 2, orders=orders, placement=[0, 1])


def testTheProgramIsTimedWithMeasuredCosts():
  sched = schedule.Schedule('zb_h1', 2, 2)
  model = cost_model.CostModel.Of(2, 2, forward_cost=1.0, backward_cost=2.5, input_grad_cost=2.0,
                                  weight_grad_cost=0.5)
  start, end = program.Lower(sched).Time(model)
  f, b, w = cost_model.FORWARD, cost_model.INPUT_GRAD, cost_model.WEIGHT_GRAD
  assert (start[f, 1, 0], end[f, 1, 0]) == (1.0, 2.0)  # After F(0, 0) on the other device.
  assert (start[b, 1, 0], end[b, 1, 0]) == (2.0, 4.0)  # The loss costs nothing here.
  assert end[w, 1, 0] - start[w, 1, 0] == 0.5
  # B(0, 0) waits for B(0, 1): the input gradient crosses devices, W never does.
  assert start[b, 0, 0] >= end[b, 1, 0]


@pytest.mark.parametrize('args,match', [
    (('zb', 2, 2), "Unknown schedule 'zb'"),
    (('gpipe', 0, 2), 'num_stages must be a positive int, got 0'),
    (('1f1b', 2, 1.5), 'num_micro_batches must be a positive int, got 1.5'),
    (('zbv', 2, 2, 1), "'zbv' runs 2 chunk"),
    (('1f1b', 2, 2, 2), "'1f1b' runs 1 chunk"),
    (('interleaved_1f1b', 2, 2, 0), 'virtual_stages must be a positive int, got 0'),
    (('interleaved_1f1b', 4, 6, 2), r'num_micro_batches=6 must be at most K or a multiple of '
                                    r'K \(e.g. 4 or 8\)'),
])
def testBadArguments(args, match):
  with pytest.raises(ValueError, match=match):
    schedule.Schedule(*args)
  with pytest.raises(ValueError, match=match):  # What the simulator and planner call.
    named_schedules.Orders(*args)
