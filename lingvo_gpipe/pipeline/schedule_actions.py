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
CheckOrders proves a set of orders complete and each device's order consistent
before anything runs; cost_model.Time gives every action a clock and finds the
deadlocks across devices. A schedule is lowered to the program the executor runs
(program.py).

Separate from the named schedules (named_schedules.py) and the Schedule class
(schedule.py), which both build on these rules. No TensorFlow here.
"""

import enum
from typing import NamedTuple


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


def _OwnNeeds(action, num_chunks, num_micro_batches):
  """The keys (kind, micro-batch, chunk) of its own chunk that `action` waits for: they run
  before it on its device (a loss's forwards, a backward's forward and loss, a W's B)."""
  kind, m, c = action
  if kind == LOSS:
    ms = range(num_micro_batches) if m == ALL else [m]
    return [(FORWARD, i, c) for i in ms]
  if kind == WEIGHT_GRAD:
    return [(INPUT_GRAD, m, c)]
  if kind == FORWARD:
    return []
  return [(FORWARD, m, c)] + ([(LOSS, m, c)] if c == num_chunks - 1 else [])


def Keys(action: Action) -> list[tuple[str, int, int]]:
  """What finishing `action` makes available: BW counts as its B and its W."""
  kind, m, c = action
  if kind == BACKWARD:
    return [(INPUT_GRAD, m, c), (WEIGHT_GRAD, m, c)]
  return [(kind, m, c)]


def CheckOrders(orders: list[list[Action]], placement: list[int],
                num_micro_batches: int) -> None:
  """Raises ValueError unless the orders run every micro-batch's actions once, each on its
  chunk's device and after what it needs of its own chunk (F before B before W; the loss,
  on the last chunk's device, after its forwards and before their backwards)."""
  num_chunks = len(placement)
  last = num_chunks - 1
  whole = any(a.kind == LOSS and a.micro_batch == ALL for order in orders for a in order)
  seen = set()
  for k, order in enumerate(orders):
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
  for k, order in enumerate(orders):
    _CheckDeviceOrder(k, order, num_chunks, num_micro_batches)


def _CheckDeviceOrder(k, order, num_chunks, num_micro_batches):
  """Raises ValueError unless each action of device k comes after what it needs of its own
  chunk (which runs on the same device)."""
  done = set()
  for a in order:
    missing = [n for n in _OwnNeeds(a, num_chunks, num_micro_batches) if n not in done]
    if missing:
      raise ValueError(f'Device {k}: {ActionText(a)} comes before '
                       f'{ActionText(Action(*missing[0]))} on the same chunk.')
    done.update(Keys(a))
    if a.kind == LOSS and a.micro_batch == ALL:  # Every micro-batch's backward may start.
      done.update((LOSS, m, a.chunk) for m in range(num_micro_batches))


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
