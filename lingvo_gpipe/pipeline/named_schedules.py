"""The orders of the named schedules: which action each device runs when.

'gpipe' (fill-drain), '1f1b', 'interleaved_1f1b' (v chunks per device, placed
round-robin), 'zb_h1' and 'zb_h2' (zero bubble, Qi et al. 2024: W fills the
bubbles, with 1F1B's memory or about twice it), 'zbv' (two chunks per device in
a V, zero bubble holding 1F1B's activations). Orders gives a name's per-device
orders and chunk devices, unchecked.

Separate from the Schedule class (schedule.py), which checks and times any orders (a
user's own too), so that the schedules' construction is read and tested on its own; both
build on the action rules of schedule_actions.py. ZB-V's greedy run builds its orders on
a clock of its own, with cost_model's unit durations, and the one timing of orders
(cost_model.Time) picks among them. No TensorFlow here.
"""

import collections

import numpy as np

from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import schedule_actions


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
    order = [schedule_actions.Action(schedule_actions.FORWARD, m, k)
             for m in range(num_micro_batches)]
    if k == last:
      order.append(schedule_actions.Action(schedule_actions.LOSS, schedule_actions.ALL, last))
    order += [schedule_actions.Action(schedule_actions.BACKWARD, m, k)
              for m in reversed(range(num_micro_batches))]
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
    steps = [(schedule_actions.FORWARD, x) for x in forwards[:warmup]]
    for i, x in enumerate(forwards[warmup:]):
      steps += [(schedule_actions.FORWARD, x), (schedule_actions.BACKWARD, backwards[i])]
    steps += [(schedule_actions.BACKWARD, x) for x in backwards[len(forwards) - warmup:]]
    order = []
    for kind, (m, c) in steps:
      order.append(schedule_actions.Action(kind, m, c))
      if kind == schedule_actions.FORWARD and c == last:
        order.append(schedule_actions.Action(schedule_actions.LOSS, m, last))
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
      if a.kind != schedule_actions.BACKWARD:
        split.append(a)
        continue
      split.append(schedule_actions.Action(schedule_actions.INPUT_GRAD, a.micro_batch, a.chunk))
      if a.micro_batch >= delays[k]:
        split.append(schedule_actions.Action(schedule_actions.WEIGHT_GRAD,
                                             a.micro_batch - delays[k], a.chunk))
    split += [schedule_actions.Action(schedule_actions.WEIGHT_GRAD, m, k)
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
      upstream = ((schedule_actions.LOSS, m, c) if c == self._last else
                  (schedule_actions.INPUT_GRAD, m, c + 1))
      if m < self._m and self._By((schedule_actions.FORWARD, m, c), t) and self._By(upstream, t):
        return schedule_actions.Action(schedule_actions.INPUT_GRAD, m, c)
    return None

  def _ReadyForward(self, k, t):
    if self._held[k] >= self._limits[k] or len(self._pending_w[k]) >= self._cap:
      return None
    for c in self._chunks[k]:
      m = self._next_f[c]
      if m < self._m and (c == 0 or self._By((schedule_actions.FORWARD, m, c - 1), t)):
        return schedule_actions.Action(schedule_actions.FORWARD, m, c)
    return None

  def _Start(self, k, action, t):
    self.orders[k].append(action)
    end = t + cost_model.UNIT_COSTS[action.kind]
    for key in schedule_actions.Keys(action):
      self._done[key] = end
    self._free_at[k] = end
    if action.kind == schedule_actions.FORWARD:
      self._held[k] += 1
      self._next_f[action.chunk] += 1
      if action.chunk == self._last:
        self.orders[k].append(
            schedule_actions.Action(schedule_actions.LOSS, action.micro_batch, self._last))
        self._done[(schedule_actions.LOSS, action.micro_batch, self._last)] = end
    elif action.kind == schedule_actions.INPUT_GRAD:
      self._held[k] -= 1
      self._next_b[action.chunk] += 1
      self._pending_w[k].append(schedule_actions.Action(schedule_actions.WEIGHT_GRAD,
                                                        action.micro_batch, action.chunk))

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
    _, ends = cost_model.Time(cost_model.ToArrays(orders, placement),
                              cost_model.CostModel.Unit(len(placement), num_micro_batches))
    step = np.nanmax(ends)
    pending = max(schedule_actions.Peak(order, {schedule_actions.INPUT_GRAD: 1,
                                                schedule_actions.WEIGHT_GRAD: -1})
                  for order in orders)
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
# Schedules of one chunk per device: what a balance plan's stages
# (lingvo_gpipe/insight/planner.py) run.
ONE_CHUNK_SCHEDULES = tuple(name for name, v in _VIRTUAL_STAGES.items() if v == 1)
# Schedules that split each backward into B and W (and so recompute each chunk in B).
SPLIT_SCHEDULES = ('zb_h1', 'zb_h2', 'zbv')
# Schedules whose loss is the whole batch's (the others call it per micro-batch).
WHOLE_BATCH_LOSS = ('gpipe',)


def Orders(name: str, num_stages: int, num_micro_batches: int,
           virtual_stages: int = 1) -> tuple[list[list[schedule_actions.Action]], list[int]]:
  """(per-device action orders, device of each chunk) of schedule `name`, unchecked: what
  Schedule checks and runs, and what the simulator takes for sizes Python cannot time."""
  schedule_actions.CheckSizes(num_stages, num_micro_batches, virtual_stages)
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
