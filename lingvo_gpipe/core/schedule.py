"""Pipeline schedules as data: which stage runs which micro-batch's pass, and when.

A schedule is defined by the order in which each stage works through its steps
(forward F and backward B of each micro-batch). Clocks follow from that order and
the dependencies (F(m, k) after F(m, k-1); B(m, k) after B(m, k+1)) by simulating
unit-cost steps. The TensorFlow executor in gpipe.py runs exactly these steps, in
this order per stage, so the printed schedule is the one that runs.

No TensorFlow here: schedules are tested in milliseconds and shared by the
runtime, the simulator and the planner.
"""

import collections

FORWARD = 'F'
BACKWARD = 'B'

Step = collections.namedtuple('Step', ['clock', 'stage', 'micro_batch', 'kind'])
Step.__doc__ = 'One pass of one micro-batch through one stage, starting at `clock`.'


def FillDrainOrder(num_stages, num_micro_batches):
  """GPipe: every stage runs all forwards, then all backwards in reverse."""
  m = num_micro_batches
  order = [(i, FORWARD) for i in range(m)] + [(i, BACKWARD) for i in reversed(range(m))]
  return [list(order) for _ in range(num_stages)]


def OneFOneBOrder(num_stages, num_micro_batches):
  """1F1B: after K-1-k warm-up forwards, stage k alternates forward and backward.

  A stage never holds more than K - k micro-batches between their forward and
  backward, so activation memory is bounded by K instead of M.
  """
  orders = []
  for k in range(num_stages):
    warmup = min(num_stages - 1 - k, num_micro_batches)
    order = [(i, FORWARD) for i in range(warmup)]
    for i in range(num_micro_batches - warmup):
      order += [(warmup + i, FORWARD), (i, BACKWARD)]
    order += [(i, BACKWARD) for i in range(num_micro_batches - warmup, num_micro_batches)]
    orders.append(order)
  return orders


_ORDERS = {'gpipe': FillDrainOrder, '1f1b': OneFOneBOrder}
SCHEDULE_NAMES = tuple(_ORDERS)


def _Dependency(step, num_stages):
  """The step on another stage that must finish before `step` can start."""
  (m, kind), k = step
  if kind == FORWARD:
    return ((m, FORWARD), k - 1) if k > 0 else None
  return ((m, BACKWARD), k + 1) if k + 1 < num_stages else None


def _CheckOrders(orders):
  """Each stage runs every micro-batch's F once, and its B once, after the F."""
  for k, order in enumerate(orders):
    forwards = [m for m, kind in order if kind == FORWARD]
    if sorted(forwards) != sorted(m for m, kind in order if kind == BACKWARD):
      raise ValueError(f'Stage {k}: forward and backward micro-batches differ: {order}.')
    if len(set(forwards)) != len(forwards):
      raise ValueError(f'Stage {k}: a micro-batch runs twice: {order}.')
    seen = set()
    for m, kind in order:
      if kind == BACKWARD and m not in seen:
        raise ValueError(f'Stage {k}: B{m} comes before F{m}.')
      seen.add(m)


def Simulate(orders, forward_cost=1.0, backward_cost=1.0):
  """Start and end times of every step when each stage runs its order.

  Args:
    orders: per stage, the list of (micro_batch, kind) in execution order.
    forward_cost, backward_cost: step durations; scalars, or callables of
      (stage, micro_batch) for measured per-stage costs.

  Returns:
    dict ((micro_batch, kind), stage) -> (start, end).

  Raises:
    ValueError: if the orders deadlock (a dependency can never be met).
  """
  def Cost(kind, k, m):
    cost = forward_cost if kind == FORWARD else backward_cost
    return cost(k, m) if callable(cost) else cost

  _CheckOrders(orders)
  num_stages = len(orders)
  times = {}
  position = [0] * num_stages
  stage_free = [0.0] * num_stages
  ready = collections.deque(range(num_stages))
  while ready:
    k = ready.popleft()
    while position[k] < len(orders[k]):
      m, kind = orders[k][position[k]]
      dep = _Dependency(((m, kind), k), num_stages)
      if dep is not None and dep not in times:
        break  # Woken again when the stage holding `dep` advances.
      start = max(stage_free[k], times[dep][1] if dep else 0.0)
      end = start + Cost(kind, k, m)
      times[((m, kind), k)] = (start, end)
      stage_free[k] = end
      position[k] += 1
      for other in (k - 1, k + 1):
        if 0 <= other < num_stages and other not in ready:
          ready.append(other)
  if any(position[k] < len(orders[k]) for k in range(num_stages)):
    stuck = [orders[k][position[k]] for k in range(num_stages) if position[k] < len(orders[k])]
    raise ValueError(f'Schedule deadlocks; stages wait on {stuck}.')
  return times


class Schedule:
  """An ordered list of Steps for K stages and M micro-batches."""

  def __init__(self, name, num_stages, num_micro_batches):
    if name not in _ORDERS:
      raise ValueError(f'Unknown schedule {name!r}; expected one of {list(SCHEDULE_NAMES)}.')
    for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches)):
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'{what} must be a positive int, got {value!r}.')
    self.name = name
    self.num_stages = num_stages
    self.num_micro_batches = num_micro_batches
    self.orders = _ORDERS[name](num_stages, num_micro_batches)
    times = Simulate(self.orders)
    self.steps = sorted(
        (Step(int(start), k, m, kind) for ((m, kind), k), (start, _) in times.items()),
        key=lambda s: (s.clock, s.stage))
    self.num_clocks = max(s.clock for s in self.steps) + 1

  def StageSteps(self, stage):
    """The steps of one stage in the order it runs them."""
    return [s for s in self.steps if s.stage == stage]

  def ForwardSteps(self):
    return [s for s in self.steps if s.kind == FORWARD]

  def BackwardSteps(self):
    return [s for s in self.steps if s.kind == BACKWARD]

  def BubbleFraction(self):
    """Idle share of K stages x makespan, with forward and backward of unit cost."""
    return 1.0 - len(self.steps) / (self.num_stages * self.num_clocks)

  def MaxInFlight(self, stage):
    """Most micro-batches that stage has forwarded but not yet backwarded."""
    live = peak = 0
    for s in self.StageSteps(stage):
      live += 1 if s.kind == FORWARD else -1
      peak = max(peak, live)
    return peak

  def __str__(self):
    """A grid: one row per stage, one column per clock, cells like F3 or B0."""
    width = len(f'{self.num_micro_batches - 1}') + 1
    grid = [['.'.rjust(width)] * self.num_clocks for _ in range(self.num_stages)]
    for s in self.steps:
      grid[s.stage][s.clock] = f'{s.kind}{s.micro_batch}'.rjust(width)
    head = (f'{self.name} schedule, K={self.num_stages} stages, M={self.num_micro_batches} '
            f'micro-batches, bubble {self.BubbleFraction():.3f}')
    rows = [f'stage{k:<3d} ' + ' '.join(row) for k, row in enumerate(grid)]
    return '\n'.join([head] + rows)


def TheoreticalBubble(num_stages, num_micro_batches):
  """GPipe's (K-1)/(M+K-1) idle fraction of fill-drain."""
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)
