"""Balance planner: split layers into K stages by measured time, under a memory cap per device.

1. Profile once (profiler.ProfileLayers; PipelineProfiles for a pipeline's
   params): each layer's forward and backward seconds at
   the micro-batch size, its parameter bytes, the bytes of its input (what a
   stage keeps per micro-batch with re-materialization, if the layer starts
   the stage) and its activation bytes (the allocator peak of its forward and
   backward above the live set, less its weight gradients: what it holds for
   its backward).
2. Plan (MakePlan, numpy only): each stage priced by stage_model.StageModel, the
   plan is the contiguous split minimising the slowest stage among those whose
   every stage fits the cap (then the most even one, as partition.Balance does),
   and the simulator predicts its step. ChoosePlan also picks M, the schedule,
   remat and the remat policy: the candidate with the best predicted step time
   that fits, next to the others and why they lost.
3. The plan found is a balance_plan.Plan: saved and loaded as JSON, and applied
   to params (balance_plan.ApplyPlan, the trainer's --balance_file).
"""

import dataclasses
import itertools

import numpy as np

from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.insight import stage_model
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.layers import remat as remat_lib
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import partition
from lingvo_gpipe.pipeline import pipeline_params


# -- planning (no TensorFlow) --------------------------------------------------------------


def _Size(num_bytes):
  """'19 bytes', '1.5 KiB', '64.0 MiB' or '2.25 GiB'."""
  for unit, scale in (('GiB', 2**30), ('MiB', 2**20), ('KiB', 2**10)):
    if num_bytes >= scale:
      return f'{num_bytes / scale:.{2 if unit == "GiB" else 1}f} {unit}'
  return f'{num_bytes:.4g} bytes'


class NoFitError(ValueError):
  """No split into the stages asked for fits the memory cap; `need` is the leanest split's
  bytes on its fullest device."""

  def __init__(self, message, need):
    super().__init__(message)
    self.need = need


# Schedules a plan can take: one chunk per device, as the plan's stages are.
PLANNABLE_SCHEDULES = named_schedules.ONE_CHUNK_SCHEDULES
# Predicted step times this close to the fastest are a tie, which the least memory wins:
# profiles differ by more than this from run to run.
TIE_FRACTION = 0.005


def _Merge(profiles, glued):
  """(units, ends): profiles with each layer index in `glued` merged into the one before,
  and the end (exclusive) of each unit in layer indices."""
  merged, ends = [], []
  for i, p in enumerate(profiles):
    if i in glued and merged:
      last = merged[-1]
      merged[-1] = dataclasses.replace(
          last, name=f'{last.name}+{p.name}', forward_s=last.forward_s + p.forward_s,
          backward_s=last.backward_s + p.backward_s,
          param_bytes=last.param_bytes + p.param_bytes,
          activation_bytes=last.activation_bytes + p.activation_bytes)
      ends[-1] = i + 1
    else:
      merged.append(p)
      ends.append(i + 1)
  return merged, ends


def _Ends(profiles, num_stages, model, cap):
  """Stage ends (exclusive) of the best split whose stages all fit `cap` bytes."""
  prefix = stage_model.Prefix(np.zeros(len(profiles)))  # Only its length matters to _SplitDP.

  def Fits(j, i):
    return model.Memory(j, i) <= cap

  def Slowest(j, i):
    return np.where(Fits(j, i), model.Time(j, i), np.inf)

  # pylint: disable=protected-access
  ends = partition._SplitDP(prefix, num_stages, Slowest, np.maximum)
  starts = [0] + ends[:-1]
  bottleneck = max(float(Slowest(j, i)) for j, i in zip(starts, ends))
  if not np.isfinite(bottleneck):
    return None
  tolerance = 1e-9 * max(1.0, bottleneck)

  def Square(j, i):
    stage = Slowest(j, i)
    return np.where(stage <= bottleneck + tolerance, stage * stage, np.inf)

  return partition._SplitDP(prefix, num_stages, Square, np.add)


def MakePlan(profiles, num_stages, num_micro_batches, schedule='gpipe', remat='always',
             memory_cap_bytes=None, optimizer_slots=2, glued=(), source='',
             remat_policy=remat_lib.NONE, action_overhead_s=0.0):
  """The Plan minimising the slowest stage with every device under memory_cap_bytes.

  Args:
    profiles: LayerProfiles of the layers in order (ProfileLayers).
    num_stages, num_micro_batches: K and M.
    schedule, remat: what the pipeline runs (named_schedules.SCHEDULE_NAMES,
      gpipe.REMAT_MODES); they set the micro-batches in flight and the recompute.
    memory_cap_bytes: per-device cap, or None for none.
    optimizer_slots: optimizer tensors per weight (Adam 2, momentum 1, SGD 0).
    glued: indices of layers that must share a stage with the layer before
      (a GPipe stack's softmax).
    source: what was profiled (a registry key), kept in the plan.
    remat_policy: the pipeline's cell_remat_policy (lingvo_gpipe/layers/remat.py).
    action_overhead_s: seconds each pipeline action costs besides its layers'
      time (dispatch, hand-over bookkeeping): what makes many small
      micro-batches slow.

  Raises:
    NoFitError: if no split into K stages fits the cap.
    ValueError: for arguments that are not valid.
  """
  units, unit_ends = _Merge(profiles, set(glued))
  if len(units) < num_stages:
    kept = ('' if not glued else f' ({", ".join(profiles[i].name for i in sorted(glued))} '
            'sharing a stage with the layer before)')
    raise ValueError(f'Cannot split {len(profiles)} layers{kept} into {num_stages} stages: '
                     f'expected at most {len(units)} stages.')
  model = stage_model.StageModel(units,
                                 stage_model.Held(schedule, num_stages, num_micro_batches),
                                 stage_model.ModeledRemat(schedule, remat),
                                 optimizer_slots, remat_policy, action_overhead_s)
  cap = np.inf if memory_cap_bytes is None else float(memory_cap_bytes)
  ends = _Ends(units, num_stages, model, cap)
  if ends is None:
    # pylint: disable=protected-access
    least = partition._SplitDP(stage_model.Prefix(np.zeros(len(units))), num_stages,
                               model.Memory, np.maximum)
    need = max(float(model.Memory(j, i)) for j, i in zip([0] + least[:-1], least))
    raise NoFitError(f'No split into {num_stages} stages fits a memory cap of {_Size(cap)} per '
                     f'device: the leanest split needs {_Size(need)} on its fullest device '
                     f'(M={num_micro_batches}, schedule {schedule}, remat {remat}, remat policy '
                     f'{remat_policy}); raise the cap, K or M, or re-materialize.', need)
  return balance_plan.Plan(
      source=source, layers=list(profiles), ends=[unit_ends[e - 1] for e in ends],
      num_micro_batches=num_micro_batches, schedule=schedule, remat=remat,
      optimizer_slots=optimizer_slots, memory_cap_bytes=memory_cap_bytes,
      remat_policy=remat_policy, action_overhead_s=action_overhead_s)


def ChoosePlan(profiles, num_stages, batch_size, profiled_rows, memory_cap_bytes=None,
               micro_batches=None, schedules=PLANNABLE_SCHEDULES, remats=gpipe.REMAT_MODES,
               remat_policies=(remat_lib.NONE,), optimizer_slots=2, glued=(), source='',
               action_overhead_s=0.0):
  """(best Plan, candidates): the split, M, schedule, remat and remat policy with the best
  predicted step time among those whose every device fits memory_cap_bytes; of those
  within TIE_FRACTION of the fastest, the one needing least memory on its fullest device.

  Args:
    profiles: LayerProfiles measured at `profiled_rows` rows per micro-batch.
    num_stages: K.
    batch_size: rows of a whole batch (per replica); M must divide it.
    memory_cap_bytes, optimizer_slots, glued, source, action_overhead_s: as MakePlan's.
    micro_batches: the Ms to try; default every divisor of batch_size up to 64.
    schedules, remats, remat_policies: the schedules, re-materialization modes and
      remat policies inside cells (lingvo_gpipe/layers/remat.py) to try. A finer policy fits a
      deeper stage in the cap at the price of a recomputed forward.

  Returns:
    The best Plan, and every candidate as a dict (num_micro_batches, schedule,
    remat, remat_policy, step_time_s, bubble, memory_bytes of the fullest device,
    or why=the reason it does not fit): the best first, then its ties by memory, then
    the others fastest first.

  Raises:
    NoFitError: if no candidate fits (naming the one that needs least memory).
  """
  micro_batches = micro_batches or [m for m in range(1, min(batch_size, 64) + 1)
                                    if batch_size % m == 0]
  candidates, plans, errors = [], {}, []
  for m in micro_batches:
    scaled = stage_model.Scaled(profiles, batch_size / m / profiled_rows)
    for schedule, remat, policy in itertools.product(schedules, remats, remat_policies):
      key = dict(num_micro_batches=m, schedule=schedule, remat=remat, remat_policy=policy)
      try:
        plan = MakePlan(scaled, num_stages, m, schedule, remat, memory_cap_bytes,
                        optimizer_slots, glued, source, policy, action_overhead_s)
      except NoFitError as e:
        errors.append((e, key))
        candidates.append(dict(key, step_time_s=np.inf, why=str(e)))
        continue
      prediction = plan.Predict()
      plans[tuple(key.values())] = plan
      candidates.append(dict(key, step_time_s=prediction.step_time,
                             bubble=prediction.bubble_fraction,
                             memory_bytes=max(plan.StageMemory())))
  if not plans:
    least, key = min(errors, key=lambda error: error[0].need)
    if len(errors) == 1:
      raise least
    raise NoFitError(
        f'None of the {len(errors)} candidates (M in {list(micro_batches)}, schedules '
        f'{list(schedules)}, remat {list(remats)}, remat policies {list(remat_policies)}) fits '
        f'a memory cap of {_Size(memory_cap_bytes)} per device: the leanest, '
        f"M={key['num_micro_batches']}, schedule {key['schedule']}, remat {key['remat']}, remat "
        f"policy {key['remat_policy']}, needs {_Size(least.need)} on its fullest device; raise "
        'the cap or K.', least.need)
  tie = min(c['step_time_s'] for c in candidates) * (1 + TIE_FRACTION)
  candidates.sort(key=lambda c: (c['step_time_s'] > tie,
                                 c.get('memory_bytes', np.inf) if c['step_time_s'] <= tie
                                 else c['step_time_s'], c['step_time_s']))
  best = candidates[0]
  return plans[(best['num_micro_batches'], best['schedule'], best['remat'],
                best['remat_policy'])], candidates


# -- profiling a pipeline ---------------------------------------------------------------


def PipelineProfiles(p, batch_size, repeats=3, progress=None):
  """(profiles, glued layer indices) of pipeline params p's layers, at batch_size rows."""
  spec = p.cls.InputSpec(p)
  if spec is None:
    raise ValueError(f'{p.name}: its params do not say what its input is; profile its layers '
                     'with profiler.ProfileLayers and an input spec.')
  layer_params, _ = pipeline_params.LayersAndEnds(p)
  profiles = profiler.ProfileLayers(layer_params, spec, batch_size, repeats,
                                    tie_fn=lambda built: p.cls.TieLayers(p, built),
                                    progress=progress, parent=p)
  return profiles, p.cls.GluedLayers(p)
