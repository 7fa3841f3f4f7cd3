"""Balance planner: split layers into K stages by measured time, under a memory cap per device.

1. Profile once (profiler.ProfileLayers; PipelineProfiles for a pipeline's
   params): each layer's forward and backward seconds at
   the micro-batch size, its parameter bytes, the bytes of its input (what a
   stage keeps per micro-batch with re-materialization, if the layer starts
   the stage) and its activation bytes (the allocator peak of its forward and
   backward above the live set, less its weight gradients: what it holds for
   its backward).
2. Plan (MakePlan, numpy only): a stage's time is forward + backward, plus the
   recomputed forward with re-materialization; a device's memory is
   (2 + optimizer slots) x parameter bytes (weights, gradients, slots) plus
   activations: the micro-batches in flight (schedule.py: M for fill-drain, up
   to K for 1F1B) times the stage input with re-materialization, or times the
   stage's activations without, plus one micro-batch's activations for the
   step running; a zero-bubble schedule's pending weight gradients (B ran, W
   not yet) each hold up to a micro-batch's activations too. A remat policy
   inside the cells (lingvo_gpipe/layers/remat.py) keeps a stage's segment inputs instead of
   its activations, plus one segment's activations while the backward runs,
   and recomputes each segment's forward once more. The plan is the contiguous
   split minimising the slowest stage among those whose every stage fits the
   cap (then the most even one, as partition.Balance does), and the simulator
   predicts its step (a split B takes half the backward and the recompute, W
   the other half: see lingvo_gpipe/pipeline/weight_grads.py).
   ChoosePlan also picks M, the schedule, remat and the remat policy: the
   candidate with the best predicted step time that fits, next to the others
   and why they lost.
3. Save and load the plan as JSON; ApplyPlan cuts the pipelines of a params
   tree by it (the trainer's --balance_file), through core/pipeline_params.
"""

import dataclasses
import itertools
import json

import numpy as np
import tensorflow as tf

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.layers import remat as remat_lib
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import partition
from lingvo_gpipe.pipeline import pipeline_params

PLAN_FORMAT = 'lingvo_gpipe.balance_plan.v1'


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


def _Held(schedule, num_stages, num_micro_batches):
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


def _Prefix(values):
  return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])


def ModeledRemat(schedule, remat):
  """The remat a pipeline of `schedule` runs: a split backward's B recomputes its chunk
  whatever remat says (executor.py), its forward keeping only its input, as with 'always'."""
  return 'always' if schedule in named_schedules.SPLIT_SCHEDULES else remat


class _StageModel:
  """Time and memory of a stage holding layers j..i-1, vectorized over j."""

  def __init__(self, profiles, held, remat, optimizer_slots, remat_policy=remat_lib.NONE,
               action_overhead_s=0.0):
    if remat not in gpipe.REMAT_MODES:
      raise ValueError(f'Unknown remat {remat!r}; expected one of {list(gpipe.REMAT_MODES)}.')
    self._names = [p.name for p in profiles]
    remat_lib.StageSegments(remat_policy, self._names)  # Checks the policy.
    self._policy = remat_policy
    self._forward = _Prefix([p.forward_s for p in profiles])
    self._backward = _Prefix([p.backward_s for p in profiles])
    self._params = _Prefix([p.param_bytes for p in profiles])
    self._acts = _Prefix([p.activation_bytes for p in profiles])
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
  prefix = _Prefix(np.zeros(len(profiles)))  # Only its length matters to _SplitDP.

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
  model = _StageModel(units, _Held(schedule, num_stages, num_micro_batches),
                      ModeledRemat(schedule, remat),
                      optimizer_slots, remat_policy, action_overhead_s)
  cap = np.inf if memory_cap_bytes is None else float(memory_cap_bytes)
  ends = _Ends(units, num_stages, model, cap)
  if ends is None:
    # pylint: disable=protected-access
    least = partition._SplitDP(_Prefix(np.zeros(len(units))), num_stages, model.Memory,
                               np.maximum)
    need = max(float(model.Memory(j, i)) for j, i in zip([0] + least[:-1], least))
    raise NoFitError(f'No split into {num_stages} stages fits a memory cap of {_Size(cap)} per '
                     f'device: the leanest split needs {_Size(need)} on its fullest device '
                     f'(M={num_micro_batches}, schedule {schedule}, remat {remat}, remat policy '
                     f'{remat_policy}); raise the cap, K or M, or re-materialize.', need)
  return Plan(source=source, layers=list(profiles), ends=[unit_ends[e - 1] for e in ends],
              num_micro_batches=num_micro_batches, schedule=schedule, remat=remat,
              optimizer_slots=optimizer_slots, memory_cap_bytes=memory_cap_bytes,
              remat_policy=remat_policy, action_overhead_s=action_overhead_s)


@dataclasses.dataclass
class Plan:
  """A split of profiled layers, with what it predicts; JSON round-trips."""
  source: str
  layers: list
  ends: list
  num_micro_batches: int
  schedule: str
  remat: str
  optimizer_slots: int
  memory_cap_bytes: float = None
  remat_policy: str = remat_lib.NONE
  action_overhead_s: float = 0.0

  @property
  def num_stages(self):
    return len(self.ends)

  @property
  def layer_names(self):
    return [p.name for p in self.layers]

  def _Model(self):
    return _StageModel(self.layers, _Held(self.schedule, self.num_stages,
                                          self.num_micro_batches),
                       ModeledRemat(self.schedule, self.remat), self.optimizer_slots,
                       self.remat_policy, self.action_overhead_s)

  def _Bounds(self):
    return list(zip([0] + self.ends[:-1], self.ends))

  def StageCosts(self):
    """(forward, backward incl. recompute) seconds per stage, for simulator.Simulate."""
    model = self._Model()
    return ([float(model.Forward(j, i)) for j, i in self._Bounds()],
            [float(model.Backward(j, i)) for j, i in self._Bounds()])

  def StageMemory(self):
    """Bytes per device: weights, gradients, optimizer slots and activations."""
    model = self._Model()
    return [float(model.Memory(j, i)) for j, i in self._Bounds()]

  def SplitBackwardCosts(self):
    """(input gradient B, weight gradient W) seconds per stage, for a zero-bubble schedule's
    split backward: the recompute goes with B, not half to each."""
    model = self._Model()
    return ([float(model.InputGrad(j, i)) for j, i in self._Bounds()],
            [float(model.WeightGrad(j, i)) for j, i in self._Bounds()])

  def AtMicroBatches(self, num_micro_batches):
    """The plan with its batch in `num_micro_batches` micro-batches: the layers' profiles
    scaled to their rows as ChoosePlan scales them (the per-action overhead is not)."""
    return dataclasses.replace(
        self, layers=_Scaled(self.layers, self.num_micro_batches / num_micro_batches),
        num_micro_batches=num_micro_batches)

  def HeldBytes(self):
    """Bytes per stage that a micro-batch holds between its forward and its backward (the
    simulator's activation_bytes)."""
    model = self._Model()
    return [model.HeldPerMicroBatch(j, i) for j, i in self._Bounds()]

  def Predict(self):
    """simulator.Prediction of one step with the planned stages."""
    forward, backward = self.StageCosts()
    input_grad, weight_grad = self.SplitBackwardCosts()
    return simulator.Simulate(
        simulator.Orders(self.schedule, self.num_stages, self.num_micro_batches), forward,
        backward, input_grad_cost=input_grad, weight_grad_cost=weight_grad)

  def Stages(self):
    """Per stage: its layer names, seconds and bytes (what tools print)."""
    forward, backward = self.StageCosts()
    return [dict(layers=self.layer_names[j:i], forward_s=f, backward_s=b, memory_bytes=mem,
                 param_bytes=int(sum(p.param_bytes for p in self.layers[j:i])))
            for (j, i), f, b, mem in zip(self._Bounds(), forward, backward, self.StageMemory())]

  def ToJson(self):
    prediction = self.Predict()
    return dict(format=PLAN_FORMAT, source=self.source, ends=self.ends,
                num_micro_batches=self.num_micro_batches, schedule=self.schedule,
                remat=self.remat, remat_policy=self.remat_policy,
                optimizer_slots=self.optimizer_slots,
                action_overhead_s=self.action_overhead_s,
                memory_cap_bytes=self.memory_cap_bytes,
                layers=[dataclasses.asdict(p) for p in self.layers], stages=self.Stages(),
                predicted=dict(step_time_s=prediction.step_time,
                               bubble_fraction=prediction.bubble_fraction))

  def Save(self, path):
    with tf.io.gfile.GFile(path, 'w') as f:
      json.dump(self.ToJson(), f, indent=1)

  @classmethod
  def FromJson(cls, data):
    if data.get('format') != PLAN_FORMAT:
      raise ValueError(f'Not a balance plan: format {data.get("format")!r}, expected '
                       f'{PLAN_FORMAT!r}.')
    return cls(source=data['source'],
               layers=[profiler.LayerProfile(**p) for p in data['layers']],
               ends=list(data['ends']), num_micro_batches=data['num_micro_batches'],
               schedule=data['schedule'], remat=data['remat'],
               optimizer_slots=data['optimizer_slots'],
               action_overhead_s=data.get('action_overhead_s', 0.0),
               memory_cap_bytes=data['memory_cap_bytes'],
               remat_policy=data.get('remat_policy', remat_lib.NONE))  # Older plans: none.


def _Scaled(profiles, factor):
  """Profiles at `factor` times the rows: time and activations taken as linear in the rows
  (small micro-batches run less efficiently than this assumes)."""
  return [dataclasses.replace(p, forward_s=p.forward_s * factor, backward_s=p.backward_s * factor,
                              input_bytes=int(p.input_bytes * factor),
                              activation_bytes=int(p.activation_bytes * factor))
          for p in profiles]


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
    scaled = _Scaled(profiles, batch_size / m / profiled_rows)
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


def LoadPlan(path):
  """The Plan saved at `path` (Plan.Save, tools/plan_balance.py)."""
  try:
    with tf.io.gfile.GFile(path) as f:
      data = json.load(f)
  except (tf.errors.OpError, OSError, json.JSONDecodeError) as e:
    raise ValueError(f'Cannot read the balance plan {path}: {e}') from None
  return Plan.FromJson(data)


# -- applying a plan -------------------------------------------------------------------


def ApplyPlan(params, plan, path='', fixed=(), batch_size=None):
  """Cuts every pipeline of the params tree (in place) by the plan, with its M, schedule, remat.

  The plan's prediction holds for the M, schedule (one chunk per device: virtual_stages 1)
  and re-materialization (remat and cell_remat_policy) it was made for, so the pipelines
  take them, unless one of them is in `fixed` (dotted keys from `path` on that the user set,
  e.g. in an override): then it raises a ValueError naming both values rather than drop
  either. A micro_batch_size that gives the plan's M for a `batch_size` batch is kept. The
  layer names must be the plan's. Returns one 'path.key=new (was old)' text per value
  changed.
  """
  pipelines = list(pipeline_params.Find(params, path))
  if not pipelines:
    raise ValueError('the model params hold no PipeliningLayer to cut.')
  changes = []
  for where, p in pipelines:
    names = [q.name for q in pipeline_params.LayersAndEnds(p)[0]]
    if names != plan.layer_names:
      raise ValueError(f'The balance plan of {plan.source or "?"} is for layers '
                       f'{plan.layer_names}, but {where or p.name} has {names}.')
    # A plan's schedules run one chunk per device: its ends are one cell per device.
    wanted = dict(virtual_stages=1, num_micro_batches=plan.num_micro_batches,
                  micro_batch_size=None, schedule=plan.schedule, remat=plan.remat,
                  cell_remat_policy=plan.remat_policy)
    new = {key: value for key, value in wanted.items() if p.Get(key) != value}
    if (p.micro_batch_size and batch_size and
        pipeline_params.NumMicroBatches(p, batch_size) == plan.num_micro_batches):
      new.pop('micro_batch_size')  # It gives the plan's M.
      new.pop('num_micro_batches', None)
    _CheckFixed(where, p, plan, new, fixed, batch_size)
    changes += [f'{_Dotted(where, key)}={value!r} (was {p.Get(key)!r})'
                for key, value in new.items() if value is not None]
    p.Set(**new)
    pipeline_params.Recut(p, plan.ends)
  return changes


def _Dotted(where, key):
  return f'{where}.{key}' if where else key


def _CheckFixed(where, p, plan, new, fixed, batch_size):
  """A ValueError if the plan's `new` values or its cut would change one the user set."""
  for key, value in new.items():
    if _Dotted(where, key) in fixed:
      own, made_for = repr(p.Get(key)), repr(value)
      if key == 'micro_batch_size':
        made_for = f'num_micro_batches={plan.num_micro_batches}'
        if batch_size:
          own += f' (M={pipeline_params.NumMicroBatches(p, batch_size)} for {batch_size} rows)'
      raise ValueError(f'{_Dotted(where, key)} is set to {own}, but the balance plan of '
                       f'{plan.source or "?"} was made for {made_for}: drop the setting, or '
                       'plan again with it.')
  own_ends = list(pipeline_params.LayersAndEnds(p)[1])
  for key in ('splits', 'cell_tpl'):  # A stack's cut, a plain pipeline's cells.
    count = p.Get(key) if key in p and isinstance(p.Get(key), int) else None
    if count is None:
      conflict, cut = own_ends != list(plan.ends), f'at {own_ends}'
    else:  # A stage count: the plan's, or not.
      conflict, cut = count != len(plan.ends), f'into {count} stages'
    if _Dotted(where, key) in fixed and conflict:
      raise ValueError(f'{_Dotted(where, key)} cuts the layers {cut}, but the balance plan of '
                       f'{plan.source or "?"} cuts them at {list(plan.ends)}: drop one.')


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
