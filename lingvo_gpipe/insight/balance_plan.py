"""A balance plan: the stage cut a search found (planner.py), what it predicts, its JSON
file (Plan.Save, LoadPlan) and cutting the pipelines of params by it (ApplyPlan, the
trainer's --balance_file, through pipeline/pipeline_params.py). Separate from the search, so
that what reads and applies a plan does not carry the planner.
"""

import dataclasses
import json

import tensorflow as tf

from lingvo_gpipe.insight import simulator
from lingvo_gpipe.insight import stage_model
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.layers import remat as remat_lib
from lingvo_gpipe.pipeline import pipeline_params

PLAN_FORMAT = 'lingvo_gpipe.balance_plan.v1'


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
    return stage_model.StageModel(
        self.layers, stage_model.Held(self.schedule, self.num_stages, self.num_micro_batches),
        stage_model.ModeledRemat(self.schedule, self.remat), self.optimizer_slots,
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
        self, layers=stage_model.Scaled(self.layers, self.num_micro_batches / num_micro_batches),
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


def LoadPlan(path):
  """The Plan saved at `path` (Plan.Save, tools/plan_balance.py)."""
  try:
    with tf.io.gfile.GFile(path) as f:
      data = json.load(f)
  except (tf.errors.OpError, OSError, json.JSONDecodeError) as e:
    raise ValueError(f'Cannot read the balance plan {path}: {e}') from None
  return Plan.FromJson(data)


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
