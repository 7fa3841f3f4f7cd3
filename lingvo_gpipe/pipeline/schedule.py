"""Pipeline schedules as data: the Schedule class, an ordered list of actions per device.

A Schedule holds the orders of a named schedule (named_schedules.py) or a user's own,
checks them complete (schedule_actions.py) and free of deadlocks, and gives every action
a clock of the unit-cost run (cost_model.Time, the timing the simulator uses with
measured costs): the printed grid is the order that runs, and BubbleFraction the idle
share of devices x makespan. program.Lower turns a Schedule into the instructions the
executor (lingvo_gpipe/pipeline/executor.py) runs: these actions, with their sends.

A schedule round-trips through text (ToText / FromText), so a user can also write their
own and give its text as a pipeline's schedule (ForPipeline).

No TensorFlow here: schedules are tested in milliseconds and shared by the
runtime, the simulator and the planner.
"""

import re

import numpy as np

from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule_actions


def _CheckPlacement(placement, num_stages, virtual_stages):
  """A user's chunk devices: K x v chunks, v on each of the K devices."""
  if len(placement) != num_stages * virtual_stages:
    raise ValueError(f'placement has {len(placement)} chunks; K={num_stages} devices x '
                     f'v={virtual_stages} chunks each need {num_stages * virtual_stages}.')
  for device in range(num_stages):
    chunks = [c for c, d in enumerate(placement) if d == device]
    if len(chunks) != virtual_stages:
      raise ValueError(f'placement puts chunks {chunks} on device {device}; v={virtual_stages} '
                       f'gives each of the K={num_stages} devices {virtual_stages}.')


def _UnitRun(orders, placement, num_micro_batches):
  """(every action as a Step at its clock of the unit-cost run, the run's length): each
  action's start from cost_model.Time; a loss, which takes no time, starts where its
  device's action before it ended."""
  start, end = cost_model.Time(cost_model.ToArrays(orders, placement),
                               cost_model.CostModel.Unit(len(placement), num_micro_batches))
  steps = []
  for k, order in enumerate(orders):
    free = 0.0
    for a in order:
      if a.kind == schedule_actions.LOSS:
        steps.append(schedule_actions.Step(int(free), k, a))
        continue
      at = (cost_model.CODES[a.kind], a.chunk, a.micro_batch)
      steps.append(schedule_actions.Step(int(start[at]), k, a))
      free = end[at]
  return steps, int(np.nanmax(end))


def IsText(schedule: str) -> bool:
  """Whether a pipeline's `schedule` is meant as a schedule's text (Schedule.ToText), not a
  name: it has several lines or starts with 'schedule ' (FromText then says what is wrong)."""
  return isinstance(schedule, str) and (len(schedule.strip().splitlines()) > 1 or
                                        schedule.lstrip().startswith('schedule '))


def Name(schedule: str) -> str:
  """A pipeline's `schedule` for messages: the name, or the name a text's first line gives."""
  return f'{schedule.split()[1]} (text)' if IsText(schedule) else schedule


def ForPipeline(schedule: str, num_stages: int, num_micro_batches: int,
                virtual_stages: int) -> 'Schedule':
  """The Schedule a pipeline of K devices with v chunks each runs on M micro-batches.

  `schedule` is a name (named_schedules.SCHEDULE_NAMES) or a user's own orders in ToText's
  format, which are checked and must be for this K, M and v. num_micro_batches None (not
  known before the batch) checks what can be: a name at M=1, a text at its own M.
  """
  if not isinstance(schedule, str):
    raise ValueError(f'schedule must be one of {list(named_schedules.SCHEDULE_NAMES)} or a '
                     f'schedule text (Schedule.ToText), got {schedule!r}.')
  if not IsText(schedule):
    return Schedule(schedule, num_stages, 1 if num_micro_batches is None else num_micro_batches,
                    virtual_stages)
  sched = Schedule.FromText(schedule)
  got = (sched.num_stages, sched.num_micro_batches, sched.virtual_stages)
  want = (num_stages, sched.num_micro_batches if num_micro_batches is None else
          num_micro_batches, virtual_stages)
  if got != want:
    raise ValueError(f'The schedule text is for K={got[0]} devices, M={got[1]} micro-batches, '
                     f'v={got[2]} chunks per device; this pipeline runs K={want[0]}, '
                     f'M={want[1]}, v={want[2]}.')
  return sched


class Schedule:
  """The per-device action orders of a schedule, checked and timed with unit costs.

  Args:
    name: one of named_schedules.SCHEDULE_NAMES, or any label for orders given
      explicitly.
    num_stages: K devices.
    num_micro_batches: M.
    virtual_stages: v chunks per device (interleaved_1f1b: any; zbv: 2; else 1).
    orders, placement: a user's own orders (per device, Actions) and chunk
      devices, instead of a named schedule's.
  """

  def __init__(self, name: str, num_stages: int, num_micro_batches: int, virtual_stages: int = 1,
               orders: list[list[schedule_actions.Action]] | None = None,
               placement: list[int] | None = None):
    if not isinstance(name, str) or not re.fullmatch(r'\S+', name):
      raise ValueError(f'A schedule name is one word (it heads the schedule text), got {name!r}.')
    if (orders is None) != (placement is None):
      raise ValueError('A schedule of your own gives both orders (per device) and placement '
                       '(the device of each chunk); got only one of them.')
    if orders is None:
      orders, placement = named_schedules.Orders(name, num_stages, num_micro_batches,
                                                 virtual_stages)
    schedule_actions.CheckSizes(num_stages, num_micro_batches, virtual_stages)
    _CheckPlacement(placement, num_stages, virtual_stages)
    if len(orders) != num_stages:
      raise ValueError(f'Got orders for {len(orders)} devices; expected num_stages={num_stages}.')
    self.name = name
    self.num_stages = num_stages
    self.num_micro_batches = num_micro_batches
    self.virtual_stages = virtual_stages
    self.placement = list(placement)
    self.orders = [list(order) for order in orders]
    schedule_actions.CheckOrders(self.orders, self.placement, num_micro_batches)
    steps, self.num_clocks = _UnitRun(self.orders, self.placement, num_micro_batches)
    self.steps = sorted(steps, key=lambda s: (s.clock, s.stage,
                                              cost_model.UNIT_COSTS[s.action.kind] > 0))

  @property
  def num_chunks(self) -> int:
    return len(self.placement)

  @property
  def whole_batch_loss(self) -> bool:
    """Whether the loss is computed once on the whole batch (after every forward)."""
    return any(a.kind == schedule_actions.LOSS and a.micro_batch == schedule_actions.ALL
               for order in self.orders for a in order)

  def StageSteps(self, stage: int) -> list[schedule_actions.Step]:
    """The steps of one device in the order it runs them."""
    return [s for s in self.steps if s.stage == stage]

  def BubbleFraction(self) -> float:
    """Idle share of K devices x makespan, with F, B and W of one unit each (BW two)."""
    busy = sum(cost_model.UNIT_COSTS[a.kind] for order in self.orders for a in order)
    return 1.0 - busy / (self.num_stages * self.num_clocks)

  def MaxInFlight(self, stage: int) -> int:
    """Most micro-batch chunks whose activations device `stage` holds: forwarded, input
    gradient not yet taken (a pending W holds less: MaxPendingWeightGrads)."""
    return schedule_actions.Peak(self.orders[stage], {schedule_actions.FORWARD: 1,
                                                      schedule_actions.INPUT_GRAD: -1,
                                                      schedule_actions.BACKWARD: -1})

  def MaxPendingWeightGrads(self, stage: int) -> int:
    """Most micro-batch chunks whose B ran and W did not: each holds what its W needs."""
    return schedule_actions.Peak(self.orders[stage], {schedule_actions.INPUT_GRAD: 1,
                                                      schedule_actions.WEIGHT_GRAD: -1})

  def ToText(self) -> str:
    """One line per device; FromText reads it back."""
    head = (f'schedule {self.name} K={self.num_stages} M={self.num_micro_batches} '
            f'v={self.virtual_stages}')
    return '\n'.join([head] + [f'device{k}: ' +
                               ' '.join(schedule_actions.ActionText(a) for a in order)
                               for k, order in enumerate(self.orders)]) + '\n'

  @classmethod
  def FromText(cls, text: str) -> 'Schedule':
    """The Schedule of ToText's format (a user may write their own orders in it)."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    head = re.fullmatch(r'schedule (\S+) K=(\d+) M=(\d+) v=(\d+)', lines[0]) if lines else None
    if head is None:
      raise ValueError(f"Schedule text must start with 'schedule <name> K=<devices> "
                       f"M=<micro-batches> v=<chunks per device>'; got {lines[:1]}.")
    name, k, m, v = head.group(1), *map(int, head.groups()[1:])
    for field, value in (('K', k), ('M', m), ('v', v)):
      if value < 1:
        raise ValueError(f'Schedule text: {field}={value} in its first line; expected at least 1.')
    if len(lines) - 1 != k:
      raise ValueError(f'Schedule text: K={k} devices in its first line, but {len(lines) - 1} '
                       'device lines follow.')
    orders = []
    for i, line in enumerate(lines[1:]):
      label, _, body = line.partition(':')
      if label.strip() != f'device{i}':
        raise ValueError(f"Schedule text line {i + 2}: expected 'device{i}: ...', got {line!r}.")
      orders.append([_ParseAction(token) for token in body.split()])
    actions = sum(len(order) for order in orders)
    if actions < m * k * v:  # Before the checker builds every action M implies.
      raise ValueError(f'Schedule text: M={m} micro-batches through K={k} x v={v} chunks '
                       f'need {m * k * v} forwards; the orders have {actions} actions.')
    placement = [None] * (k * v)
    for device, order in enumerate(orders):
      for a in order:
        if 0 <= a.chunk < k * v:
          placement[a.chunk] = device
    if None in placement:
      raise ValueError(f'Schedule text: chunk {placement.index(None)} of {k * v} has no actions.')
    try:
      return cls(name, k, m, v, orders=orders, placement=placement)
    except ValueError as e:
      raise ValueError(f'Schedule text: {e}') from None

  def __str__(self):
    """A grid: one row per device, one column per unit of time, cells like F3, B0 or W1.

    With several chunks per device, cells also name the chunk (F3.1); a fused BW
    spans two columns; '.' is idle.
    """
    def Cell(a):
      m = '*' if a.micro_batch == schedule_actions.ALL else a.micro_batch
      return f'{a.kind}{m}' + (f'.{a.chunk}' if self.num_chunks > self.num_stages else '')

    cells = [Cell(s.action) for s in self.steps if cost_model.UNIT_COSTS[s.action.kind]]
    width = max(len(c) for c in cells)
    grid = [['.'.rjust(width)] * self.num_clocks for _ in range(self.num_stages)]
    for s in self.steps:
      for i in range(cost_model.UNIT_COSTS[s.action.kind]):
        grid[s.stage][s.clock + i] = Cell(s.action).rjust(width)
    v = f', v={self.virtual_stages}' if self.virtual_stages > 1 else ''
    head = (f'{self.name} schedule, K={self.num_stages} devices{v}, M={self.num_micro_batches} '
            f'micro-batches, bubble {self.BubbleFraction():.3f}')
    rows = [f'stage{k:<3d} ' + ' '.join(row) for k, row in enumerate(grid)]
    return '\n'.join([head] + rows)


def _ParseAction(token):
  match = re.fullmatch(r'(BW|F|B|W|L)(\d+|\*)@(\d+)', token)
  if match is None:
    raise ValueError(f"Schedule text: {token!r} is not an action like F3@0, BW3@0, B3@1, W3@1, "
                     "L3@1 or L*@1.")
  kind, m, c = match.groups()
  return schedule_actions.Action(schedule_actions.Kind(kind),
                                 schedule_actions.ALL if m == '*' else int(m), int(c))


def TheoreticalBubble(num_stages: int, num_micro_batches: int) -> float:
  """GPipe's (K-1)/(M+K-1) idle fraction of fill-drain."""
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)
