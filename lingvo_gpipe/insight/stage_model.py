"""The planner's cost model of a pipeline stage: seconds forward and backward and bytes on
the device of layers j..i-1, from their profiles, under a schedule, remat and remat policy.
Separate from the search (planner.py) and from the plan it finds (balance_plan.py), which
both price stages by it.

A stage's time is forward + backward, plus the recomputed forward with re-materialization
(a split B takes half the backward and the recompute, W the other half: see
lingvo_gpipe/pipeline/weight_grads.py). A device's memory is (2 + optimizer slots) x
parameter bytes (weights, gradients, slots) plus activations: the micro-batches in flight
(schedule.py: M for fill-drain, up to K for 1F1B) times the stage input with
re-materialization, or times the stage's activations without, plus one micro-batch's
activations for the step running; a zero-bubble schedule's pending weight gradients (B ran,
W not yet) each hold up to a micro-batch's activations too. A remat policy inside the cells
(lingvo_gpipe/layers/remat.py) keeps a stage's segment inputs instead of its activations,
plus one segment's activations while the backward runs, and recomputes each segment's
forward once more.
"""

import dataclasses

import numpy as np

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.layers import remat as remat_lib
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules


def Held(schedule, num_stages, num_micro_batches):
  """[P, 2]: each (micro-batches held between forward and input gradient, pending weight
  gradients) that a stage holds at once under `schedule`, of every stage after each action,
  those no other pair exceeds in both. A stage's memory peaks at one of them: the two
  counts peak apart (ZB-H1, K=4: 4 at once on every device, not 4 held + 1 pending on the
  first or 1 + 4 on the last)."""
  held, pending = simulator.Orders(schedule, num_stages, num_micro_batches).HeldCounts()
  # Most held first (and, for equal held, most pending): a pair is kept when its pending
  # exceeds that of every pair before it.
  pairs = np.unique(np.stack([held.ravel(), pending.ravel()], axis=1), axis=0)[::-1]
  most_pending = np.maximum.accumulate(pairs[:, 1])
  return pairs[np.concatenate([[True], pairs[1:, 1] > most_pending[:-1]])]


def Prefix(values):
  """[0, values[0], values[0] + values[1], ...] as float64: stage sums by subtraction."""
  return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])


def ModeledRemat(schedule, remat):
  """The remat a pipeline of `schedule` runs: a split backward's B recomputes its chunk
  whatever remat says (executor.py), its forward keeping only its input, as with 'always'."""
  return 'always' if schedule in named_schedules.SPLIT_SCHEDULES else remat


class StageModel:
  """Time and memory of a stage holding layers j..i-1, vectorized over j."""

  def __init__(self, profiles, held, remat, optimizer_slots, remat_policy=remat_lib.NONE,
               action_overhead_s=0.0):
    if remat not in gpipe.REMAT_MODES:
      raise ValueError(f'Unknown remat {remat!r}; expected one of {list(gpipe.REMAT_MODES)}.')
    self._names = [p.name for p in profiles]
    remat_lib.StageSegments(remat_policy, self._names)  # Checks the policy.
    self._policy = remat_policy
    self._forward = Prefix([p.forward_s for p in profiles])
    self._backward = Prefix([p.backward_s for p in profiles])
    self._params = Prefix([p.param_bytes for p in profiles])
    self._acts = Prefix([p.activation_bytes for p in profiles])
    self._inputs = np.array([p.input_bytes for p in profiles], np.float64)
    self._held = held
    self._remat = remat
    self._model_factor = 2 + optimizer_slots
    self._overhead = action_overhead_s

  def Forward(self, j, i):
    return self._forward[i] - self._forward[j] + self._overhead

  def Backward(self, j, i):
    """Backward seconds, with the recomputed forward when the stage re-materializes, and
    another for the segments of a remat policy."""
    recomputes = (self._remat != 'never') + (self._policy != remat_lib.NONE)
    forward = self._forward[i] - self._forward[j]
    return self._backward[i] - self._backward[j] + recomputes * forward + self._overhead

  def InputGrad(self, j, i):
    """A split B: the recomputes and half the backward."""
    return self.Backward(j, i) - (self._backward[i] - self._backward[j]) / 2

  def WeightGrad(self, j, i):
    """A split W: the other half of the backward, taken from the tensors B handed over
    (lingvo_gpipe/pipeline/weight_grads.py)."""
    return (self._backward[i] - self._backward[j]) / 2 + self._overhead

  def Time(self, j, i):
    return self.Forward(j, i) + self.Backward(j, i)

  def _Kept(self, j, i):
    """(bytes a micro-batch's forward keeps for its backward, bytes its backward adds while
    it runs) of stages j..i-1: all activations and 0, or with a remat policy, the segment
    inputs and the largest segment's activations."""

    def One(start):
      segments = remat_lib.StageSegments(self._policy, self._names, start, i)
      if not segments:
        return self._acts[i] - self._acts[start], 0.0
      return (sum(self._inputs[a] for a, _ in segments),
              max(self._acts[b] - self._acts[a] for a, b in segments))

    return np.vectorize(One, otypes=[np.float64, np.float64])(j)

  def _Activations(self, in_flight, pending, inputs, kept):
    """Bytes of `in_flight` forwarded micro-batches and `pending` Ws (a pending W holds
    what its B recomputed)."""
    if self._remat == 'never':
      held = in_flight * kept
    elif self._remat == 'always':
      held = in_flight * inputs + kept
    else:  # except_last: the last micro-batch keeps its activations.
      held = (in_flight - 1) * inputs + 2 * kept
    return held + pending * kept

  def HeldPerMicroBatch(self, j, i):
    """Bytes a micro-batch holds between its forward and its backward: the stage's input
    when it re-materializes, else what its forward keeps."""
    return float(self._inputs[j] if self._remat != 'never' else self._Kept(j, i)[0])

  def Memory(self, j, i):
    kept, running = self._Kept(j, i)
    inputs = self._inputs[np.asarray(j)]
    activations = np.max([self._Activations(h, p, inputs, kept) for h, p in self._held], axis=0)
    return self._model_factor * (self._params[i] - self._params[j]) + activations + running


def Scaled(profiles, factor):
  """Profiles at `factor` times the rows: time and activations taken as linear in the rows
  (small micro-batches run less efficiently than this assumes)."""
  return [dataclasses.replace(p, forward_s=p.forward_s * factor, backward_s=p.backward_s * factor,
                              input_bytes=int(p.input_bytes * factor),
                              activation_bytes=int(p.activation_bytes * factor))
          for p in profiles]
