"""A fast pipeline simulator: step time, bubble and activation memory of a schedule.

Plans beyond this machine rest on it: from each chunk's forward, input-gradient
(B), weight-gradient (W) and fused backward (BW) cost (measured here, or
estimated for other hardware), the time to hand a boundary activation or
gradient to another device, the bytes a device keeps per micro-batch chunk,
K, M and a schedule, it predicts every action's start and end, the step time,
the bubble (idle share of K devices x step time) and each device's peak memory.

Schedule semantics come from schedule_actions.py alone: each device runs its order, and
an action waits for its device's previous action and for F(m, c-1) (a forward)
or for B(m, c+1) (B and BW), plus the hand-over when that ran on another device.
What else an action needs (its own chunk's forward, the loss, a W's B) ran
before it on the same device. The loss costs nothing here. Where
schedule_actions.Simulate loops over actions in Python, every device advances at once
with numpy, one loop round per action of a device, so Python loops over the
longest order, not over every action, and deep pipelines of many micro-batches
stay quick to simulate.

No TensorFlow here.
"""

import dataclasses

import numpy as np

from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import schedule_actions

# Index of an action kind in the [4, C, M] cost, start and end arrays.
FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD = 0, 1, 2, 3
_CODES = {schedule_actions.FORWARD: FORWARD, schedule_actions.INPUT_GRAD: INPUT_GRAD,
          schedule_actions.WEIGHT_GRAD: WEIGHT_GRAD, schedule_actions.BACKWARD: BACKWARD}


@dataclasses.dataclass
class OrderArrays:
  """Per-device orders as arrays; row k is device k's actions in execution order (losses,
  which cost nothing, left out).

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


def ToArrays(orders, placement=None):
  """schedule.py's orders (per device, a list of Actions) as OrderArrays; placement
  defaults to chunk k on device k."""
  num_stages = len(orders)
  rows = [[a for a in order if a.kind != schedule_actions.LOSS] for order in orders]
  width = max((len(row) for row in rows), default=0)
  kind = np.full((num_stages, width), -1, np.int8)
  micro_batch = np.full((num_stages, width), -1, np.int32)
  chunk = np.zeros((num_stages, width), np.int32)
  for k, row in enumerate(rows):
    n = len(row)
    kind[k, :n] = np.fromiter((_CODES[a.kind] for a in row), np.int8, n)
    micro_batch[k, :n] = np.fromiter((a.micro_batch for a in row), np.int32, n)
    chunk[k, :n] = np.fromiter((a.chunk for a in row), np.int32, n)
  if placement is None:
    placement = range(num_stages)
  return OrderArrays(kind, micro_batch, chunk, np.array([len(r) for r in rows], np.int64),
                     np.asarray(placement, np.int64))


def Orders(name, num_stages, num_micro_batches, virtual_stages=1):
  """The OrderArrays of schedule `name` (named_schedules.SCHEDULE_NAMES) for K devices, M
  micro-batches and v chunks per device."""
  for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches),
                      ('virtual_stages', virtual_stages)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{what} must be a positive int, got {value!r}.')
  orders, placement = named_schedules.Orders(name, int(num_stages), int(num_micro_batches),
                                             int(virtual_stages))
  return ToArrays(orders, placement)


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


def _PerStage(value, num_stages, what):
  """A size as a [K] array, from a scalar or a per-device list."""
  array = np.asarray(value, np.float64)
  if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != num_stages):
    raise ValueError(f'{what} must be a scalar or {num_stages} per-device values, got '
                     f'shape {array.shape}.')
  if not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'{what} must be finite and non-negative, got {value!r}.')
  return np.broadcast_to(array, (num_stages,))


def _Hops(value, placement):
  """[2, C]: the hand-over before F(m, c) (from chunk c-1) and before B(m, c) (from chunk
  c+1), from a scalar or a per-boundary [C-1] transfer_cost; 0 between chunks that share a
  device."""
  num_chunks = len(placement)
  array = np.asarray(value, np.float64)
  if array.ndim == 1 and array.shape[0] != max(num_chunks - 1, 0):
    raise ValueError(f'transfer_cost has {array.shape[0]} values for {num_chunks - 1} chunk '
                     'boundaries.')
  if array.ndim > 1 or not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'transfer_cost must be a finite non-negative scalar or per-boundary '
                     f'list, got {value!r}.')
  boundary = np.broadcast_to(array, (max(num_chunks - 1, 0),)) * (
      placement[1:] != placement[:-1])
  return np.stack([np.append(0.0, boundary), np.append(boundary, 0.0)])


def _Timeline(orders, costs, hops):
  """end [4, C, M] of every action (kind, chunk, micro-batch); NaN for actions not run.

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
  rows = num_chunks + 2
  ready = np.full((3, rows, num_micro_batches), np.nan)
  ready[0, 0], ready[1, -1] = 0.0, 0.0
  ready = ready.ravel()
  end = np.full((4, num_chunks, num_micro_batches), np.nan).ravel()
  cost = costs.ravel()
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
        names = 'FBW'
        waiting = [f'device {d}: {("BW" if kind[i] == BACKWARD else names[kind[i]])}'
                   f'{micro_batch[i]}@{chunk[i]}' for d, i in zip(active[:8], flat[:8])]
        raise ValueError(f'Schedule deadlocks; these wait forever: {waiting}.')
      active, k, m, c, arrival = active[ok], k[ok], m[ok], c[ok], arrival[ok]
    own = (k * num_chunks + c) * num_micro_batches + m
    done = np.maximum(free[active], arrival) + cost[own]
    free[active] = end[own] = done
    ready[(write_plane[k] * rows + c + 1) * num_micro_batches + m] = done
    position[active] += 1
    active = np.flatnonzero(position < length)
  return end.reshape(4, num_chunks, num_micro_batches)


@dataclasses.dataclass
class Prediction:
  """What a schedule does with given costs; times in the costs' unit, sizes in bytes.

  step_time: end of the last action (the first starts at 0).
  bubble_fraction: 1 - busy.sum() / (K * step_time).
  busy: [K] time each device computes; idle: [K] step_time - busy.
  max_in_flight: [K] micro-batch chunks a device holds between forward and input gradient.
  max_pending_weight_grads: [K] micro-batch chunks between B and W.
  peak_activation_bytes: [K] the most, over a device's order, of the chunks it holds x
    activation_bytes + its pending Ws x weight_grad_bytes, plus step_bytes.
  start, end: [4, C, M] times of every action (kind FORWARD, INPUT_GRAD,
    WEIGHT_GRAD, BACKWARD; chunk; micro-batch), NaN where none ran.
  placement: [C] device of each chunk.
  """
  step_time: float
  bubble_fraction: float
  busy: np.ndarray
  idle: np.ndarray
  max_in_flight: np.ndarray
  max_pending_weight_grads: np.ndarray
  peak_activation_bytes: np.ndarray
  start: np.ndarray
  end: np.ndarray
  placement: np.ndarray


def Simulate(orders, forward_cost=1.0, backward_cost=1.0, transfer_cost=0.0,
             activation_bytes=0.0, step_bytes=0.0, input_grad_cost=None, weight_grad_cost=None,
             weight_grad_bytes=None):
  """Predicts a pipelined step.

  Args:
    orders: OrderArrays (see Orders).
    forward_cost, backward_cost: time of one micro-batch's forward and fused
      backward (BW) through a chunk: a scalar, a [C] per-chunk list, or a [C, M]
      array. The backward includes the recompute when the chunk re-materializes.
    transfer_cost: time from an action's end until its output can start the
      next chunk's action on another device: a scalar or [C-1] per boundary.
    activation_bytes: what a device keeps per micro-batch chunk between its
      forward and backward (the boundary input with re-materialization, all of
      the cell's activations without): scalar or [K].
    step_bytes: transient bytes of one action (a re-materialized cell's
      activations during its backward): scalar or [K].
    input_grad_cost, weight_grad_cost: time of a split B and W (scalar, [C] or
      [C, M]); default half the backward each.
    weight_grad_bytes: what a pending W holds (scalar or [K]); default
      activation_bytes.

  Returns:
    A Prediction.
  """
  num_stages, num_micro_batches = orders.num_stages, orders.num_micro_batches
  num_chunks = orders.num_chunks
  if num_stages == 0 or num_micro_batches == 0:
    raise ValueError(f'Nothing to simulate: {num_stages} devices, {num_micro_batches} '
                     'micro-batches.')
  size = (num_chunks, num_micro_batches)
  backward = _PerStep(backward_cost, *size, 'backward_cost')
  costs = np.stack([
      _PerStep(forward_cost, *size, 'forward_cost'),
      backward / 2 if input_grad_cost is None else _PerStep(input_grad_cost, *size,
                                                            'input_grad_cost'),
      backward / 2 if weight_grad_cost is None else _PerStep(weight_grad_cost, *size,
                                                             'weight_grad_cost'),
      backward])
  end = _Timeline(orders, costs, _Hops(transfer_cost, orders.placement))
  start = end - costs
  step_time = float(np.nanmax(end))
  busy_chunk = np.nansum(end - start, axis=(0, 2))
  busy = np.bincount(orders.placement, busy_chunk, minlength=num_stages)
  bubble = 1.0 - busy.sum() / (num_stages * step_time) if step_time > 0 else 0.0
  in_flight, pending = orders.MaxInFlight(), orders.MaxPendingWeightGrads()
  kept = _PerStage(activation_bytes, num_stages, 'activation_bytes')
  held = kept if weight_grad_bytes is None else _PerStage(weight_grad_bytes, num_stages,
                                                          'weight_grad_bytes')
  transient = _PerStage(step_bytes, num_stages, 'step_bytes')
  held_now, pending_now = orders.HeldCounts()
  at_once = np.maximum((held_now * kept[:, None] + pending_now * held[:, None]).max(
      axis=1, initial=0), 0)
  peak = np.where(orders.length > 0, at_once + transient, 0.0)
  return Prediction(step_time=step_time, bubble_fraction=float(bubble), busy=busy,
                    idle=step_time - busy, max_in_flight=in_flight,
                    max_pending_weight_grads=pending, peak_activation_bytes=peak,
                    start=start, end=end, placement=orders.placement)
