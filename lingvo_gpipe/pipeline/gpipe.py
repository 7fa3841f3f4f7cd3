"""GPipe: cells on devices, micro-batches, re-materialization, exact gradients.

A PipeliningLayer cuts a network into cells (chunks) on K devices and a batch
into M micro-batches. One micro-batch's path through a training step:

  1. split: the batch is cut along `batch_dim` (microbatch.Split), into parts that differ
     by a row if M does not divide it, sized at run time if unknown at trace time;
  2. forward F(m, c): chunk c runs on its device; only its input, the boundary
     activation, is kept (with remat) and handed to chunk c+1;
  3. loss L(m): on the last chunk's device, per micro-batch or, for fill-drain,
     once for the whole batch;
  4. backward: chunk c re-runs its forward on the kept input under a local tape
     and takes the gradients of its input (B) and weights (W), fused (BW) or
     split so that W can fill the pipeline's bubbles;
  5. accumulation: each weight gradient is added in place to the chunk's running sum
     (cell_functions.GradientSum) as the backward makes it: no second sum ever exists;
  6. reassembly: outputs and input gradients are concatenated back.

Which action runs when is data (schedule.py: print(pipe.GetSchedule(batch)));
training_pass.py runs a pass of it, the executor (executor.py, replicas.py) its actions in
that order. With `num_replicas` R, R copies of the pass each take 1/R of the batch and
their weight gradients are summed.

The backward pass is written out rather than left to the tape because the tape sums a
weight's M gradients only once all exist (the peak grows with M): re-materialization is an
explicit recompute-then-differentiate of each chunk, the accumulation in our hands.
"""

from typing import Any, Callable, Optional

from absl import logging
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import remat as remat_lib
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import cells
from lingvo_gpipe.pipeline import direct_inputs
from lingvo_gpipe.pipeline import executor
from lingvo_gpipe.pipeline import loss_contract
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import named_schedules
from lingvo_gpipe.pipeline import partition
from lingvo_gpipe.pipeline import program
from lingvo_gpipe.pipeline import replicas
from lingvo_gpipe.pipeline import schedule as schedule_lib
from lingvo_gpipe.pipeline import steady_state
from lingvo_gpipe.pipeline import step_timing
from lingvo_gpipe.pipeline import training_pass

REMAT_MODES = ('always', 'except_last', 'never')

# The cells (cells.py), under the names a pipeline's users know them by.
FeatureExtractionLayer = cells.FeatureExtractionLayer
PartitionSequentialLayers = cells.PartitionSequentialLayers
CellsFromEnds = cells.CellsFromEnds


def _CastFloats(structure, dtype):
  return tf.nest.map_structure(
      lambda x: tf.cast(x, dtype) if py_utils.IsFloatTensor(x) and x.dtype != dtype else x,
      structure)


class PipeliningLayer(base_layer.BaseLayer):
  """Runs cells on devices as a pipeline of micro-batches (GPipe).

  Example:
    cells = gpipe.PartitionSequentialLayers(layer_params, 4, tf.TensorShape([64, 256]))
    p = gpipe.PipeliningLayer.Params().Set(name='pipe', cell_tpl=cells,
                                            num_micro_batches=8)
    pipe = p.Instantiate()
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(pipe(x) ** 2)
    grads = tape.gradient(loss, pipe.trainable_variables)
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('cell_tpl', [], 'Cell params, one per stage, run in order.')
    p.Define('before_tpl', [], 'Layer params run on the first device before pipelining.')
    p.Define('num_micro_batches', 1, 'M: micro-batches per batch.')
    p.Define('micro_batch_size', None, 'Rows per micro-batch; if set, M = batch / this.')
    p.Define('batch_dim', 0, 'The batch dimension of every input and output tensor.')
    p.Define('devices', None,
             'Device names, one per stage (a device, holding virtual_stages cells) of each '
             'replica, replica-major: K x num_replicas; None: the local or cluster devices.')
    p.Define('allow_device_reuse', False,
             'Place cells round-robin when there are fewer devices than cells.')
    p.Define('remat', 'always',
             "Re-materialization: 'always', 'except_last' (the last micro-batch keeps its "
             "activations) or 'never'. A backward split into B and W (zero-bubble schedules) "
             "recomputes its chunk in B whatever this says: its forward keeps only its input.")
    p.Define('cell_remat_policy', remat_lib.NONE,
             "Re-materialization inside each cell (lingvo_gpipe/layers/remat.py), set as each "
             "cell's remat_policy: 'none', 'every_layer', 'every_N' (e.g. 'every_2'), or layer "
             "names joined by '+' whose outputs are kept (a cell holding none is one segment).")
    p.Define('schedule', 'gpipe',
             f'One of {list(named_schedules.SCHEDULE_NAMES)}: fill-drain (also under a tape), '
             '1F1B, interleaved 1F1B, zero-bubble H1/H2 and V (ForwardBackward); or your own '
             'orders for this K, M and v as a schedule text (schedule.Schedule.ToText).')
    p.Define('virtual_stages', 1,
             'v chunks per device: cell_tpl holds K * v cells for K devices '
             "(interleaved_1f1b: any v; zbv: 2; other schedules: 1).")
    p.Define('num_replicas', 1,
             'R data-parallel copies of the pipeline, each on 1/R of the batch; `devices` then '
             'lists R x K devices, replica r stage k at devices[r * K + k].')
    p.Define('loop_steady_state', 'auto',
             "Run a traced schedule's steady state (its stretch that repeats for micro-batch "
             'after micro-batch: lingvo_gpipe/pipeline/steady_state.py) as one tf.while_loop, '
             'so that tracing and graph optimization do not grow with M (the actions and their '
             "order stay the schedule's): True, False, or 'auto', which loops where the "
             'stretches hold at least steady_state.AUTO_MIN_INSTRUCTIONS instructions (K=8, '
             "M=64: yes; K=4, M=16: no) unless inline_cell_functions. Needs equal "
             "micro-batches; remat 'never' forwards stay unrolled.", kinds=(bool, str))
    p.Define('inline_cell_functions', False,
             "Inline each action's call of its chunk's function. Off, start-up stays small at "
             "large K x M, but an op failing in a chunk may surface only as CancelledError "
             "('RecvAsync is cancelled'); on, its own error is raised. Not with a loop.")
    p.Define('last_chunk_inputs', None,
             "Paths of the first cell's NestedMap input (e.g. 'tgt.labels') that only the last "
             'chunk reads: sent to it straight from the batch, not handed through every stage '
             "(lingvo_gpipe/pipeline/direct_inputs.py). None: the class's choice (a GPipe "
             "stack's: its softmax's labels and weights, and a stream embedded after the first "
             "chunk to its embedding's); [] sends everything through.")
    p.Define('jit_compile', False,
             "Compile each cell's forward and backward step with XLA (placement and the "
             "pipeline between the steps stay outside the compiled functions); needs remat="
             "'always'. The split B and W steps of zero-bubble schedules run uncompiled.")
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not isinstance(p.cell_tpl, (list, tuple)) or not all(
        isinstance(c, hyperparams.InstantiableParams) for c in p.cell_tpl):
      raise ValueError(f'PipeliningLayer {self.path!r}: cell_tpl must be a list of layer '
                       f'params, one per stage; got {type(p.cell_tpl).__name__}.')
    if not p.cell_tpl:
      raise ValueError(f'PipeliningLayer {self.path!r}: cell_tpl is empty; give one cell '
                       'params per stage.')
    if p.remat not in REMAT_MODES:
      raise ValueError(f'Unknown remat {p.remat!r}; expected one of {list(REMAT_MODES)}.')
    steady_state.CheckSetting(p.loop_steady_state)
    if p.inline_cell_functions and p.loop_steady_state is True:
      raise ValueError("inline_cell_functions=True needs loop_steady_state False or 'auto' "
                       "(which then does not loop): calls inlined into the loop's body are "
                       "not kept in the schedule's order.")
    direct_inputs.CheckPaths(p.last_chunk_inputs)
    if p.jit_compile and p.remat != 'always':
      raise ValueError(f"jit_compile=True needs remat='always', got remat={p.remat!r}: a "
                       'forward that saves what its backward needs runs uncompiled.')
    if self.NumStagesOf(p) == 1 and p.virtual_stages > 1 and p.schedule == 'interleaved_1f1b':
      logging.warning('%s: interleaved_1f1b with virtual_stages=%d of %d cells runs on one '
                      'device, where interleaving does nothing: give virtual_stages x K cells '
                      'for K >= 2 devices.', p.name, p.virtual_stages, len(p.cell_tpl))
    if p.micro_batch_size is not None and p.num_micro_batches != 1:
      raise ValueError(f'Set num_micro_batches ({p.num_micro_batches}) or micro_batch_size '
                       f'({p.micro_batch_size}), not both: leave num_micro_batches at 1.')
    # A bad schedule, chunks per device or M fails here, not at the first batch; the schedule
    # places the chunks. Built and checked once per M, here and then as batches need them.
    self._programs = {}  # M -> the program of its schedule (ProgramFor).
    self._placement = self.ScheduleFor(None if p.micro_batch_size else p.num_micro_batches
                                     ).placement
    if not isinstance(p.num_replicas, int) or p.num_replicas < 1:
      raise ValueError(f'num_replicas must be a positive int, got {p.num_replicas!r}.')
    self._devices = devices_lib.StageDevices(self.num_stages, p.devices, p.allow_device_reuse,
                                             p.num_replicas)
    self.CreateChildren('before', p.before_tpl, devices=[self._devices[0]] * len(p.before_tpl))
    self.CreateChildren('cell', remat_lib.PolicyCells(p.cell_tpl, p.cell_remat_policy, self.path),
                        devices=self.ReplicaDevices(0))
    self._cell_functions = [[cell_functions.CellFunctions(self, c, device, r) for c, device in
                             enumerate(self.ReplicaDevices(r))] for r in range(p.num_replicas)]
    self._clocks = step_timing.DeviceClocks(self._devices[:self.num_stages], self.path)

  @property
  def devices(self):
    """The device of each stage (replica-major with several replicas)."""
    return list(self._devices)

  @property
  def placement(self):
    """The stage (device index) of each chunk."""
    return list(self._placement)

  @property
  def cell_functions(self):
    """Per replica and chunk, the chunk's forward and backward functions."""
    return self._cell_functions

  @property
  def num_replicas(self):
    return self.params.num_replicas

  def ReplicaDevices(self, replica: int) -> list[str]:
    """The device of each chunk of one replica (replica 0's hold the weights)."""
    stages = self._devices[replica * self.num_stages:(replica + 1) * self.num_stages]
    return [stages[k] for k in self._placement]

  def ReplicaThetas(self, thetas, replica):
    """Replica 0's per-chunk thetas, copied onto another replica's devices."""
    if replica == 0:
      return thetas
    copies = []
    for theta, device in zip(thetas, self.ReplicaDevices(replica)):
      with tf.device(device):
        copies.append(tf.nest.map_structure(tf.identity, theta))
    return copies

  @property
  def num_stages(self):
    """K: the devices of one replica."""
    return self.NumStagesOf(self.params)

  @property
  def num_chunks(self):
    """K * v: the cells."""
    return len(self.params.cell_tpl)

  # -- the params API (lingvo_gpipe/pipeline/pipeline_params.py): how these params hold the layers

  @classmethod
  def NumStagesOf(cls, p: hyperparams.Params) -> int:
    """K (devices) of pipeline params `p`, without building anything."""
    return cls._StagesOf(p, len(p.cell_tpl))

  @staticmethod
  def _StagesOf(p, num_cells):
    """K of `num_cells` cells, virtual_stages of them on each device."""
    v = p.virtual_stages
    if not isinstance(v, int) or isinstance(v, bool) or v < 1 or num_cells % v:
      raise ValueError(f'{p.name}: virtual_stages={v!r} must be a positive int dividing the '
                       f'{num_cells} cells.')
    return num_cells // v

  @classmethod
  def LayersAndEnds(cls, p):
    """(layer params in the order they run, ascending end index of each stage).

    FeatureExtractionLayer cells hold the layers; other cells are one layer each.
    """
    if all(issubclass(c.cls, FeatureExtractionLayer) for c in p.cell_tpl):
      sizes = [len(c.sub) for c in p.cell_tpl]
      return ([q for c in p.cell_tpl for q in c.sub],
              [sum(sizes[:k + 1]) for k in range(len(sizes))])
    return list(p.cell_tpl), list(range(1, len(p.cell_tpl) + 1))

  @classmethod
  def Recut(cls, p, ends):
    """Cuts pipeline params `p` (in place) into the stages ending at `ends`."""
    if not all(issubclass(c.cls, FeatureExtractionLayer) for c in p.cell_tpl):
      raise ValueError(f'{p.name}: cannot re-cut cells that are not FeatureExtractionLayers.')
    layer_params, _ = cls.LayersAndEnds(p)
    partition.CheckEnds(ends, len(layer_params), p.name)
    if len(ends) % p.virtual_stages:
      raise ValueError(f'{p.name}: {len(ends)} cells do not make virtual_stages='
                       f'{p.virtual_stages} chunks on each device.')
    fetched = [name for c in p.cell_tpl for name in c.act_fetch_layers]
    p.cell_tpl = CellsFromEnds(layer_params, ends, fetched)

  @classmethod
  def GluedLayers(cls, p):
    """Indices of layers that must share a stage with the layer before them."""
    del p  # Any cut of a plain pipeline works.
    return []

  @classmethod
  def InputSpec(cls, p):
    """TensorSpecs of one example's input (batch 1), or None if the params do not say."""
    del p  # A plain pipeline's input is whatever its caller gives.
    return None

  @classmethod
  def TieLayers(cls, p, layer_list):
    """Shares weights among layers built from LayersAndEnds, as the pipeline itself does."""
    del p, layer_list  # Nothing is shared in a plain pipeline.

  def NumMicroBatches(self, batch_size: Optional[int]) -> int:
    """M of each replica for a whole batch of `batch_size` rows (None: unknown at trace time).

    M need not divide the rows: micro-batches then differ by a row. A batch of
    fewer rows than M x replicas (a last partial batch, one example served)
    leaves micro-batches empty: they run on no rows and add nothing.
    """
    p = self.params
    return microbatch.NumMicroBatches(batch_size, p.num_micro_batches, p.micro_batch_size,
                                      p.num_replicas, allow_empty=True)

  def GetSchedule(self, batch_size: Optional[int]) -> schedule_lib.Schedule:
    """The schedule a batch of `batch_size` runs; print it to see it."""
    return self.ScheduleFor(self.NumMicroBatches(batch_size))

  def ScheduleFor(self, num_micro_batches: Optional[int]) -> schedule_lib.Schedule:
    """The checked schedule at M = num_micro_batches (None: M not known yet, not kept)."""
    if num_micro_batches is None:
      return self._NewSchedule(None)
    return self.ProgramFor(num_micro_batches).schedule

  def GetProgram(self, batch_size: Optional[int]) -> program.Program:
    """The program a batch of `batch_size` runs (program.py); print its ToText() to see it."""
    return self.ProgramFor(self.NumMicroBatches(batch_size))

  def ProgramFor(self, num_micro_batches: int) -> program.Program:
    """The program of the schedule at M = num_micro_batches, lowered once."""
    if num_micro_batches not in self._programs:
      self._programs[num_micro_batches] = program.Lower(self._NewSchedule(num_micro_batches))
    return self._programs[num_micro_batches]

  def _NewSchedule(self, num_micro_batches):
    p = self.params
    try:
      return schedule_lib.ForPipeline(p.schedule, self.num_stages, num_micro_batches,
                                      p.virtual_stages)
    except ValueError as e:
      if p.micro_batch_size is None or num_micro_batches is None:
        raise
      raise ValueError(f"{str(e).rstrip('.')} (M = the rows of each replica's batch / "
                       f'micro_batch_size={p.micro_batch_size}).') from None

  def _HandOverDType(self, c):
    """The dtype of chunk c's floating outputs: the fprop_dtype of the layer that reads them
    (the next cell's first), or after the last cell of the one that made them, so that a
    layer's own dtype (a float32 Keras layer under a mixed policy) holds across cuts."""
    last = c + 1 == len(self.cell)
    layer = self.cell[c if last else c + 1]
    while isinstance(layer, layers.SequentialLayer) and layer.sub:
      layer = layer.sub[-1 if last else 0]
    return layer.fprop_dtype

  def CellFProp(self, c: int, theta: py_utils.NestedMap,
                args: tuple) -> tuple[tuple, py_utils.NestedMap]:
    """Chunk c's (output argument tuple, fetched activations), floats in _HandOverDType."""
    cell = self.cell[c]
    try:
      if isinstance(cell, FeatureExtractionLayer):
        out, acts = cell.FPropWithActivations(theta, *args)
      else:
        out, acts = cell.FProp(theta, *args), py_utils.NestedMap()
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
      shapes = [getattr(x, 'shape', x) for x in tf.nest.flatten(args)]
      source = f'the output of cell {c - 1}' if c else 'the pipeline input'
      raise ValueError(f'Pipeline cell {c} ({cell.path}) failed on {source} (shapes '
                       f'{shapes}): {e}') from e
    return _CastFloats(executor.AsArgs(out), self._HandOverDType(c)), acts

  # -- public entry points --------------------------------------------------------

  # The pipeline is plain Python run at trace time: AutoGraph converting it (when a
  # caller's tf.function has autograph on) only costs trace time, which grows with K x M.
  @tf.autograph.experimental.do_not_convert
  def FProp(self, theta: py_utils.NestedMap, *inputs):
    """Pipelined forward; differentiable (fill-drain backward) with tf.GradientTape.

    Returns the whole batch's outputs, and, if any cell fetches activations,
    (outputs, NestedMap of activations).
    """
    args = self.BeforeFProp(theta, inputs)
    training = py_utils.CurrentContext().training
    _, num = self.MicroBatching(args)
    thetas = self.ChunkThetas(theta)
    if training:
      outputs, acts = training_pass.DifferentiableForward(self, thetas, args, num)
    else:
      run = replicas.Replicas(self, thetas, args, num, remat='always', step=0,
                              keep_inputs=False, tracer=self.Tracer())
      run.Execute(self.ProgramFor(num).Forwards())
      outputs, acts = run.MergedOutputs()
    return self.Result(outputs, acts)

  @tf.autograph.experimental.do_not_convert
  def ForwardBackward(self, theta: py_utils.NestedMap, inputs, loss_fn: Callable[..., Any],
                      labels=None, with_outputs: bool = False,
                      loss_reduction: Optional[str] = None) -> tuple:
    """(loss, grads) of loss_fn(outputs) by the configured schedule.

    Args:
      theta: this layer's theta.
      inputs: a tensor, NestedMap, or tuple of them (the cells' arguments).
      loss_fn: maps the outputs (and, if cells fetch activations, the NestedMap
        of activations as a second argument) to the loss: a Lingvo (value, weight)
        pair (value is a mean over weight items), a NestedMap of such metrics
        holding 'loss', or a bare scalar. 'gpipe' calls it once on the whole
        batch; the other schedules call it on each micro-batch as soon as it
        leaves the last chunk, and merge the micro-batches' metrics
        (loss_contract.py): pairs as sum(value * weight) / sum(weight), bare
        scalars as loss_reduction declares.
      labels: None, or tensors batched like the inputs (a structure, e.g. targets
        and example weights) that loss_fn takes as its last argument: a
        micro-batch's loss gets the rows of its own outputs, split as the inputs are.
      with_outputs: also return the whole batch's outputs (as FProp's), e.g. for
        metrics; the schedule keeps them until the pass ends anyway.
      loss_reduction: how loss_fn's bare scalars merge over micro-batches: 'mean'
        (a mean over the batch's rows), 'sum' (a sum over them), or None (a bare
        scalar is then a ValueError under a schedule other than 'gpipe').

    Returns:
      (loss, grads), grads a NestedMap shaped like theta; if loss_fn returns a
      NestedMap, the first value is the NestedMap of merged (value, weight). With
      with_outputs, (loss, grads, outputs).
    """
    return training_pass.ForwardBackward(self, theta, inputs, loss_fn, labels, with_outputs,
                                         loss_reduction)

  # -- what a pass uses (training_pass.py) ----------------------------------------

  def MicroBatching(self, args):
    """(the whole batch's rows (an int, or a tensor if unknown at trace time), M)."""
    rows = microbatch.BatchSize(args, self.params.batch_dim)
    return rows, self.NumMicroBatches(rows if isinstance(rows, int) else None)

  def Tracer(self):
    """A StepTracer when the context collects step timings, else None."""
    records = py_utils.CurrentContext().step_stats
    return None if records is None else step_timing.StepTracer(records, self._clocks)

  def PassStep(self):
    """This training pass's step (BaseLayer.TrainingStep), read once for all its cells."""
    with tf.device(self._devices[0]):
      return tf.cast(self.TrainingStep(), tf.int64)

  def Result(self, outputs, acts):
    """Unwraps a single output from its argument tuple; appends fetched activations."""
    if isinstance(outputs, tuple) and len(outputs) == 1:
      outputs = outputs[0]
    return (outputs, acts) if acts else outputs

  def DefaultDirectInputs(self) -> dict:
    """Where the params' last_chunk_inputs is None: {path: the chunk it is sent straight to,
    -1 for the last}, for the paths the input has (direct_inputs.py); none here."""
    return {}

  def ChunkThetas(self, theta):
    """Each chunk's theta as tensors read on that chunk's device."""
    thetas = []
    for c, device in enumerate(self.ReplicaDevices(0)):
      with tf.device(device):
        thetas.append(tf.nest.map_structure(tf.convert_to_tensor, theta.cell[c]))
    return thetas

  def BeforeFProp(self, theta, inputs):
    args = tuple(inputs)
    with tf.device(self._devices[0]):
      for layer, layer_theta in zip(self.before, theta.before):
        args = executor.AsArgs(layer.FProp(layer_theta, *args))
    return args
