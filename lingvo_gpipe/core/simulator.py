"""A fast pipeline simulator: step time, bubble and activation memory of a schedule.

Plans beyond this machine rest on it: from each stage's forward and backward
cost (measured here, or estimated for other hardware), the time to hand a
boundary activation to the next device, the bytes a stage keeps per micro-batch
in flight, K, M and a schedule, it predicts every step's start and end, the
step time, the bubble (idle share of K devices x step time) and each stage's
peak activation memory.

Schedule semantics come from schedule.py alone: the per-stage orders are its
orders, and a step waits for its stage's previous step and for the same pass of
the same micro-batch on the neighbouring stage (F(m, k) after F(m, k-1), B(m, k)
after B(m, k+1)), as in schedule.Simulate. Where schedule.Simulate loops over
steps in Python, here every stage advances at once with numpy, one loop round
per clock of the unit-cost schedule (about 2(M + K) rounds), so K=1024, M=8192
(16.8M steps) takes seconds.

No TensorFlow here.
"""

import dataclasses

import numpy as np

from lingvo_gpipe.core import schedule as schedule_lib

FORWARD, BACKWARD = 0, 1  # Index of a pass in the [2, K, M] arrays.


@dataclasses.dataclass
class OrderArrays:
  """Per-stage orders as arrays; row k is stage k's steps in execution order.

  micro_batch: [K, S] int32 micro-batch of each step (-1 pads a shorter stage).
  backward: [K, S] bool, True for a backward step.
  length: [K] number of steps of each stage.
  """
  micro_batch: np.ndarray
  backward: np.ndarray
  length: np.ndarray

  @property
  def num_stages(self):
    return self.micro_batch.shape[0]

  @property
  def num_micro_batches(self):
    return int(self.micro_batch.max()) + 1 if self.micro_batch.size else 0

  def MaxInFlight(self):
    """[K]: most micro-batches a stage has forwarded but not backwarded (Schedule.MaxInFlight)."""
    live = np.where(self.micro_batch < 0, 0, np.where(self.backward, -1, 1)).astype(np.int32)
    return np.maximum(np.cumsum(live, axis=1).max(axis=1, initial=0), 0)


def ToArrays(orders):
  """schedule.py's orders (per stage, a list of (micro_batch, kind)) as OrderArrays."""
  num_stages = len(orders)
  width = max((len(order) for order in orders), default=0)
  micro_batch = np.full((num_stages, width), -1, np.int32)
  backward = np.zeros((num_stages, width), bool)
  for k, order in enumerate(orders):
    if k and order == orders[k - 1]:  # Fill-drain: every stage runs the same order.
      micro_batch[k], backward[k] = micro_batch[k - 1], backward[k - 1]
      continue
    n = len(order)
    micro_batch[k, :n] = np.fromiter((m for m, _ in order), np.int32, n)
    backward[k, :n] = np.fromiter((kind == schedule_lib.BACKWARD for _, kind in order), bool, n)
  return OrderArrays(micro_batch, backward, np.array([len(o) for o in orders], np.int64))


def Orders(name, num_stages, num_micro_batches):
  """The orders of schedule `name` (schedule.SCHEDULE_NAMES) for K stages, M micro-batches."""
  # Validates the name and sizes the way the runtime does, without simulating it.
  if name not in schedule_lib.SCHEDULE_NAMES:
    raise ValueError(f'Unknown schedule {name!r}; expected one of '
                     f'{list(schedule_lib.SCHEDULE_NAMES)}.')
  for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{what} must be a positive int, got {value!r}.')
  # pylint: disable=protected-access
  return ToArrays(schedule_lib._ORDERS[name](int(num_stages), int(num_micro_batches)))


def _PerStep(value, num_stages, num_micro_batches, what):
  """A cost or size as a [K, M] array: from a scalar, a [K] per-stage list or a [K, M] array."""
  array = np.asarray(value, np.float64)
  if array.ndim == 1:
    if array.shape[0] != num_stages:
      raise ValueError(f'{what} has {array.shape[0]} per-stage values for {num_stages} stages.')
    array = array[:, None]
  elif array.ndim == 2 and array.shape != (num_stages, num_micro_batches):
    raise ValueError(f'{what} has shape {array.shape}; expected [K, M] = '
                     f'[{num_stages}, {num_micro_batches}].')
  elif array.ndim > 2:
    raise ValueError(f'{what} must be a scalar, [K] or [K, M], got shape {array.shape}.')
  if not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'{what} must be finite and non-negative, got {value!r}.')
  return np.broadcast_to(array, (num_stages, num_micro_batches))


def _PerStage(value, num_stages, what):
  """A size as a [K] array, from a scalar or a per-stage list."""
  array = np.asarray(value, np.float64)
  if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != num_stages):
    raise ValueError(f'{what} must be a scalar or {num_stages} per-stage values, got '
                     f'shape {array.shape}.')
  if not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'{what} must be finite and non-negative, got {value!r}.')
  return np.broadcast_to(array, (num_stages,))


def _Transfers(value, num_stages):
  """Hand-over time of each boundary k -> k+1 as a [K] array (the last entry unused)."""
  array = np.asarray(value, np.float64)
  if array.ndim == 1 and array.shape[0] != max(num_stages - 1, 0):
    raise ValueError(f'transfer_cost has {array.shape[0]} values for {num_stages - 1} stage '
                     'boundaries.')
  if array.ndim > 1 or not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'transfer_cost must be a finite non-negative scalar or per-boundary '
                     f'list, got {value!r}.')
  return np.append(np.broadcast_to(array, (max(num_stages - 1, 0),)), 0.0)


def _Timeline(orders, costs, transfers):
  """end [2, K, M] of every step (pass, stage, micro-batch); NaN for steps not run.

  Each round, every stage whose next step's dependency has ended runs it:
  start = max(the stage's previous end, dependency end + hand-over). Ends are
  kept in a [2, K + 2, M] array whose rows 0 and K + 1 are the ends (0) of
  the stages before the first and after the last, so F(m, 0) and
  B(m, K - 1) need no special case: a dependency is the entry M away.
  """
  micro_batch, backward, length = orders.micro_batch, orders.backward, orders.length
  num_stages, width = micro_batch.shape
  rows, num_micro_batches = num_stages + 2, orders.num_micro_batches
  end = np.full((2, rows, num_micro_batches), np.nan)
  end[0, 0], end[1, -1] = 0.0, 0.0
  end = end.ravel()
  cost = np.zeros((2, rows, num_micro_batches))
  cost[:, 1:-1] = costs
  cost = cost.ravel()
  # hop[pass, k]: F(m, k) comes over boundary k-1, B(m, k) over boundary k.
  hop = np.stack([np.append(0.0, transfers[:-1]), transfers]).ravel()
  with_hops = bool(np.any(hop))
  micro_batch, backward = micro_batch.ravel(), backward.ravel()
  position = np.zeros(num_stages, np.int64)
  free = np.zeros(num_stages)
  active = np.flatnonzero(length > 0)
  while active.size:
    flat = active * width + position[active]
    kind = backward[flat].astype(np.int64)
    own = (kind * rows + active + 1) * num_micro_batches + micro_batch[flat]
    arrival = end[own + (2 * kind - 1) * num_micro_batches]
    if with_hops:
      arrival += hop[kind * num_stages + active]
    ready = ~np.isnan(arrival)
    if not ready.all():
      if not ready.any():
        waiting = [(int(k), int(micro_batch[k * width + position[k]]),
                    'B' if backward[k * width + position[k]] else 'F') for k in active[:8]]
        raise ValueError(f'Schedule deadlocks; (stage, micro_batch, pass) wait forever: '
                         f'{waiting}.')
      running, own, arrival = active[ready], own[ready], arrival[ready]
    else:
      running = active
    free[running] = end[own] = np.maximum(free[running], arrival) + cost[own]
    position[running] += 1
    if (position[running] == length[running]).any():
      active = np.flatnonzero(position < length)
  return end.reshape(2, rows, num_micro_batches)[:, 1:-1]


@dataclasses.dataclass
class Prediction:
  """What a schedule does with given costs; times in the costs' unit, sizes in bytes.

  step_time: end of the last step (the first starts at 0).
  bubble_fraction: 1 - busy.sum() / (K * step_time).
  busy: [K] time each stage computes; idle: [K] step_time - busy.
  max_in_flight: [K] micro-batches a stage holds between forward and backward.
  peak_activation_bytes: [K] max_in_flight * activation_bytes + step_bytes.
  start, end: [2, K, M] times of every step (pass FORWARD=0 / BACKWARD=1,
    stage, micro-batch).
  """
  step_time: float
  bubble_fraction: float
  busy: np.ndarray
  idle: np.ndarray
  max_in_flight: np.ndarray
  peak_activation_bytes: np.ndarray
  start: np.ndarray
  end: np.ndarray


def Simulate(orders, forward_cost=1.0, backward_cost=1.0, transfer_cost=0.0,
             activation_bytes=0.0, step_bytes=0.0):
  """Predicts a pipelined step.

  Args:
    orders: OrderArrays (see Orders), or schedule.py's per-stage order lists.
    forward_cost, backward_cost: time of one micro-batch's pass through a
      stage: a scalar, a [K] per-stage list, or a [K, M] array. The backward
      includes the recompute when the stage re-materializes.
    transfer_cost: time from a step's end until its output can start the next
      step on the neighbouring stage: a scalar or [K-1] per boundary.
    activation_bytes: what a stage keeps per micro-batch between its forward
      and backward (the boundary input with re-materialization, all of the
      cell's activations without): scalar or [K].
    step_bytes: transient bytes of one step (a re-materialized cell's
      activations during its backward): scalar or [K].

  Returns:
    A Prediction.
  """
  if not isinstance(orders, OrderArrays):
    orders = ToArrays(orders)
  num_stages, num_micro_batches = orders.num_stages, orders.num_micro_batches
  if num_stages == 0 or num_micro_batches == 0:
    raise ValueError(f'Nothing to simulate: {num_stages} stages, {num_micro_batches} '
                     'micro-batches.')
  costs = np.stack([_PerStep(forward_cost, num_stages, num_micro_batches, 'forward_cost'),
                    _PerStep(backward_cost, num_stages, num_micro_batches, 'backward_cost')])
  end = _Timeline(orders, costs, _Transfers(transfer_cost, num_stages))
  start = end - costs
  step_time = float(np.nanmax(end))
  busy = np.nansum(end - start, axis=(0, 2))
  bubble = 1.0 - busy.sum() / (num_stages * step_time) if step_time > 0 else 0.0
  in_flight = orders.MaxInFlight()
  kept = _PerStage(activation_bytes, num_stages, 'activation_bytes')
  transient = _PerStage(step_bytes, num_stages, 'step_bytes')
  peak = np.where(orders.length > 0, in_flight * kept + transient, 0.0)
  return Prediction(step_time=step_time, bubble_fraction=float(bubble), busy=busy,
                    idle=step_time - busy, max_in_flight=in_flight, peak_activation_bytes=peak,
                    start=start, end=end)
