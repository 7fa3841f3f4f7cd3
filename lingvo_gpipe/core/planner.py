"""Balance planner: split layers into K stages by measured time, under a memory cap per device.

1. Profile once (ProfileLayers): each layer's forward and backward seconds at
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
   step running. The plan is the contiguous split minimising the slowest stage
   among those whose every stage fits the cap (then the most even one, as
   partition.Balance does), and the simulator predicts its step.
3. Save and load the plan as JSON; ApplyPlan cuts the PipeliningLayers of a
   params tree by it (the trainer's --balance_file).
"""

import dataclasses
import json
import time

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import layers as layers_lib
from lingvo_gpipe.core import layers_with_gpipe
from lingvo_gpipe.core import memory_stats
from lingvo_gpipe.core import partition
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import simulator

PLAN_FORMAT = 'lingvo_gpipe.balance_plan.v1'


@dataclasses.dataclass
class LayerProfile:
  """One layer measured at the micro-batch size; seconds and bytes."""
  name: str
  forward_s: float
  backward_s: float
  param_bytes: int
  input_bytes: int
  activation_bytes: int


# -- planning (no TensorFlow) --------------------------------------------------------------


def _InFlight(schedule, num_stages, num_micro_batches):
  """Most micro-batches any stage holds between forward and backward under `schedule`."""
  orders = simulator.Orders(schedule, num_stages, num_micro_batches)
  return int(orders.MaxInFlight().max())


def _Prefix(values):
  return np.concatenate([[0.0], np.cumsum(np.asarray(values, np.float64))])


class _StageModel:
  """Time and memory of a stage holding layers j..i-1, vectorized over j."""

  def __init__(self, profiles, in_flight, remat, optimizer_slots):
    if remat not in gpipe.REMAT_MODES:
      raise ValueError(f'Unknown remat {remat!r}; expected one of {list(gpipe.REMAT_MODES)}.')
    self._forward = _Prefix([p.forward_s for p in profiles])
    self._backward = _Prefix([p.backward_s for p in profiles])
    self._params = _Prefix([p.param_bytes for p in profiles])
    self._acts = _Prefix([p.activation_bytes for p in profiles])
    self._inputs = np.array([p.input_bytes for p in profiles], np.float64)
    self._in_flight = in_flight
    self._remat = remat
    self._model_factor = 2 + optimizer_slots

  def Forward(self, j, i):
    return self._forward[i] - self._forward[j]

  def Backward(self, j, i):
    """Backward seconds, with the recomputed forward when the stage re-materializes."""
    backward = self._backward[i] - self._backward[j]
    return backward + (self.Forward(j, i) if self._remat != 'never' else 0.0)

  def Time(self, j, i):
    return self.Forward(j, i) + self.Backward(j, i)

  def Memory(self, j, i):
    acts = self._acts[i] - self._acts[j]
    inputs = self._inputs[np.asarray(j)]
    if self._remat == 'never':
      activations = self._in_flight * acts
    elif self._remat == 'always':
      activations = self._in_flight * inputs + acts
    else:  # except_last: the last micro-batch keeps all of its activations.
      activations = (self._in_flight - 1) * inputs + 2 * acts
    return self._model_factor * (self._params[i] - self._params[j]) + activations


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
             memory_cap_bytes=None, optimizer_slots=2, glued=(), source=''):
  """The Plan minimising the slowest stage with every device under memory_cap_bytes.

  Args:
    profiles: LayerProfiles of the layers in order (ProfileLayers).
    num_stages, num_micro_batches: K and M.
    schedule, remat: what the pipeline runs (schedule.SCHEDULE_NAMES,
      gpipe.REMAT_MODES); they set the micro-batches in flight and the recompute.
    memory_cap_bytes: per-device cap, or None for none.
    optimizer_slots: optimizer tensors per weight (Adam 2, momentum 1, SGD 0).
    glued: indices of layers that must share a stage with the layer before
      (a GPipe stack's softmax).
    source: what was profiled (a registry key), kept in the plan.

  Raises:
    ValueError: if no split into K stages fits the cap.
  """
  units, unit_ends = _Merge(profiles, set(glued))
  if len(units) < num_stages:
    raise ValueError(f'Cannot split {len(units)} layers (after keeping {sorted(glued)} with '
                     f'the layer before) into {num_stages} stages.')
  in_flight = _InFlight(schedule, num_stages, num_micro_batches)
  model = _StageModel(units, in_flight, remat, optimizer_slots)
  cap = np.inf if memory_cap_bytes is None else float(memory_cap_bytes)
  ends = _Ends(units, num_stages, model, cap)
  if ends is None:
    # pylint: disable=protected-access
    least = partition._SplitDP(_Prefix(np.zeros(len(units))), num_stages, model.Memory,
                               np.maximum)
    need = max(float(model.Memory(j, i)) for j, i in zip([0] + least[:-1], least))
    raise ValueError(f'No split into {num_stages} stages fits memory_cap_bytes={cap:.4g}: the '
                     f'leanest split needs {need:.4g} bytes on its fullest device; raise the '
                     'cap, K or M, or re-materialize.')
  return Plan(source=source, layers=list(profiles), ends=[unit_ends[e - 1] for e in ends],
              num_micro_batches=num_micro_batches, schedule=schedule, remat=remat,
              optimizer_slots=optimizer_slots, memory_cap_bytes=memory_cap_bytes)


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

  @property
  def num_stages(self):
    return len(self.ends)

  @property
  def layer_names(self):
    return [p.name for p in self.layers]

  def _Model(self):
    in_flight = _InFlight(self.schedule, self.num_stages, self.num_micro_batches)
    return _StageModel(self.layers, in_flight, self.remat, self.optimizer_slots)

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

  def Predict(self):
    """simulator.Prediction of one step with the planned stages."""
    forward, backward = self.StageCosts()
    return simulator.Simulate(
        simulator.Orders(self.schedule, self.num_stages, self.num_micro_batches), forward,
        backward)

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
                remat=self.remat, optimizer_slots=self.optimizer_slots,
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
    return cls(source=data['source'], layers=[LayerProfile(**p) for p in data['layers']],
               ends=list(data['ends']), num_micro_batches=data['num_micro_batches'],
               schedule=data['schedule'], remat=data['remat'],
               optimizer_slots=data['optimizer_slots'],
               memory_cap_bytes=data['memory_cap_bytes'])


def LoadPlan(path):
  """The Plan saved at `path` (Plan.Save, tools/plan_balance.py)."""
  try:
    with tf.io.gfile.GFile(path) as f:
      data = json.load(f)
  except (tf.errors.OpError, OSError, json.JSONDecodeError) as e:
    raise ValueError(f'Cannot read the balance plan {path}: {e}') from None
  return Plan.FromJson(data)


# -- applying a plan -------------------------------------------------------------------


def PipelineParams(params):
  """The PipeliningLayer params within the params tree `params`, outermost first."""
  if (isinstance(params, hyperparams.InstantiableParams) and isinstance(params.cls, type)
      and issubclass(params.cls, gpipe.PipeliningLayer)):
    yield params
    return
  for _, value in params.IterParams():
    for child in value if isinstance(value, (list, tuple)) else [value]:
      if isinstance(child, hyperparams.Params):
        yield from PipelineParams(child)


def _CheckNames(where, names, plan):
  if names != plan.layer_names:
    raise ValueError(f'The balance plan of {plan.source or "?"} is for layers '
                     f'{plan.layer_names}, but {where} has {names}.')


def ApplyPlan(params, plan):
  """Cuts every PipeliningLayer in the params tree `params` (in place) by the plan.

  A GPipe stack (layers_with_gpipe) gets `splits = plan.ends`; a PipeliningLayer
  whose cells are FeatureExtractionLayers is re-cut from their layers. The layer
  names must be the plan's. Returns the number of pipelines cut.
  """
  pipelines = list(PipelineParams(params))
  for p in pipelines:
    if 'splits' in p:
      _CheckNames(p.name, [q.name for q in p.cls.LayerParams(p)], plan)
      p.splits = list(plan.ends)
    else:
      if not all(issubclass(c.cls, gpipe.FeatureExtractionLayer) for c in p.cell_tpl):
        raise ValueError(f'{p.name}: cannot re-cut cells that are not '
                         'FeatureExtractionLayers.')
      sub = [q for c in p.cell_tpl for q in c.sub]
      _CheckNames(p.name, [q.name for q in sub], plan)
      p.cell_tpl = gpipe.CellsFromEnds(sub, plan.ends)
  return len(pipelines)


# -- profiling (TensorFlow) --------------------------------------------------------------


def _RandomInput(spec, batch_size):
  """A random tensor (zeros for integers: valid ids and labels) of `spec` with a batch."""
  if isinstance(spec, dict):
    return py_utils.NestedMap({k: _RandomInput(v, batch_size) for k, v in spec.items()})
  shape = [batch_size] + list(tf.TensorShape(spec.shape))[1:]
  if spec.dtype.is_floating:
    return tf.random.stateless_normal(shape, [0, 1], dtype=spec.dtype)
  return tf.zeros(shape, spec.dtype)


def _Bytes(structure):
  return int(sum(x.shape.num_elements() * x.dtype.size for x in tf.nest.flatten(structure)
                 if isinstance(x, (tf.Tensor, tf.Variable))))


def _Median(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    tf.nest.map_structure(lambda x: x.numpy() if hasattr(x, 'numpy') else x, fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _ProfileOne(layer, theta, args, repeats):
  """(LayerProfile, outputs) of one layer on `args`."""
  floats = [x for x in tf.nest.flatten(args) if x.dtype.is_floating]
  weights = [v for v in tf.nest.flatten(theta) if v.trainable]

  @py_utils.DistinctFunction(autograph=False)
  def Forward():
    return layer.FProp(theta, *args)

  @py_utils.DistinctFunction(autograph=False)
  def ForwardBackward():
    with tf.GradientTape() as tape:
      tape.watch(floats)
      out = layer.FProp(theta, *args)
      total = tf.add_n([tf.reduce_sum(tf.cast(x, tf.float32)) for x in tf.nest.flatten(out)
                        if x.dtype.is_floating])
    return tape.gradient(total, floats + weights,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)

  out = Forward()
  ForwardBackward()  # Trace and warm up.
  forward = _Median(Forward, repeats)
  both = _Median(ForwardBackward, repeats)
  grads, peak = memory_stats.PeakBytes(ForwardBackward)
  param_bytes = _Bytes(weights)
  profile = LayerProfile(name=layer.params.name, forward_s=forward,
                         backward_s=max(both - forward, 0.0), param_bytes=param_bytes,
                         input_bytes=_Bytes(args),
                         activation_bytes=max(int(peak) - _Bytes(grads), 0))
  return profile, out


def ProfileLayers(layer_params_list, input_spec, batch_size, repeats=3, tie_softmax=False,
                  progress=None):
  """LayerProfiles of layers run in order on random inputs of `batch_size` rows.

  Args:
    layer_params_list: the layers' params, in the order they run.
    input_spec: TensorSpec (or NestedMap of them) of the first layer's input;
      its batch dimension is replaced by batch_size (use the micro-batch size).
    batch_size: rows of each profiled pass.
    repeats: timed runs per layer; the median is kept.
    tie_softmax: tie the last layer to the embedding (GPipe stacks' tie_embeddings).
    progress: optional callable(i, n, LayerProfile) after each layer.
  """
  stack = layers_lib.SequentialLayer.Params().Set(
      name='profile', sub=layer_params_list).Instantiate()
  if tie_softmax:
    layers_with_gpipe.TieSoftmaxToEmbedding(stack.sub)
  args = (_RandomInput(input_spec, batch_size),)
  profiles = []
  for i, (layer, theta) in enumerate(zip(stack.sub, stack.theta.sub)):
    profile, out = _ProfileOne(layer, theta, args, repeats)
    profiles.append(profile)
    if progress:
      progress(i, len(stack.sub), profile)
    args = out if isinstance(out, tuple) else (out,)
  return profiles


def StackProfiles(stack_params, batch_size, repeats=3, progress=None):
  """(profiles, glued) of a layers_with_gpipe stack: its softmax stays with the layer before."""
  layer_params = stack_params.cls.LayerParams(stack_params)
  tie = 'tie_embeddings' in stack_params and stack_params.tie_embeddings
  profiles = ProfileLayers(layer_params, stack_params.cls.InputSpec(stack_params), batch_size,
                           repeats, tie_softmax=tie, progress=progress)
  return profiles, [len(layer_params) - 1]
