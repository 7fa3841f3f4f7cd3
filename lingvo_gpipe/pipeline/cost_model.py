"""What each action of a pipeline costs, and the one timing of per-device orders under it.

Every clock of the project comes from `Time`: the unit-cost run a Schedule prints
(F, B and W one unit, BW two, the loss and the hand-overs nothing), the choice among
ZB-V's candidate orders, and the simulator's and the planner's predictions from measured
or estimated costs (lingvo_gpipe/insight/simulator.py). A CostModel gives each action a
duration per chunk and micro-batch, and each hand-over between chunks on different
devices (a program's send, program.py) a delay. Each device runs its order; an action
starts once its device's previous action has ended and F(m, c-1) (a forward) or
B(m, c+1) (B and BW) has ended and been handed over. What else an action waits for (its
own chunk's forward, the loss, a W's B) ran before it on its device (CheckOrders' rules),
and a loss takes no time, so losses are left out.

All devices advance at once with numpy, one round per action of a device: Python loops
over the longest order, not over every action, so deep pipelines of many micro-batches
time quickly. No TensorFlow here.
"""

import dataclasses

import numpy as np

from lingvo_gpipe.pipeline import schedule_actions

# Index of an action kind in the [4, C, M] cost, start and end arrays.
FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD = 0, 1, 2, 3
CODES = {schedule_actions.FORWARD: FORWARD, schedule_actions.INPUT_GRAD: INPUT_GRAD,
         schedule_actions.WEIGHT_GRAD: WEIGHT_GRAD, schedule_actions.BACKWARD: BACKWARD}
# The unit-cost run's durations: what a printed schedule's clock counts.
UNIT_COSTS = {schedule_actions.FORWARD: 1, schedule_actions.INPUT_GRAD: 1,
              schedule_actions.WEIGHT_GRAD: 1, schedule_actions.BACKWARD: 2,
              schedule_actions.LOSS: 0}


def _PerStep(value, num_chunks, num_micro_batches, what):
  """A cost as a [C, M] array: from a scalar, a [C] per-chunk list or a [C, M] array."""
  array = np.asarray(value, np.float64)
  if array.ndim == 1:
    if array.shape[0] != num_chunks:
      raise ValueError(f'{what} has {array.shape[0]} per-chunk values for {num_chunks} chunks.')
    array = array[:, None]
  elif array.ndim == 2 and array.shape != (num_chunks, num_micro_batches):
    raise ValueError(f'{what} has shape {array.shape}; expected [C, M] = '
                     f'[{num_chunks}, {num_micro_batches}].')
  elif array.ndim > 2:
    raise ValueError(f'{what} must be a scalar, [C] or [C, M], got shape {array.shape}.')
  if not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'{what} must be finite and non-negative, got {value!r}.')
  return np.broadcast_to(array, (num_chunks, num_micro_batches))


def _PerBoundary(value, num_chunks):
  """A hand-over time as a [C-1] array, from a scalar or a per-boundary list."""
  array = np.asarray(value, np.float64)
  if array.ndim == 1 and array.shape[0] != max(num_chunks - 1, 0):
    raise ValueError(f'transfer_cost has {array.shape[0]} values for {num_chunks - 1} chunk '
                     'boundaries.')
  if array.ndim > 1 or not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'transfer_cost must be a finite non-negative scalar or per-boundary '
                     f'list, got {value!r}.')
  return np.broadcast_to(array, (max(num_chunks - 1, 0),))


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Durations of every action, [4, C, M] (kind FORWARD.. BACKWARD, chunk, micro-batch), and
  the delay of the hand-over across each chunk boundary, [C-1] (counted only where the two
  chunks sit on different devices: where a program sends)."""
  costs: np.ndarray
  transfer: np.ndarray

  @classmethod
  def Of(cls, num_chunks: int, num_micro_batches: int, forward_cost=1.0, backward_cost=1.0,
         transfer_cost=0.0, input_grad_cost=None, weight_grad_cost=None) -> 'CostModel':
    """From scalars, [C] per-chunk lists or [C, M] arrays (simulator.Simulate's arguments);
    a split B and W default to half the fused backward each."""
    size = (num_chunks, num_micro_batches)
    backward = _PerStep(backward_cost, *size, 'backward_cost')

    def Half(value, what):
      return backward / 2 if value is None else _PerStep(value, *size, what)

    costs = np.stack([_PerStep(forward_cost, *size, 'forward_cost'),
                      Half(input_grad_cost, 'input_grad_cost'),
                      Half(weight_grad_cost, 'weight_grad_cost'), backward])
    return cls(costs, _PerBoundary(transfer_cost, num_chunks))

  @classmethod
  def Unit(cls, num_chunks: int, num_micro_batches: int) -> 'CostModel':
    """UNIT_COSTS: the clock a printed schedule counts."""
    unit = UNIT_COSTS
    return cls.Of(num_chunks, num_micro_batches, unit[schedule_actions.FORWARD],
                  unit[schedule_actions.BACKWARD], 0.0, unit[schedule_actions.INPUT_GRAD],
                  unit[schedule_actions.WEIGHT_GRAD])


@dataclasses.dataclass
class OrderArrays:
  """Per-device orders as arrays; row k is device k's actions in execution order (losses,
  which take no time, left out).

  kind: [K, S] int8 action kind (FORWARD.. BACKWARD; -1 pads a shorter row).
  micro_batch, chunk: [K, S] int32.
  length: [K] number of actions of each device.
  placement: [C] device of each chunk.
  """
  kind: np.ndarray
  micro_batch: np.ndarray
  chunk: np.ndarray
  length: np.ndarray
  placement: np.ndarray

  @property
  def num_stages(self):
    return self.kind.shape[0]

  @property
  def num_chunks(self):
    return len(self.placement)

  @property
  def num_micro_batches(self):
    return int(self.micro_batch.max()) + 1 if self.micro_batch.size else 0

  def _Live(self, change):
    """[K, S]: a count after each action of each device, each kind changing it by change[kind]."""
    live = np.zeros(self.kind.shape, np.int32)
    for kind, delta in change.items():
      live[self.kind == kind] = delta
    return np.cumsum(live, axis=1)

  def _Peak(self, change):
    return np.maximum(self._Live(change).max(axis=1, initial=0), 0)

  def HeldCounts(self):
    """([K, S] micro-batch chunks held between forward and input gradient, [K, S] pending
    Ws) after each action of each device. A device's memory peaks where their weighted sum
    does: in ZB-H1 the two maxima do not coincide (K=4: 4 at once on every device, not 4
    held + 1 pending on the first or 1 + 4 on the last)."""
    return (self._Live({FORWARD: 1, INPUT_GRAD: -1, BACKWARD: -1}),
            self._Live({INPUT_GRAD: 1, WEIGHT_GRAD: -1}))

  def MaxInFlight(self):
    """[K]: most micro-batch chunks whose activations a device holds (forwarded, input
    gradient not yet taken; Schedule.MaxInFlight)."""
    return self._Peak({FORWARD: 1, INPUT_GRAD: -1, BACKWARD: -1})

  def MaxPendingWeightGrads(self):
    """[K]: most micro-batch chunks whose B ran and W did not."""
    return self._Peak({INPUT_GRAD: 1, WEIGHT_GRAD: -1})


def ToArrays(orders: list[list[schedule_actions.Action]], placement=None) -> OrderArrays:
  """Per-device orders (lists of Actions) as OrderArrays; placement defaults to chunk k on
  device k."""
  num_stages = len(orders)
  rows = [[a for a in order if a.kind != schedule_actions.LOSS] for order in orders]
  width = max((len(row) for row in rows), default=0)
  kind = np.full((num_stages, width), -1, np.int8)
  micro_batch = np.full((num_stages, width), -1, np.int32)
  chunk = np.zeros((num_stages, width), np.int32)
  for k, row in enumerate(rows):
    n = len(row)
    kind[k, :n] = np.fromiter((CODES[a.kind] for a in row), np.int8, n)
    micro_batch[k, :n] = np.fromiter((a.micro_batch for a in row), np.int32, n)
    chunk[k, :n] = np.fromiter((a.chunk for a in row), np.int32, n)
  if placement is None:
    placement = range(num_stages)
  return OrderArrays(kind, micro_batch, chunk, np.array([len(r) for r in rows], np.int64),
                     np.asarray(placement, np.int64))


def _Hops(transfer, placement):
  """[2, C]: the hand-over before F(m, c) (from chunk c-1) and before B(m, c) (from chunk
  c+1); 0 between chunks that share a device."""
  boundary = transfer * (placement[1:] != placement[:-1])
  return np.stack([np.append(0.0, boundary), np.append(boundary, 0.0)])


def Time(orders: OrderArrays, model: CostModel) -> tuple[np.ndarray, np.ndarray]:
  """(start, end), each [4, C, M], of every action (kind, chunk, micro-batch); NaN for
  actions not run. Raises ValueError if the orders deadlock.

  Each round, every device whose next action's dependency has ended runs it:
  start = max(the device's previous end, dependency end + hand-over). What
  actions wait for is kept in `ready` [3, C + 2, M]: plane 0 the forwards' ends
  (row c + 1 for chunk c, row 0 zeros: F(m, 0) waits for nothing), plane 1 the
  input gradients' (B or BW; row C + 1 zeros, for the last chunk's), plane 2
  where Ws write; a W waits for ready[0, 0, 0] = 0, as its B ran before it on
  its device.
  """
  kind, micro_batch, chunk, length = orders.kind, orders.micro_batch, orders.chunk, orders.length
  num_stages, width = kind.shape
  num_chunks, num_micro_batches = orders.num_chunks, orders.num_micro_batches
  if model.costs.shape != (4, num_chunks, num_micro_batches):
    raise ValueError(f'Costs of shape {model.costs.shape} for orders of {num_chunks} chunks '
                     f'and {num_micro_batches} micro-batches.')
  hops = _Hops(model.transfer, orders.placement)
  rows = num_chunks + 2
  ready = np.full((3, rows, num_micro_batches), np.nan)
  ready[0, 0], ready[1, -1] = 0.0, 0.0
  ready = ready.ravel()
  end = np.full((4, num_chunks, num_micro_batches), np.nan).ravel()
  cost = model.costs.ravel()
  hop = np.concatenate([hops, np.zeros((2, num_chunks))]).ravel()  # [4, C]: W, BW filled below.
  hop[BACKWARD * num_chunks:] = hops[1]
  hop[WEIGHT_GRAD * num_chunks:(WEIGHT_GRAD + 1) * num_chunks] = 0.0
  with_hops = bool(np.any(hops))
  # Per kind: the plane and row offset (from chunk c) an action waits on, and writes to.
  wait_plane, wait_row = np.array([0, 1, 0, 1]), np.array([0, 2, 0, 2])
  write_plane = np.array([0, 1, 2, 1])
  kind, micro_batch, chunk = kind.ravel().astype(np.int64), micro_batch.ravel(), chunk.ravel()
  position = np.zeros(num_stages, np.int64)
  free = np.zeros(num_stages)
  active = np.flatnonzero(length > 0)
  while active.size:
    flat = active * width + position[active]
    k, m, c = kind[flat], micro_batch[flat], chunk[flat]
    is_w = k == WEIGHT_GRAD
    wait = np.where(is_w, 0, (wait_plane[k] * rows + c + wait_row[k]) * num_micro_batches + m)
    arrival = ready[wait]
    if with_hops:
      arrival = arrival + hop[k * num_chunks + c]
    ok = ~np.isnan(arrival)
    if not ok.all():
      if not ok.any():
        waiting = [f'device {d} at {schedule_actions.KINDS[kind[i]]}{micro_batch[i]}@{chunk[i]}'
                   for d, i in zip(active[:8], flat[:8])]
        raise ValueError(f'The orders deadlock: {", ".join(waiting)} wait forever.')
      active, k, m, c, arrival = active[ok], k[ok], m[ok], c[ok], arrival[ok]
    own = (k * num_chunks + c) * num_micro_batches + m
    done = np.maximum(free[active], arrival) + cost[own]
    free[active] = end[own] = done
    ready[(write_plane[k] * rows + c + 1) * num_micro_batches + m] = done
    position[active] += 1
    active = np.flatnonzero(position < length)
  end = end.reshape(4, num_chunks, num_micro_batches)
  return end - model.costs, end
