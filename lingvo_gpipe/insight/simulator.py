"""A fast pipeline simulator: step time, bubble and activation memory of a schedule.

Plans beyond this machine rest on it: from each chunk's forward, input-gradient
(B), weight-gradient (W) and fused backward (BW) cost (measured here, or
estimated for other hardware), the time to hand a boundary activation or
gradient to another device, the bytes a device keeps per micro-batch chunk,
K, M and a schedule, it predicts every action's start and end, the step time,
the bubble (idle share of K devices x step time) and each device's peak memory.

The timing is the project's one cost model (lingvo_gpipe/pipeline/cost_model.py): the
same function gives a printed schedule its clock, so a prediction with unit costs is the
schedule's own run; the orders are those of the schedule's program (program.py), what the
executor runs. This module adds the memory each device holds.

No TensorFlow here.
"""

import dataclasses

import numpy as np

from lingvo_gpipe.pipeline import cost_model
from lingvo_gpipe.pipeline import program
from lingvo_gpipe.pipeline import schedule as schedule_lib

# Index of an action kind in the [4, C, M] cost, start and end arrays.
FORWARD, INPUT_GRAD, WEIGHT_GRAD, BACKWARD = (cost_model.FORWARD, cost_model.INPUT_GRAD,
                                              cost_model.WEIGHT_GRAD, cost_model.BACKWARD)


def Orders(name, num_stages, num_micro_batches, virtual_stages=1) -> cost_model.OrderArrays:
  """The per-device orders, as cost_model.OrderArrays, of the program of schedule `name`
  (named_schedules.SCHEDULE_NAMES) for K devices, M micro-batches and v chunks per device."""
  for what, value in (('num_stages', num_stages), ('num_micro_batches', num_micro_batches),
                      ('virtual_stages', virtual_stages)):
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{what} must be a positive int, got {value!r}.')
  prog = program.Lower(schedule_lib.Schedule(name, int(num_stages), int(num_micro_batches),
                                             int(virtual_stages)))
  return prog.Arrays()


def _PerStage(value, num_stages, what):
  """A size as a [K] array, from a scalar or a per-device list."""
  array = np.asarray(value, np.float64)
  if array.ndim > 1 or (array.ndim == 1 and array.shape[0] != num_stages):
    raise ValueError(f'{what} must be a scalar or {num_stages} per-device values, got '
                     f'shape {array.shape}.')
  if not np.all(np.isfinite(array)) or np.any(array < 0):
    raise ValueError(f'{what} must be finite and non-negative, got {value!r}.')
  return np.broadcast_to(array, (num_stages,))


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
  model = cost_model.CostModel.Of(num_chunks, num_micro_batches, forward_cost, backward_cost,
                                  transfer_cost, input_grad_cost, weight_grad_cost)
  start, end = cost_model.Time(orders, model)
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
