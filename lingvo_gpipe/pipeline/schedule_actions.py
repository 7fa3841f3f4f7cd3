"""The actions of a pipeline schedule, and the rules that check and time their orders.

An action is one step of one micro-batch m on one chunk c (a cell of the
pipeline; with v virtual stages, K devices hold K * v chunks):

  F(m, c)   forward of chunk c;
  B(m, c)   the input gradient of chunk c: what the chunk before it waits for;
  W(m, c)   the weight gradient of chunk c, which nobody waits for (zero-bubble
            schedules use it to fill the bubbles);
  BW(m, c)  B and W fused, for schedules that do not split them;
  L(m)      the loss of micro-batch m on the last chunk's device, and its
            gradient; L(*) (micro_batch ALL) is the loss of the whole batch,
            after every forward (fill-drain).

Each device runs its own list in order; an action also waits for its data
(F(m, c) for F(m, c-1), B(m, c) for B(m, c+1) or the loss, W(m, c) for B(m, c)).
CheckOrders proves a set of orders complete and free of deadlocks before
anything runs, and Simulate gives every action a clock (with unit costs: F, B, W
one unit, BW two, L none). The executor (lingvo_gpipe/pipeline/executor.py) runs
exactly these actions; the simulator times them with measured costs.

Separate from the named schedules (named_schedules.py) and the Schedule class
(schedule.py), which both build on these rules. No TensorFlow here.
"""

import collections
import enum
from typing import Callable, NamedTuple


class Kind(enum.StrEnum):
  """An action's kind; a str, so it prints, compares and keys a dict as its letter."""
  FORWARD = 'F'
  INPUT_GRAD = 'B'
  WEIGHT_GRAD = 'W'
  BACKWARD = 'BW'
  LOSS = 'L'


FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD, LOSS = Kind
KINDS = tuple(Kind)
ALL = -1  # The micro_batch of a whole-batch loss L(*).
UNIT_COSTS = {FORWARD: 1, INPUT_GRAD: 1, WEIGHT_GRAD: 1, BACKWARD: 2, LOSS: 0}


class Action(NamedTuple):
  """One step (a Kind) of a micro-batch (or ALL) on a chunk."""
  kind: Kind
  micro_batch: int
  chunk: int


class Step(NamedTuple):
  """An action on device `stage`, starting at `clock` of the unit-cost run."""
  clock: int
  stage: int
  action: Action


def ActionText(a: Action) -> str:
  """The action as schedule text writes it: F3@0, BW3@0, L*@1."""
  m = '*' if a.micro_batch == ALL else a.micro_batch
  return f'{a.kind}{m}@{a.chunk}'


def _Needs(action, num_chunks):
  """The keys (kind, micro-batch, chunk) whose ends `action` waits for, besides its device."""
  kind, m, c = action
  if kind == FORWARD:
    return [(FORWARD, m, c - 1)] if c > 0 else []
  if kind == LOSS:
    return [(FORWARD, m, c)] if m != ALL else [('F*', ALL, c)]
  if kind == WEIGHT_GRAD:
    return [(INPUT_GRAD, m, c)]
  upstream = (INPUT_GRAD, m, c + 1) if c + 1 < num_chunks else (LOSS, m, c)
  return [(FORWARD, m, c), upstream]


def Keys(action: Action) -> list[tuple[str, int, int]]:
  """What finishing `action` makes available: BW counts as its B and its W."""
  kind, m, c = action
  if kind == BACKWARD:
    return [(INPUT_GRAD, m, c), (WEIGHT_GRAD, m, c)]
  return [(kind, m, c)]


def CheckOrders(orders: list[list[Action]], placement: list[int],
                num_micro_batches: int) -> None:
  """Raises ValueError unless the orders run every micro-batch's actions once, each on its
  chunk's device, F before B before W, with the loss on the last chunk's device."""
  num_chunks = len(placement)
  last = num_chunks - 1
  whole = any(a.kind == LOSS and a.micro_batch == ALL for order in orders for a in order)
  seen = set()
  for k, order in enumerate(orders):
    done = set()
    for a in order:
      if a.kind not in KINDS or not 0 <= a.chunk < num_chunks or not (
          0 <= a.micro_batch < num_micro_batches or (a.kind == LOSS and a.micro_batch == ALL)):
        raise ValueError(f'Device {k}: {ActionText(a)} is not an action of {num_chunks} '
                         f'chunks and {num_micro_batches} micro-batches.')
      if placement[a.chunk] != k:
        raise ValueError(f'Device {k}: {ActionText(a)} belongs on device {placement[a.chunk]}.')
      if a.kind == LOSS and a.chunk != last:
        raise ValueError(f'Device {k}: {ActionText(a)}: the loss belongs to the last chunk '
                         f'({last}).')
      for key in Keys(a):
        if key in seen:
          raise ValueError(f'Device {k}: {ActionText(a)} runs twice.')
        seen.add(key)
      own = [n for n in _Needs(a, num_chunks) if n[2] == a.chunk and n[0] != LOSS]
      if a.kind in (INPUT_GRAD, BACKWARD, WEIGHT_GRAD) and not all(n in done for n in own):
        raise ValueError(f'Device {k}: {ActionText(a)} comes before '
                         f'{ActionText(Action(*own[-1]))} on the same chunk.')
      done.update(Keys(a))
  ms = [ALL] if whole else range(num_micro_batches)
  expected = {(kind, m, c) for m in range(num_micro_batches) for c in range(num_chunks)
              for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)} | {(LOSS, m, last) for m in ms}
  missing = sorted(expected - seen, key=lambda key: (key[1], key[2], key[0]))
  if missing:
    names = ' '.join(ActionText(Action(*key)) for key in missing[:6])
    raise ValueError(f'The orders never run {names}{" ..." if len(missing) > 6 else ""}.')
  if len(seen) != len(expected):  # Only losses can be extra: L* with per-micro-batch ones.
    names = ' '.join(ActionText(Action(*key)) for key in sorted(seen - expected)[:6])
    raise ValueError(f'The orders run {names} besides a whole-batch loss L*@{last}: a schedule '
                     f'has either the one or a loss per micro-batch.')


def Simulate(orders: list[list[Action]], placement: list[int], num_micro_batches: int,
             cost: Callable[[Action], float] | None = None) -> dict:
  """Start and end of every action when each device runs its order.

  Args:
    orders: per device, the list of Actions in execution order (CheckOrders' rules).
    placement: the device of each chunk.
    num_micro_batches: M.
    cost: callable(action) -> duration; default UNIT_COSTS.

  Returns:
    dict Action -> (start, end).

  Raises:
    ValueError: if the orders deadlock (an action waits for one that never runs).
  """
  CheckOrders(orders, placement, num_micro_batches)
  cost = cost or (lambda a: UNIT_COSTS[a.kind])
  num_chunks = len(placement)
  ends = {}
  forwards_left = {c: num_micro_batches for c in range(num_chunks)}
  times = {}
  position = [0] * len(orders)
  free = [0.0] * len(orders)
  waiting = collections.defaultdict(list)  # Key -> the devices whose next action needs it.
  ready = collections.deque(range(len(orders)))
  while ready:
    k = ready.popleft()
    while position[k] < len(orders[k]):
      a = orders[k][position[k]]
      needs = _Needs(a, num_chunks)
      missing = [n for n in needs if n not in ends]
      if missing:
        waiting[missing[0]].append(k)  # Woken when it ends.
        break
      start = max([free[k]] + [ends[n] for n in needs])
      end = start + cost(a)
      times[a] = (start, end)
      free[k] = end
      position[k] += 1
      made = {key: end for key in Keys(a)}
      if a.kind == LOSS and a.micro_batch == ALL:  # Every micro-batch's backward may start.
        made.update(((LOSS, m, a.chunk), end) for m in range(num_micro_batches))
      if a.kind == FORWARD:
        forwards_left[a.chunk] -= 1
        if not forwards_left[a.chunk]:
          made[('F*', ALL, a.chunk)] = max(ends.get((FORWARD, m, a.chunk), end)
                                           for m in range(num_micro_batches))
      ends.update(made)
      for key in made:
        ready.extend(waiting.pop(key, ()))
  stuck = [f'device {k} at {ActionText(orders[k][position[k]])}'
           for k in range(len(orders)) if position[k] < len(orders[k])]
  if stuck:
    raise ValueError(f'The orders deadlock: {", ".join(stuck)} wait forever.')
  return times


def CheckSizes(num_stages: int, num_micro_batches: int, virtual_stages: int) -> None:
  """Raises ValueError unless K, M and v are positive ints."""
  for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches),
                      ('virtual_stages', virtual_stages)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{what} must be a positive int, got {value!r}.')


def Peak(order: list[Action], change: dict[str, int]) -> int:
  """The highest running sum of change[kind] over `order`: what a device holds at most."""
  live = peak = 0
  for a in order:
    live += change.get(a.kind, 0)
    peak = max(peak, live)
  return peak
