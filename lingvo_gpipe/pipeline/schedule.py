"""Pipeline schedules as data: an ordered list of actions per device.

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
anything runs, and unit costs (F, B, W one unit, BW two, L none) give every
action a clock: the printed grid is the order that runs, and BubbleFraction the
idle share of devices x makespan. The executor (lingvo_gpipe/pipeline/executor.py) runs exactly
these actions; the simulator times them with measured costs.

Schedules: 'gpipe' (fill-drain), '1f1b', 'interleaved_1f1b' (v chunks per
device, placed round-robin), 'zb_h1' and 'zb_h2' (zero bubble, Qi et al. 2024:
W fills the bubbles, with 1F1B's memory or about twice it), 'zbv' (two chunks
per device in a V, zero bubble holding 1F1B's activations). A schedule round-trips
through text (ToText / FromText), so a user can also write their own and give its
text as a pipeline's schedule (ForPipeline).

No TensorFlow here: schedules are tested in milliseconds and shared by the
runtime, the simulator and the planner.
"""

import collections
import re
from typing import Callable, NamedTuple

FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD, LOSS = 'F', 'B', 'W', 'BW', 'L'
KINDS = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD, LOSS)
ALL = -1  # The micro_batch of a whole-batch loss L(*).
UNIT_COSTS = {FORWARD: 1, INPUT_GRAD: 1, WEIGHT_GRAD: 1, BACKWARD: 2, LOSS: 0}



class Action(NamedTuple):
  """One step (a KINDS letter) of a micro-batch (or ALL) on a chunk."""
  kind: str
  micro_batch: int
  chunk: int


class Step(NamedTuple):
  """An action on device `stage`, starting at `clock` of the unit-cost run."""
  clock: int
  stage: int
  action: Action


def _ActionText(a):
  m = '*' if a.micro_batch == ALL else a.micro_batch
  return f'{a.kind}{m}@{a.chunk}'


# -- the schedules' orders ------------------------------------------------------------------


def _Placement(name, num_stages, virtual_stages):
  """Device of each chunk: round-robin, or a V (chunk c and 2K-1-c share a device)."""
  if name == 'zbv':
    return list(range(num_stages)) + list(reversed(range(num_stages)))
  return [c % num_stages for c in range(num_stages * virtual_stages)]


def _FillDrain(num_stages, num_micro_batches, placement):
  """GPipe: every device runs all forwards, the loss of the whole batch, all backwards."""
  last = len(placement) - 1
  orders = []
  for k in range(num_stages):
    order = [Action(FORWARD, m, k) for m in range(num_micro_batches)]
    if k == last:
      order.append(Action(LOSS, ALL, last))
    order += [Action(BACKWARD, m, k) for m in reversed(range(num_micro_batches))]
    orders.append(order)
  return orders


def _InterleavedChunks(num_stages, num_micro_batches, virtual_stages, k, backward):
  """Device k's (micro-batch, chunk) in Megatron's order: groups of K micro-batches go through
  one local chunk after the other (the last chunk first for backwards)."""
  out = []
  for start in range(0, num_micro_batches, num_stages):
    group = range(start, min(start + num_stages, num_micro_batches))
    local = range(virtual_stages)
    for j in (reversed(local) if backward else local):
      out += [(m, j * num_stages + k) for m in group]
  return out


def _OneFOneB(num_stages, num_micro_batches, virtual_stages, placement, warmups=None):
  """1F1B, interleaved over v chunks per device (v = 1: plain 1F1B).

  Device k first runs its warm-up forwards, (K - k - 1) * 2 + (v - 1) * K as
  Megatron's interleaved schedule does (K - k - 1 for v = 1; `warmups[k]` if
  given), then alternates a forward and a backward, then runs the remaining
  backwards. A micro-batch's loss follows its forward on the last chunk.
  """
  last = len(placement) - 1
  orders = []
  for k in range(num_stages):
    forwards = _InterleavedChunks(num_stages, num_micro_batches, virtual_stages, k, False)
    backwards = _InterleavedChunks(num_stages, num_micro_batches, virtual_stages, k, True)
    if warmups:
      warmup = warmups[k]
    elif virtual_stages == 1:
      warmup = num_stages - k - 1
    else:
      warmup = (num_stages - k - 1) * 2 + (virtual_stages - 1) * num_stages
    warmup = min(warmup, len(forwards))
    steps = [(FORWARD, x) for x in forwards[:warmup]]
    for i, x in enumerate(forwards[warmup:]):
      steps += [(FORWARD, x), (BACKWARD, backwards[i])]
    steps += [(BACKWARD, x) for x in backwards[len(forwards) - warmup:]]
    order = []
    for kind, (m, c) in steps:
      order.append(Action(kind, m, c))
      if kind == FORWARD and c == last:
        order.append(Action(LOSS, m, last))
    orders.append(order)
  return orders


def _SplitBackwards(orders, delays, num_micro_batches):
  """Each device k's BW(m) becomes B(m) then W(m - delays[k]); its last delays[k] Ws end
  its order. A device then holds delays[k] + 1 pending Ws at most. One chunk per device:
  device k's chunk is k."""
  split_orders = []
  for k, order in enumerate(orders):
    split = []
    for a in order:
      if a.kind != BACKWARD:
        split.append(a)
        continue
      split.append(Action(INPUT_GRAD, a.micro_batch, a.chunk))
      if a.micro_batch >= delays[k]:
        split.append(Action(WEIGHT_GRAD, a.micro_batch - delays[k], a.chunk))
    split += [Action(WEIGHT_GRAD, m, k)
              for m in range(max(num_micro_batches - delays[k], 0), num_micro_batches)]
    split_orders.append(split)
  return split_orders


def _ZbH1(num_stages, num_micro_batches, placement):
  """ZB-H1 (Qi et al. 2024): 1F1B's order with each backward split, device k running
  W(m - k) right after B(m) and its last k Ws at the end.

  Each device then has at most K micro-batches between F and W, 1F1B's first
  device's count (a greedy run that fills bubbles with any pending W reaches
  2K - 1), at the unit-cost bubble (K-1) / (3M + K-1) from M = K on.
  """
  orders = _OneFOneB(num_stages, num_micro_batches, 1, placement)
  return _SplitBackwards(orders, list(range(num_stages)), num_micro_batches)


def _ZbH2(num_stages, num_micro_batches, placement):
  """ZB-H2 (Qi et al. 2024): ZB-H1 with 2(K - k) - 2 warm-up forwards on device k and its
  Ws delayed by up to 2k, so that a device's tail is Ws that wait for nobody.

  Every device holds at most 2K - 1 micro-batches between F and W (the paper's
  bound). At unit costs the bubble is ZB-H1's (the least one step allows); when
  W is cheaper than B or hand-overs take time it is smaller: at K=4, M=8 with
  B 1.2, W 0.8 and a 0.2 hand-over (F = 1), 0.149 against ZB-H1's 0.216. With
  few micro-batches (M < 3K - 3) the delays shrink, as many Ws at the end would
  lengthen the step.
  """
  warmups = [2 * (num_stages - k) - 2 for k in range(num_stages)]
  delays = [min(2 * k, k + max(0, num_micro_batches - 2 * num_stages + 2))
            for k in range(num_stages)]
  orders = _OneFOneB(num_stages, num_micro_batches, 1, placement, warmups)
  return _SplitBackwards(orders, delays, num_micro_batches)


class _ZeroBubble:
  """Orders of a greedy unit-time run, the zero-bubble heuristic (ZB-V's two chunks).

  At each time, a free device takes a ready B (the device before it waits for
  it) or a ready F while it holds fewer than limits[k] micro-batch chunks'
  activations (forwarded, input gradient not yet taken) and fewer than `cap`
  pending Ws, the F first if `forwards_first` (the device after it may be waiting
  for it), else its oldest pending W: Ws fill the bubbles. Among ready Fs and Bs
  the deepest chunk goes first. The limits set the activation memory (for ZB-V,
  1F1B's first device's); the cap bounds what pending Ws hold, so neither grows
  with M.
  """

  def __init__(self, num_stages, num_micro_batches, placement, limits, cap, forwards_first):
    self._forwards_first = forwards_first
    self._m = num_micro_batches
    self._last = len(placement) - 1
    self._limits = limits
    self._cap = cap
    self._chunks = [sorted((c for c in range(len(placement)) if placement[c] == k), reverse=True)
                    for k in range(num_stages)]
    self._done = {}  # (kind, m, c) -> unit time it ends.
    self._held = [0] * num_stages
    self._pending_w = [collections.deque() for _ in range(num_stages)]
    self._next_f = {c: 0 for c in range(len(placement))}  # Next micro-batch of each chunk.
    self._next_b = dict(self._next_f)
    self._free_at = [0] * num_stages
    self.orders = [[] for _ in range(num_stages)]

  def _By(self, key, t):
    return key in self._done and self._done[key] <= t

  def _Next(self, k, t):
    """The action device k starts at time t, or None."""
    if self._forwards_first:
      action = self._ReadyForward(k, t) or self._ReadyInputGrad(k, t)
    else:
      action = self._ReadyInputGrad(k, t) or self._ReadyForward(k, t)
    if action is None and self._pending_w[k]:
      action = self._pending_w[k].popleft()
    return action

  def _ReadyInputGrad(self, k, t):
    for c in self._chunks[k]:
      m = self._next_b[c]  # Bs of a chunk become ready in micro-batch order, as its Fs.
      upstream = (LOSS, m, c) if c == self._last else (INPUT_GRAD, m, c + 1)
      if m < self._m and self._By((FORWARD, m, c), t) and self._By(upstream, t):
        return Action(INPUT_GRAD, m, c)
    return None

  def _ReadyForward(self, k, t):
    if self._held[k] >= self._limits[k] or len(self._pending_w[k]) >= self._cap:
      return None
    for c in self._chunks[k]:
      m = self._next_f[c]
      if m < self._m and (c == 0 or self._By((FORWARD, m, c - 1), t)):
        return Action(FORWARD, m, c)
    return None

  def _Start(self, k, action, t):
    self.orders[k].append(action)
    end = t + UNIT_COSTS[action.kind]
    for key in _Keys(action):
      self._done[key] = end
    self._free_at[k] = end
    if action.kind == FORWARD:
      self._held[k] += 1
      self._next_f[action.chunk] += 1
      if action.chunk == self._last:
        self.orders[k].append(Action(LOSS, action.micro_batch, self._last))
        self._done[(LOSS, action.micro_batch, self._last)] = end
    elif action.kind == INPUT_GRAD:
      self._held[k] -= 1
      self._next_b[action.chunk] += 1
      self._pending_w[k].append(Action(WEIGHT_GRAD, action.micro_batch, action.chunk))

  def Run(self):
    left = 3 * self._m * (self._last + 1)  # F, B and W of every micro-batch chunk.
    t = idle_since = 0
    while left:
      for k in range(len(self.orders)):
        action = self._Next(k, t) if self._free_at[k] <= t else None
        if action:
          self._Start(k, action, t)
          left -= 1
          idle_since = t
      if t - idle_since > 2:  # Nothing ran or runs: the limits leave no action ready.
        raise ValueError(f'Zero-bubble limits {self._limits} deadlock at time {t}.')
      t += 1
    return self.orders


def _Zbv(num_stages, num_micro_batches, placement):
  """ZB-V: the greedy zero-bubble run, each device holding at most 2K half-size chunks'
  activations (1F1B's first device's), with the fewest pending Ws allowed, from K to 2K,
  and input gradients or forwards first, that gives the shortest unit-cost step.

  Either order reaches the least bubble one step allows, (K-1) / (6M + K-1), in some
  configurations and not in others: with input gradients first a device runs its B (or,
  at its cap, a W) while the next device waits for its F (K=8, M=20: 13 units more), with
  forwards first its Bs come late (K=16, M=64: 25 units more). Caps are tried in turn,
  each with input gradients first, then forwards first; when forwards first reaches the
  bound, input gradients first with larger caps are tried on until they reach it too,
  and of those the order with the fewest pending Ws at once is kept (the cap bounds when
  forwards wait, not the pending Ws themselves: K=6, M=8 has 16 at cap 7 forwards first,
  12 at cap 8 input gradients first). Every K <= 8 with K <= M <= 64 reaches the bound
  (schedule_test). With M < K the runs miss it by 2(K - M) units or more (K=8, M=7: 2).
  """
  limits = [2 * num_stages] * num_stages
  least = 6 * num_micro_batches + num_stages - 1  # Device K-1's work, after K-1 units.
  runs = [(cap, forwards_first) for cap in range(num_stages, 2 * num_stages + 1)
          for forwards_first in (False, True)]
  best = None  # (step, most pending Ws of a device, orders)
  for cap, forwards_first in runs:
    if best and best[0] == least and forwards_first:
      continue  # Reached: only input gradients first may still hold fewer pending Ws.
    orders = _ZeroBubble(num_stages, num_micro_batches, placement, limits, cap,
                         forwards_first).Run()
    step = max(end for _, end in Simulate(orders, placement, num_micro_batches).values())
    pending = max(_Peak(order, {INPUT_GRAD: 1, WEIGHT_GRAD: -1}) for order in orders)
    if best is None or (step, pending) < best[:2]:
      best = (step, pending, orders)
    if step == least and not forwards_first:
      break
  return best[2]


def _Orders(name, num_stages, num_micro_batches, virtual_stages, placement):
  if name == 'gpipe':
    return _FillDrain(num_stages, num_micro_batches, placement)
  if name in ('1f1b', 'interleaved_1f1b'):
    return _OneFOneB(num_stages, num_micro_batches, virtual_stages, placement)
  if name == 'zb_h1':
    return _ZbH1(num_stages, num_micro_batches, placement)
  if name == 'zb_h2':
    return _ZbH2(num_stages, num_micro_batches, placement)
  return _Zbv(num_stages, num_micro_batches, placement)


# Schedule name -> the virtual stages it runs (None: any v >= 1).
_VIRTUAL_STAGES = {'gpipe': 1, '1f1b': 1, 'interleaved_1f1b': None, 'zb_h1': 1, 'zb_h2': 1,
                   'zbv': 2}
SCHEDULE_NAMES = tuple(_VIRTUAL_STAGES)
# Schedules of one chunk per device: what a balance plan's stages (lingvo_gpipe/insight/planner.py) run.
ONE_CHUNK_SCHEDULES = tuple(name for name, v in _VIRTUAL_STAGES.items() if v == 1)
# Schedules that split each backward into B and W (and so recompute each chunk in B).
SPLIT_SCHEDULES = ('zb_h1', 'zb_h2', 'zbv')
# Schedules whose loss is the whole batch's (the others call it per micro-batch).
WHOLE_BATCH_LOSS = ('gpipe',)


# -- checking and timing orders ----------------------------------------------------------------


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


def _Keys(action):
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
        raise ValueError(f'Device {k}: {_ActionText(a)} is not an action of {num_chunks} '
                         f'chunks and {num_micro_batches} micro-batches.')
      if placement[a.chunk] != k:
        raise ValueError(f'Device {k}: {_ActionText(a)} belongs on device {placement[a.chunk]}.')
      if a.kind == LOSS and a.chunk != last:
        raise ValueError(f'Device {k}: {_ActionText(a)}: the loss belongs to the last chunk '
                         f'({last}).')
      for key in _Keys(a):
        if key in seen:
          raise ValueError(f'Device {k}: {_ActionText(a)} runs twice.')
        seen.add(key)
      own = [n for n in _Needs(a, num_chunks) if n[2] == a.chunk and n[0] != LOSS]
      if a.kind in (INPUT_GRAD, BACKWARD, WEIGHT_GRAD) and not all(n in done for n in own):
        raise ValueError(f'Device {k}: {_ActionText(a)} comes before '
                         f'{_ActionText(Action(*own[-1]))} on the same chunk.')
      done.update(_Keys(a))
  ms = [ALL] if whole else range(num_micro_batches)
  expected = {(kind, m, c) for m in range(num_micro_batches) for c in range(num_chunks)
              for kind in (FORWARD, INPUT_GRAD, WEIGHT_GRAD)} | {(LOSS, m, last) for m in ms}
  missing = sorted(expected - seen, key=lambda key: (key[1], key[2], key[0]))
  if missing:
    names = ' '.join(_ActionText(Action(*key)) for key in missing[:6])
    raise ValueError(f'The orders never run {names}{" ..." if len(missing) > 6 else ""}.')
  if len(seen) != len(expected):  # Only losses can be extra: L* with per-micro-batch ones.
    names = ' '.join(_ActionText(Action(*key)) for key in sorted(seen - expected)[:6])
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
      made = {key: end for key in _Keys(a)}
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
  stuck = [f'device {k} at {_ActionText(orders[k][position[k]])}'
           for k in range(len(orders)) if position[k] < len(orders[k])]
  if stuck:
    raise ValueError(f'The orders deadlock: {", ".join(stuck)} wait forever.')
  return times


def _CheckSizes(num_stages, num_micro_batches, virtual_stages):
  for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches),
                      ('virtual_stages', virtual_stages)):
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{what} must be a positive int, got {value!r}.')


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


def Orders(name: str, num_stages: int, num_micro_batches: int,
           virtual_stages: int = 1) -> tuple[list[list[Action]], list[int]]:
  """(per-device action orders, device of each chunk) of schedule `name`, unchecked: what
  Schedule checks and runs, and what the simulator takes for sizes Python cannot time."""
  _CheckSizes(num_stages, num_micro_batches, virtual_stages)
  if name not in _VIRTUAL_STAGES:
    raise ValueError(f'Unknown schedule {name!r}; expected one of {list(SCHEDULE_NAMES)}.')
  wanted = _VIRTUAL_STAGES[name]
  if wanted is not None and virtual_stages != wanted:
    raise ValueError(f'Schedule {name!r} runs {wanted} chunk(s) per device; got '
                     f'virtual_stages={virtual_stages}.')
  if (name == 'interleaved_1f1b' and virtual_stages > 1 and
      num_micro_batches > num_stages and num_micro_batches % num_stages):
    raise ValueError(
        f'interleaved_1f1b runs micro-batches in groups of K={num_stages}: '
        f'num_micro_batches={num_micro_batches} must be at most K or a multiple of K '
        f'(e.g. {num_micro_batches - num_micro_batches % num_stages} or '
        f'{num_micro_batches + num_stages - num_micro_batches % num_stages}).')
  placement = _Placement(name, num_stages, virtual_stages)
  return _Orders(name, num_stages, num_micro_batches, virtual_stages, placement), placement


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

  `schedule` is a name (SCHEDULE_NAMES) or a user's own orders in ToText's format,
  which are checked and must be for this K, M and v. num_micro_batches None (not
  known before the batch) checks what can be: a name at M=1, a text at its own M.
  """
  if not isinstance(schedule, str):
    raise ValueError(f'schedule must be one of {list(SCHEDULE_NAMES)} or a schedule text '
                     f'(Schedule.ToText), got {schedule!r}.')
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
    name: one of SCHEDULE_NAMES, or any label for orders given explicitly.
    num_stages: K devices.
    num_micro_batches: M.
    virtual_stages: v chunks per device (interleaved_1f1b: any; zbv: 2; else 1).
    orders, placement: a user's own orders (per device, Actions) and chunk
      devices, instead of a named schedule's.
  """

  def __init__(self, name: str, num_stages: int, num_micro_batches: int, virtual_stages: int = 1,
               orders: list[list[Action]] | None = None, placement: list[int] | None = None):
    if not isinstance(name, str) or not re.fullmatch(r'\S+', name):
      raise ValueError(f'A schedule name is one word (it heads the schedule text), got {name!r}.')
    if (orders is None) != (placement is None):
      raise ValueError('A schedule of your own gives both orders (per device) and placement '
                       '(the device of each chunk); got only one of them.')
    if orders is None:
      orders, placement = Orders(name, num_stages, num_micro_batches, virtual_stages)
    _CheckSizes(num_stages, num_micro_batches, virtual_stages)
    _CheckPlacement(placement, num_stages, virtual_stages)
    if len(orders) != num_stages:
      raise ValueError(f'Got orders for {len(orders)} devices; expected num_stages={num_stages}.')
    self.name = name
    self.num_stages = num_stages
    self.num_micro_batches = num_micro_batches
    self.virtual_stages = virtual_stages
    self.placement = list(placement)
    self.orders = [list(order) for order in orders]
    times = Simulate(self.orders, self.placement, num_micro_batches)
    self.steps = sorted((Step(int(start), self.placement[a.chunk], a)
                         for a, (start, _) in times.items()),
                        key=lambda s: (s.clock, s.stage, UNIT_COSTS[s.action.kind] > 0))
    self.num_clocks = max(int(end) for _, end in times.values())

  @property
  def num_chunks(self) -> int:
    return len(self.placement)

  @property
  def whole_batch_loss(self) -> bool:
    """Whether the loss is computed once on the whole batch (after every forward)."""
    return any(a.kind == LOSS and a.micro_batch == ALL for order in self.orders for a in order)

  def StageSteps(self, stage: int) -> list[Step]:
    """The steps of one device in the order it runs them."""
    return [s for s in self.steps if s.stage == stage]

  def BubbleFraction(self) -> float:
    """Idle share of K devices x makespan, with F, B and W of one unit each (BW two)."""
    busy = sum(UNIT_COSTS[a.kind] for order in self.orders for a in order)
    return 1.0 - busy / (self.num_stages * self.num_clocks)

  def MaxInFlight(self, stage: int) -> int:
    """Most micro-batch chunks whose activations device `stage` holds: forwarded, input
    gradient not yet taken (a pending W holds less: MaxPendingWeightGrads)."""
    return _Peak(self.orders[stage], {FORWARD: 1, INPUT_GRAD: -1, BACKWARD: -1})

  def MaxPendingWeightGrads(self, stage: int) -> int:
    """Most micro-batch chunks whose B ran and W did not: each holds what its W needs."""
    return _Peak(self.orders[stage], {INPUT_GRAD: 1, WEIGHT_GRAD: -1})

  def ToText(self) -> str:
    """One line per device; FromText reads it back."""
    head = (f'schedule {self.name} K={self.num_stages} M={self.num_micro_batches} '
            f'v={self.virtual_stages}')
    return '\n'.join([head] + [f'device{k}: ' + ' '.join(_ActionText(a) for a in order)
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
      m = '*' if a.micro_batch == ALL else a.micro_batch
      return f'{a.kind}{m}' + (f'.{a.chunk}' if self.num_chunks > self.num_stages else '')

    cells = [Cell(s.action) for s in self.steps if UNIT_COSTS[s.action.kind]]
    width = max(len(c) for c in cells)
    grid = [['.'.rjust(width)] * self.num_clocks for _ in range(self.num_stages)]
    for s in self.steps:
      for i in range(UNIT_COSTS[s.action.kind]):
        grid[s.stage][s.clock + i] = Cell(s.action).rjust(width)
    v = f', v={self.virtual_stages}' if self.virtual_stages > 1 else ''
    head = (f'{self.name} schedule, K={self.num_stages} devices{v}, M={self.num_micro_batches} '
            f'micro-batches, bubble {self.BubbleFraction():.3f}')
    rows = [f'stage{k:<3d} ' + ' '.join(row) for k, row in enumerate(grid)]
    return '\n'.join([head] + rows)


def _Peak(order, change):
  live = peak = 0
  for a in order:
    live += change.get(a.kind, 0)
    peak = max(peak, live)
  return peak


def _ParseAction(token):
  match = re.fullmatch(r'(BW|F|B|W|L)(\d+|\*)@(\d+)', token)
  if match is None:
    raise ValueError(f"Schedule text: {token!r} is not an action like F3@0, BW3@0, B3@1, W3@1, "
                     "L3@1 or L*@1.")
  kind, m, c = match.groups()
  return Action(kind, ALL if m == '*' else int(m), int(c))


def TheoreticalBubble(num_stages: int, num_micro_batches: int) -> float:
  """GPipe's (K-1)/(M+K-1) idle fraction of fill-drain."""
  return (num_stages - 1) / (num_micro_batches + num_stages - 1)
