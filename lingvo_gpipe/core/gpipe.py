"""GPipe: cells on devices, micro-batches, re-materialization, exact gradients.

A PipeliningLayer cuts a network into K cells on K devices and a batch into M
micro-batches. One micro-batch's path through a training step, as `_Run` below
executes it:

  1. split: the batch is cut along `batch_dim` (microbatch.Split);
  2. forward F(m, k): cell k runs on device k; only its input, the boundary
     activation, is kept (with remat) and handed to device k+1;
  3. backward B(m, k): cell k re-runs its forward on the kept input under a
     local tape and takes the gradients of its input and weights for the
     incoming output gradient;
  4. accumulation: the weight gradient is added to the stage's running sum at
     once, so no more than one micro-batch's weight gradient per stage exists;
  5. reassembly: outputs and input gradients are concatenated back.

Which step runs when is data (schedule.py); the executor follows it, and in
graphs each step waits (control dependencies) for the previous step of the same
stage, so TensorFlow cannot run ahead and hold M micro-batches' gradients. Each
step is one call of a per-cell function (`_CellSteps`), which keeps graphs small.
With `num_replicas` R, R copies of this run each take 1/R of the batch
(`_Replicas`) and their weight gradients are summed.

The backward pass is written out here rather than left to the tape because the
tape sums a weight's M gradients only once all exist (the peak grows with M);
re-materialization is therefore this explicit recompute-then-differentiate of
each cell, the same idea as tf.recompute_grad with the accumulation in our hands.
"""

import contextlib

import numpy as np
import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import devices as devices_lib
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import layers
from lingvo_gpipe.core import metrics as metrics_lib
from lingvo_gpipe.core import microbatch
from lingvo_gpipe.core import partition
from lingvo_gpipe.core import profiler
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import remat as remat_lib
from lingvo_gpipe.core import schedule as schedule_lib

REMAT_MODES = ('always', 'except_last', 'never')


def _AsArgs(value):
  """A cell's output as the argument tuple of the next cell."""
  return value if isinstance(value, tuple) else (value,)


def _IsFloatTensor(x):
  return isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype.is_floating


def _After(tokens, structure):
  """`structure` made to wait for `tokens` (no-op when eager: Python orders it)."""
  if not tokens or tf.executing_eagerly():
    return structure
  with tf.control_dependencies(tokens):
    return tf.nest.map_structure(
        lambda x: tf.identity(x) if isinstance(x, tf.Tensor) else x, structure)


def _CastFloats(structure, dtype):
  return tf.nest.map_structure(
      lambda x: tf.cast(x, dtype) if _IsFloatTensor(x) and x.dtype != dtype else x, structure)


class FeatureExtractionLayer(layers.SequentialLayer):
  """A pipeline cell: layers run in order, some of whose outputs are exported.

  Transparent (base_layer): a cell only says where the cut falls, so its layers
  are named as the pipeline's ('pipe/layer3/w' in any cell), and a model cut
  otherwise has the same variables, initial values, dropout masks and checkpoint.
  """

  TRANSPARENT = True

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('act_fetch_layers', [],
             'Names of sub-layers whose outputs the pipeline also returns.')
    return p

  def __init__(self, params):
    super().__init__(params)
    names = [layer.params.name for layer in self.sub]
    unknown = [n for n in self.params.act_fetch_layers if n not in names]
    if unknown:
      raise ValueError(f'{self.path}: act_fetch_layers {unknown} are not sub-layers {names}.')

  def FPropWithActivations(self, theta, *args):
    """(outputs, NestedMap of the act_fetch_layers' outputs)."""
    return self.FPropAndOutputs(theta, args, self.params.act_fetch_layers)


@tf.function(autograph=False)
def _Now(clock):
  """tf.timestamp() in a call that takes the stage's `clock` variable.

  Inside a tf.function, automatic control dependencies chain every stateful op
  that has no resource input (tf.timestamp is one) in program order, which
  would make each stage's stamps wait for the other stages' steps. A call that
  takes a resource it only reads is ordered by nothing but its own inputs.
  """
  del clock  # Only its presence as an input matters.
  return tf.timestamp()


def _Stamp(clock, structure):
  """The time (seconds) once every tensor of `structure` exists."""
  with tf.control_dependencies([x for x in tf.nest.flatten(structure)
                                if isinstance(x, tf.Tensor)]):
    return _Now(clock)


def _Accumulate(total, grads):
  """The running sum of a stage's weight gradients (None before the first)."""
  return grads if total is None else tf.nest.map_structure(tf.add, total, grads)


def _Watch(tape, theta, args):
  tape.watch([x for x in tf.nest.flatten(args) if _IsFloatTensor(x)])
  tape.watch(tf.nest.flatten(theta))


def _CellGradients(tape, theta, args, targets, target_grads):
  """Gradients of `targets` (weighted by target_grads) w.r.t. args and theta."""
  pairs = [(t, g) for t, g in zip(tf.nest.flatten(targets), tf.nest.flatten(target_grads))
           if _IsFloatTensor(t)]
  flat_args = tf.nest.flatten(args)
  arg_index = [i for i, x in enumerate(flat_args) if _IsFloatTensor(x)]
  grads = tape.gradient(
      [t for t, _ in pairs], [flat_args[i] for i in arg_index] + tf.nest.flatten(theta),
      output_gradients=[tf.zeros_like(t) if g is None else tf.cast(g, t.dtype)
                        for t, g in pairs],
      unconnected_gradients=tf.UnconnectedGradients.ZERO)
  return (tf.nest.pack_sequence_as(args, _Replaced([None] * len(flat_args), arg_index, grads)),
          tf.nest.pack_sequence_as(theta, grads[len(arg_index):]))


class _CellSteps:
  """Cell k's forward and recompute-then-backward, each traced once as a function.

  A schedule step is then one call op: unrolling K=4 cells over M=32 inline
  made 80k ops and minutes of tracing. `_noinline` stops TensorFlow from
  inlining the calls back before it optimizes the graph. Where the micro-batch
  sits in the batch and the step are tensor arguments, so one trace serves
  every micro-batch; batch-norm statistics come back keyed by layer path, so
  no trace leaves state behind that another trace's calls would rely on.
  The first backward of a pass has no weight-gradient sum to add to: it is a
  function of its own, so neither function is traced twice (None, then sums).
  """

  def __init__(self, layer, k, device):
    self._layer = layer
    self._k = k
    self._device = device
    self._clock = None
    options = dict(autograph=False, experimental_attributes={'_noinline': True})
    self._forward = py_utils.DistinctFunction(self._Forward, **options)
    self._backward = py_utils.DistinctFunction(self._Backward, **options)
    self._first_backward = py_utils.DistinctFunction(self._FirstBackward, **options)

  def _Context(self, where, training, updates):
    offset, size, step = where
    batch_slice = py_utils.BatchSlice(offset, size, self._layer.params.batch_dim)
    return py_utils.Context(training=training, step=step, batch_slice=batch_slice,
                            updates=updates)

  def _Forward(self, theta, args, where, training):
    updates = []
    with tf.device(self._device), self._Context(where, training, updates):
      out, acts = self._layer.CellFProp(self._k, theta, args)
    stats = {}
    for layer, layer_stats in updates:
      stats.setdefault(layer.path, []).append(layer_stats)
    return out, acts, stats

  def _Backward(self, theta, args, grads_in, theta_grads, where, training, measure):
    with tf.device(self._device), self._Context(where, training, []):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        _Watch(tape, theta, args)
        out, acts = self._layer.CellFProp(self._k, theta, args)
      recomputed = _Stamp(self.clock, (out, acts)) if measure else None
      d_args, d_theta = _CellGradients(tape, theta, args, (out, acts), grads_in)
      return d_args, _Accumulate(theta_grads, d_theta), recomputed

  def _FirstBackward(self, theta, args, grads_in, where, training, measure):
    return self._Backward(theta, args, grads_in, None, where, training, measure)

  @property
  def clock(self):
    """The variable this stage's time stamps take (see _Now); made on first use."""
    if self._clock is None:
      with tf.init_scope(), tf.device(self._device):
        self._clock = tf.Variable(0.0, trainable=False, name=f'clock{self._k}')
    return self._clock

  @staticmethod
  def _Variable(x):
    # Grappler specializes a function for each call with constant inputs (here:
    # the micro-batch offset), which for K x M calls takes minutes; grappler does
    # not fold a PlaceholderWithDefault, so adding one (0) keeps inputs variable.
    zero = tf.raw_ops.PlaceholderWithDefault(input=tf.constant(0, tf.int64), shape=[])
    return zero + tf.cast(x, tf.int64)

  def Forward(self, theta, args, where, training):
    """(outputs, activations, [(layer, stats)]) of the cell.

    where: (offset of the micro-batch in the whole batch, its size, step).
    """
    out, acts, stats = self._forward(theta, args, tuple(map(self._Variable, where)), training)
    by_path = self._layer.cell[self._k].LayersByPath()
    return out, acts, [(by_path[path], s) for path in sorted(stats) for s in stats[path]]

  def Backward(self, theta, args, grads_in, theta_grads, where, training):
    """(input grads, theta_grads + this micro-batch's theta grads, time the recompute
    ended or None) of the cell; the sum happens inside the call, one op per step."""
    measure = py_utils.CurrentContext().step_stats is not None
    where = tuple(map(self._Variable, where))
    if theta_grads is None:
      return self._first_backward(theta, args, grads_in, where, training, measure)
    return self._backward(theta, args, grads_in, theta_grads, where, training, measure)


class _Run:
  """The state of one pipelined pass, executed one schedule step at a time.

  Holds the boundary activations waiting for their stage, forward tapes of
  micro-batches that are not re-materialized, output gradients waiting for
  their backward, and each stage's running sum of weight gradients.
  """

  def __init__(self, layer, replica, thetas, micro_args, remat, keep_inputs, step,
               first_example):
    self.layer = layer
    self.replica = replica
    self.training = py_utils.CurrentContext().training
    self.step = step  # Kept here: a backward runs when the tape asks, maybe out of context.
    self.first_example = first_example
    self.micro_batch_size = microbatch.BatchSize(micro_args[0], layer.params.batch_dim)
    self.devices = layer.ReplicaDevices(replica)
    self.cell_steps = layer.cell_steps[replica]
    self.thetas = thetas
    self.remat = remat
    self.keep_inputs = keep_inputs
    self.num_stages = len(thetas)
    self.num_micro_batches = len(micro_args)
    self.inputs = {(m, 0): args for m, args in enumerate(micro_args)}
    self.tapes = {}
    self.outputs = {}
    self.acts = {}
    self.out_grads = {}
    self.act_grads = {}
    self.input_grads = {}
    self.theta_grads = [None] * self.num_stages
    self.tokens = [[] for _ in range(self.num_stages)]
    self.updates = []
    self.loss_grad_fn = None  # 1F1B: called with m to set the last stage's output grads.

  def _Scope(self, stage, kind, m):
    """Device, name scope and FProp context of one step."""
    scope = contextlib.ExitStack()
    scope.enter_context(tf.device(self.devices[stage]))
    if self.layer.num_replicas > 1:
      scope.enter_context(tf.name_scope(f'replica{self.replica}'))
    scope.enter_context(tf.name_scope(f'stage{stage}_{kind}{m}'))
    offset, size, step = self._Where(m)
    scope.enter_context(py_utils.Context(
        training=self.training, step=step,
        batch_slice=py_utils.BatchSlice(offset, size, self.layer.params.batch_dim)))
    return scope

  def _Where(self, m):
    """(offset of micro-batch m in the whole batch, its size, step): what random ops need."""
    return (self.first_example + m * self.micro_batch_size, self.micro_batch_size, self.step)

  def _StartStamp(self, stage, inputs):
    """When measuring: (the time the step's inputs are ready, the inputs made to wait
    for that stamp, so that the step's work and its later stamps come after it);
    else (None, inputs)."""
    if py_utils.CurrentContext().step_stats is None:
      return None, inputs
    start = _Stamp(self.cell_steps[stage].clock, inputs)
    return start, _After([start], inputs)

  def _Record(self, stage, kind, m, start, outputs, recompute_end=None):
    """When measuring: appends the step's timing record to the context's list and
    returns [its end stamp] for the stage's next step to wait for (else []): a stamp
    that nothing waits for may run long after the outputs exist, when a busy
    executor gets to it."""
    stats = py_utils.CurrentContext().step_stats
    if stats is None:
      return []
    end = _Stamp(self.cell_steps[stage].clock, (outputs, recompute_end))
    stats.append(py_utils.NestedMap(
        replica=self.replica, stage=stage, kind=kind, micro_batch=m, start=start, end=end,
        recompute_end=recompute_end))
    return [end]

  def _Remat(self, m):
    return self.remat == 'always' or (self.remat == 'except_last' and
                                      m < self.num_micro_batches - 1)

  def Forward(self, m, k):
    """F(m, k): runs cell k on micro-batch m and hands its output on."""
    key = (m, k)
    with self._Scope(k, schedule_lib.FORWARD, m):
      args = _After(self.tokens[k], self.inputs[key])
      start, args = self._StartStamp(k, args)
      if self._Remat(m):
        out, acts, updates = self.cell_steps[k].Forward(self.thetas[k], args, self._Where(m),
                                                        self.training)
        if not self.keep_inputs:
          del self.inputs[key]
      else:
        updates = []
        tape = tf.GradientTape(watch_accessed_variables=False)
        with tape, py_utils.Context(updates=updates):
          _Watch(tape, self.thetas[k], args)
          out, acts = self.layer.CellFProp(k, self.thetas[k], args)
        self.tapes[key] = (tape, args, out, acts)
        del self.inputs[key]
      end = self._Record(k, schedule_lib.FORWARD, m, start, (out, acts))
    self.updates += updates
    self.tokens[k] = [x for x in tf.nest.flatten(out) if isinstance(x, tf.Tensor)] + end
    self.acts[key] = acts
    if k + 1 < self.num_stages:
      self.inputs[(m, k + 1)] = out
    else:
      self.outputs[m] = out

  def Backward(self, m, k):
    """B(m, k): gradients of cell k for micro-batch m, accumulated at once."""
    key = (m, k)
    if k == self.num_stages - 1 and key not in self.out_grads:
      self.loss_grad_fn(m)
    no_act_grads = tf.nest.map_structure(lambda _: None, self.acts[key])
    grads_in = (self.out_grads.pop(key), self.act_grads.pop(key, no_act_grads))
    with self._Scope(k, schedule_lib.BACKWARD, m):
      if key in self.tapes:
        tape, args, out, acts = self.tapes.pop(key)
        grads_in = _After(self.tokens[k], grads_in)
        start, grads_in = self._StartStamp(k, grads_in)
        d_args, d_theta = _CellGradients(tape, self.thetas[k], args, (out, acts), grads_in)
        self.theta_grads[k] = _Accumulate(self.theta_grads[k], d_theta)
        recomputed = None
      else:
        # The recompute also waits for the output gradient, so a stage holds a
        # cell's activations only while it can run that cell's backward.
        waits = self.tokens[k] + [g for g in tf.nest.flatten(grads_in) if g is not None]
        args, grads_in = _After(waits, (self.inputs.pop(key), grads_in))
        start, (args, grads_in) = self._StartStamp(k, (args, grads_in))
        d_args, self.theta_grads[k], recomputed = self.cell_steps[k].Backward(
            self.thetas[k], args, grads_in, self.theta_grads[k], self._Where(m), self.training)
      end = self._Record(k, schedule_lib.BACKWARD, m, start, (d_args, self.theta_grads[k]),
                   recomputed)
    self.tokens[k] = tf.nest.flatten(self.theta_grads[k]) + end
    if k > 0:
      self.out_grads[(m, k - 1)] = d_args
    else:
      self.input_grads[m] = d_args

  def Step(self, step):
    if step.kind == schedule_lib.FORWARD:
      self.Forward(step.micro_batch, step.stage)
    else:
      self.Backward(step.micro_batch, step.stage)

  def MergedOutputs(self):
    """(outputs, fetched activations) of the whole batch."""
    batch_dim = self.layer.params.batch_dim
    outputs = microbatch.Merge([self.outputs[m] for m in range(self.num_micro_batches)],
                               batch_dim)
    acts = py_utils.NestedMap()
    for k in range(self.num_stages):
      for name in self.acts[(0, k)]:
        acts[name] = microbatch.Merge(
            [self.acts[(m, k)][name] for m in range(self.num_micro_batches)], batch_dim)
    return outputs, acts

  def SetOutputGradients(self, d_outputs, d_acts):
    """Splits whole-batch gradients of outputs and activations per micro-batch."""
    batch_dim, num = self.layer.params.batch_dim, self.num_micro_batches
    for m, d in enumerate(microbatch.Split(d_outputs, num, batch_dim)):
      self.out_grads[(m, self.num_stages - 1)] = d
    for k in range(self.num_stages):
      names = list(self.acts[(0, k)])
      if names:
        pieces = microbatch.Split(py_utils.NestedMap({n: d_acts[n] for n in names}), num,
                                  batch_dim)
        for m, piece in enumerate(pieces):
          self.act_grads[(m, k)] = piece

  def MergedInputGradients(self):
    return microbatch.Merge([self.input_grads[m] for m in range(self.num_micro_batches)],
                            self.layer.params.batch_dim)


class _Replicas:
  """R data-parallel copies of one pipelined pass, each on 1/R of the batch.

  Weights live on replica 0's devices; every replica reads them onto its own
  devices, and the replicas' weight gradients are summed back on replica 0's
  devices: the all-reduce that makes R replicas train like one device on the
  whole batch. With R = 1 this is just the one _Run.
  """

  def __init__(self, layer, thetas, args, num_micro_batches, remat, step, keep_inputs=True):
    self._layer = layer
    batch_dim = layer.params.batch_dim
    parts = microbatch.Split(args, layer.num_replicas, batch_dim) if (
        layer.num_replicas > 1) else [args]
    rows = microbatch.BatchSize(parts[0], batch_dim)
    self.runs = [
        _Run(layer, r, layer.ReplicaThetas(thetas, r),
             microbatch.Split(part, num_micro_batches, batch_dim), remat, keep_inputs, step,
             first_example=r * rows)
        for r, part in enumerate(parts)]

  def Execute(self, steps):
    """Runs the schedule's steps, each on every replica."""
    for step in steps:
      for run in self.runs:
        run.Step(step)

  def _Merge(self, values):
    return values[0] if len(values) == 1 else microbatch.Merge(values, self._layer.params.batch_dim)

  def MergedOutputs(self):
    """(outputs, fetched activations) of the whole batch."""
    return self._Merge([run.MergedOutputs() for run in self.runs])

  def SetOutputGradients(self, d_outputs, d_acts):
    parts = microbatch.Split((d_outputs, d_acts), len(self.runs), self._layer.params.batch_dim) if (
        len(self.runs) > 1) else [(d_outputs, d_acts)]
    for run, (d_out, d_act) in zip(self.runs, parts):
      run.SetOutputGradients(d_out, d_act)

  def MergedInputGradients(self):
    return self._Merge([run.MergedInputGradients() for run in self.runs])

  @property
  def theta_grads(self):
    """Per stage, the weight gradients summed over replicas on replica 0's device."""
    if len(self.runs) == 1:
      return self.runs[0].theta_grads
    sums = []
    for k, device in enumerate(self._layer.ReplicaDevices(0)):
      with tf.device(device):
        sums.append(tf.nest.map_structure(lambda *g: tf.add_n(list(g)),
                                          *[run.theta_grads[k] for run in self.runs]))
    return sums

  @property
  def updates(self):
    return [u for run in self.runs for u in run.updates]

  def SetLossGradFn(self, fn):
    """1F1B: fn(run, m) sets the last stage's output gradients of run's micro-batch m."""
    for run in self.runs:
      run.loss_grad_fn = lambda m, run=run: fn(run, m)


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
             'Device names, one per cell; None takes the local or cluster devices.')
    p.Define('allow_device_reuse', False,
             'Place cells round-robin when there are fewer devices than cells.')
    p.Define('remat', 'always',
             "Re-materialization: 'always', 'except_last' (the last micro-batch keeps its "
             "activations) or 'never'.")
    p.Define('cell_remat_policy', remat_lib.NONE,
             "Re-materialization inside each cell (core/remat.py), set as each cell's "
             "remat_policy: 'none', 'every_layer', 'every_N' (e.g. 'every_2'), or layer names "
             "joined by '+' whose outputs are kept (a cell holding none is one segment).")
    p.Define('schedule', 'gpipe', "'gpipe' (fill-drain) or '1f1b' (ForwardBackward only).")
    p.Define('num_replicas', 1,
             'R data-parallel copies of the pipeline, each on 1/R of the batch; `devices` then '
             'lists R x K devices, replica r stage k at devices[r * K + k].')
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
    if p.schedule not in schedule_lib.SCHEDULE_NAMES:
      raise ValueError(f'Unknown schedule {p.schedule!r}; expected one of '
                       f'{list(schedule_lib.SCHEDULE_NAMES)}.')
    if p.micro_batch_size is not None and p.num_micro_batches != 1:
      raise ValueError(f'Set num_micro_batches ({p.num_micro_batches}) or micro_batch_size '
                       f'({p.micro_batch_size}), not both.')
    if not isinstance(p.num_replicas, int) or p.num_replicas < 1:
      raise ValueError(f'num_replicas must be a positive int, got {p.num_replicas!r}.')
    self._devices = devices_lib.StageDevices(len(p.cell_tpl), p.devices, p.allow_device_reuse,
                                             p.num_replicas)
    self.CreateChildren('before', p.before_tpl, devices=[self._devices[0]] * len(p.before_tpl))
    self.CreateChildren('cell', remat_lib.PolicyCells(p.cell_tpl, p.cell_remat_policy, self.path),
                        devices=self.ReplicaDevices(0))
    self._cell_steps = [[_CellSteps(self, k, device) for k, device in
                         enumerate(self.ReplicaDevices(r))] for r in range(p.num_replicas)]

  @property
  def devices(self):
    """The device of each stage."""
    return list(self._devices)

  @property
  def cell_steps(self):
    """Per replica and cell, the cell's forward and backward step functions."""
    return self._cell_steps

  @property
  def num_replicas(self):
    return self.params.num_replicas

  def ReplicaDevices(self, replica):
    """The stage devices of one replica (replica 0's hold the weights)."""
    return self._devices[replica * self.num_stages:(replica + 1) * self.num_stages]

  def ReplicaThetas(self, thetas, replica):
    """Replica 0's per-stage thetas, copied onto another replica's devices."""
    if replica == 0:
      return thetas
    copies = []
    for theta, device in zip(thetas, self.ReplicaDevices(replica)):
      with tf.device(device):
        copies.append(tf.nest.map_structure(tf.identity, theta))
    return copies

  @property
  def num_stages(self):
    return len(self.params.cell_tpl)

  # -- the params API (core/pipeline_params.py): how these params hold the layers ------

  @classmethod
  def NumStagesOf(cls, p):
    """K of pipeline params `p`, without building anything."""
    return len(p.cell_tpl)

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

  def NumMicroBatches(self, batch_size):
    """M of each replica for a whole batch of `batch_size`."""
    p = self.params
    if batch_size % p.num_replicas:
      raise ValueError(f'Batch size {batch_size} is not divisible by num_replicas='
                       f'{p.num_replicas}.')
    return microbatch.NumMicroBatches(batch_size // p.num_replicas, p.num_micro_batches,
                                      p.micro_batch_size)

  def GetSchedule(self, batch_size):
    """The schedule a batch of `batch_size` runs; print it to see it."""
    return schedule_lib.Schedule(self.params.schedule, self.num_stages,
                                 self.NumMicroBatches(batch_size))

  def CellFProp(self, k, theta, args):
    """Cell k's (output argument tuple, fetched activations) in the fprop dtype."""
    cell = self.cell[k]
    try:
      if isinstance(cell, FeatureExtractionLayer):
        out, acts = cell.FPropWithActivations(theta, *args)
      else:
        out, acts = cell.FProp(theta, *args), py_utils.NestedMap()
    except (ValueError, TypeError, tf.errors.InvalidArgumentError) as e:
      shapes = [getattr(x, 'shape', x) for x in tf.nest.flatten(args)]
      source = f'the output of cell {k - 1}' if k else 'the pipeline input'
      raise ValueError(f'Pipeline cell {k} ({cell.path}) cannot take {source} with shapes '
                       f'{shapes}: {e}') from e
    return _CastFloats(_AsArgs(out), self.fprop_dtype), acts

  # -- public entry points --------------------------------------------------------

  # The pipeline is plain Python run at trace time: AutoGraph converting it (when a
  # caller's tf.function has autograph on) only costs time, ~25 s at K=4, M=32.
  @tf.autograph.experimental.do_not_convert
  def FProp(self, theta, *inputs):
    """Pipelined forward; differentiable (fill-drain backward) with tf.GradientTape.

    Returns the whole batch's outputs, and, if any cell fetches activations,
    (outputs, NestedMap of activations).
    """
    args = self._Before(theta, inputs)
    num = self.NumMicroBatches(microbatch.BatchSize(args, self.params.batch_dim))
    thetas = self._StageThetas(theta)
    if py_utils.CurrentContext().training:
      outputs, acts = self._DifferentiablePipeline(thetas, args, num)
    else:
      run = _Replicas(self, thetas, args, num, remat='always', step=0, keep_inputs=False)
      run.Execute(schedule_lib.Schedule('gpipe', self.num_stages, num).ForwardSteps())
      outputs, acts = run.MergedOutputs()
    return self._Result(outputs, acts)

  @tf.autograph.experimental.do_not_convert
  def ForwardBackward(self, theta, inputs, loss_fn):
    """(loss, grads) of loss_fn(outputs) by the configured schedule.

    Args:
      theta: this layer's theta.
      inputs: a tensor, NestedMap, or tuple of them (the cells' arguments).
      loss_fn: maps the outputs (and, if cells fetch activations, the NestedMap
        of activations as a second argument) to the loss: a scalar, a Lingvo
        (value, weight) pair (value is a mean over weight items), or a NestedMap
        of such metrics holding 'loss'. 'gpipe' calls it once on the whole
        batch; '1f1b' calls it on each micro-batch as soon as it leaves the last
        stage, so the loss must decompose, and every schedule gives the same
        loss and gradients: (value, weight) pairs merge as sum(value * weight) /
        sum(weight); a bare scalar must be the sum or the mean of its
        micro-batch values, which a probe on random outputs tells, else it is
        refused with a ValueError (metrics.MicroBatchLoss).

    Returns:
      (loss, grads), grads a NestedMap shaped like theta; if loss_fn returns a
      NestedMap, the first value is the NestedMap of merged (value, weight).
    """
    args, before_tape = self._BeforeWithTape(theta, _AsArgs(inputs))
    num = self.NumMicroBatches(microbatch.BatchSize(args, self.params.batch_dim))
    sched = schedule_lib.Schedule(self.params.schedule, self.num_stages, num)
    run = _Replicas(self, self._StageThetas(theta), args, num, self.params.remat,
                    self._Step())
    metrics = []  # (NestedMap of (value, weight), whether loss_fn returned a NestedMap)
    if self.params.schedule == 'gpipe':
      run.Execute(sched.ForwardSteps())
      outputs, acts = run.MergedOutputs()
      batch_metrics, d_outputs, d_acts = self._LossGradients(
          loss_fn, outputs, acts, self.ReplicaDevices(0)[-1])
      metrics.append(batch_metrics)
      run.SetOutputGradients(d_outputs, d_acts)
      run.Execute(sched.BackwardSteps())
    else:
      micro_loss_fn = metrics_lib.MicroBatchLoss(loss_fn, num * self.num_replicas,
                                                 self.params.batch_dim, self.params.schedule)
      run.SetLossGradFn(lambda one_run, m: metrics.append(
          self._MicroBatchLossGradients(one_run, micro_loss_fn, m)))
      run.Execute(sched.steps)
    base_layer.ApplyRecordedUpdates(run.updates)
    merged = metrics_lib.MergeMetrics([m for m, _ in metrics])
    # The backward differentiated value * weight of each call: divide by the total weight.
    scale = 1.0 / merged.loss[1]
    grads = py_utils.NestedMap(
        before=self._BeforeGradients(theta, before_tape, args, run.MergedInputGradients()),
        cell=run.theta_grads).Transform(lambda g: g * tf.cast(scale, g.dtype))
    return (merged if metrics[0][1] else merged.loss[0]), grads

  # -- internals -------------------------------------------------------------------

  def _Step(self):
    """This training pass's step (BaseLayer.TrainingStep), read once for all its cells."""
    with tf.device(self._devices[0]):
      return tf.cast(self.TrainingStep(), tf.int64)

  def _Result(self, outputs, acts):
    """Unwraps a single output from its argument tuple; appends fetched activations."""
    if isinstance(outputs, tuple) and len(outputs) == 1:
      outputs = outputs[0]
    return (outputs, acts) if acts else outputs

  def _StageThetas(self, theta):
    """Each cell's theta as tensors read on that cell's device."""
    thetas = []
    for k, device in enumerate(self.ReplicaDevices(0)):
      with tf.device(device):
        thetas.append(tf.nest.map_structure(tf.convert_to_tensor, theta.cell[k]))
    return thetas

  def _Before(self, theta, inputs):
    args = tuple(inputs)
    with tf.device(self._devices[0]):
      for layer, layer_theta in zip(self.before, theta.before):
        args = _AsArgs(layer.FProp(layer_theta, *args))
    return args

  def _BeforeWithTape(self, theta, args):
    if not self.before:
      return args, None
    tape = tf.GradientTape(watch_accessed_variables=False)
    with tape:
      tape.watch(tf.nest.flatten(theta.before))
      args = self._Before(theta, args)
    return args, tape

  def _BeforeGradients(self, theta, tape, args, d_args):
    if tape is None:
      return theta.before
    pairs = [(a, g) for a, g in zip(tf.nest.flatten(args), tf.nest.flatten(d_args))
             if g is not None]
    with tf.device(self._devices[0]):
      grads = tape.gradient([a for a, _ in pairs], tf.nest.flatten(theta.before),
                            output_gradients=[g for _, g in pairs],
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
    return tf.nest.pack_sequence_as(theta.before, grads)

  def _LossGradients(self, loss_fn, outputs, acts, device):
    """loss_fn's metrics and the gradients of value * weight of their loss."""
    floats = [x for x in tf.nest.flatten((outputs, acts)) if _IsFloatTensor(x)]
    with tf.device(device), tf.GradientTape() as tape:
      tape.watch(floats)
      result = self._Result(outputs, acts)
      value = loss_fn(*result) if acts else loss_fn(result)
      metrics = metrics_lib.AsMetrics(value)
      loss, weight = metrics.loss
      weighted = loss * tf.stop_gradient(weight)
    grads = iter(tape.gradient(weighted, floats,
                               unconnected_gradients=tf.UnconnectedGradients.ZERO))
    d_outputs, d_acts = tf.nest.map_structure(
        lambda x: next(grads) if _IsFloatTensor(x) else None, (outputs, acts))
    return (metrics, isinstance(value, dict)), d_outputs, d_acts

  def _MicroBatchLossGradients(self, run, loss_fn, m):
    """1F1B: micro-batch m's loss; its gradients become the backward's inputs."""
    acts = py_utils.NestedMap()
    for k in range(self.num_stages):
      acts.update(run.acts[(m, k)])
    metrics, d_outputs, d_acts = self._LossGradients(loss_fn, run.outputs[m], acts,
                                                     run.devices[-1])
    run.out_grads[(m, self.num_stages - 1)] = d_outputs
    for k in range(self.num_stages):
      run.act_grads[(m, k)] = py_utils.NestedMap({n: d_acts[n] for n in run.acts[(m, k)]})
    return metrics

  def _DifferentiablePipeline(self, thetas, args, num):
    """The training forward, with the pipelined backward as its custom gradient."""
    if self.params.schedule != 'gpipe':
      raise ValueError(f"FProp under a gradient tape runs the 'gpipe' schedule; with "
                       f"schedule={self.params.schedule!r} use ForwardBackward.")
    sched = schedule_lib.Schedule('gpipe', self.num_stages, num)
    step = self._Step()
    flat_theta, flat_args = tf.nest.flatten(thetas), tf.nest.flatten(args)
    arg_pos = [i for i, x in enumerate(flat_args) if isinstance(x, tf.Tensor)]
    box = {}

    @tf.custom_gradient
    def Pipeline(*tensors):
      # stop_gradient: the caller's tape must not record (and keep) cell internals.
      stopped = [tf.stop_gradient(x) for x in tensors]
      run_args = _Replaced(flat_args, arg_pos, stopped[len(flat_theta):])
      run = _Replicas(self, tf.nest.pack_sequence_as(thetas, stopped[:len(flat_theta)]),
                      tf.nest.pack_sequence_as(args, run_args), num, self.params.remat, step)
      run.Execute(sched.ForwardSteps())
      structure = run.MergedOutputs()
      flat_out = tf.nest.flatten(structure)
      out_pos = [i for i, x in enumerate(flat_out) if isinstance(x, tf.Tensor)]
      box.update(run=run, structure=structure, flat_out=flat_out, out_pos=out_pos)

      def Grad(*d_tensors):
        d_out = tf.nest.pack_sequence_as(
            structure, _Replaced([None] * len(flat_out), out_pos, d_tensors))
        run.SetOutputGradients(*d_out)
        run.Execute(sched.BackwardSteps())
        d_args = tf.nest.flatten(run.MergedInputGradients())
        return tf.nest.flatten(run.theta_grads) + [d_args[i] for i in arg_pos]

      return [flat_out[i] for i in out_pos], Grad

    out_tensors = Pipeline(*flat_theta, *[flat_args[i] for i in arg_pos])
    base_layer.ApplyRecordedUpdates(box['run'].updates)
    flat_out = _Replaced(box['flat_out'], box['out_pos'], out_tensors)
    return tf.nest.pack_sequence_as(box['structure'], flat_out)


def _Replaced(values, positions, replacements):
  """A copy of `values` with values[positions[i]] = replacements[i]."""
  values = list(values)
  for i, x in zip(positions, replacements):
    values[i] = x
  return values


# -- partitioning ------------------------------------------------------------------


def _ShapesAsArgs(input_shape):
  if isinstance(input_shape, (list, tuple)) and not isinstance(input_shape, tf.TensorShape):
    if input_shape and all(isinstance(s, (tf.TensorShape, tf.TensorSpec, py_utils.NestedMap))
                           for s in input_shape):
      return tuple(input_shape)
  return (input_shape,)


def _FlopCosts(layer_params_list, input_shapes):
  costs = []
  for p in layer_params_list:
    meta = p.cls.FPropMeta(p, *input_shapes)
    costs.append(float(meta.flops))
    input_shapes = tuple(meta.out_shapes)
  return costs


def _Named(layer_params_list):
  named = []
  for i, p in enumerate(layer_params_list):
    p = p.Copy()
    p.name = p.name or f'layer{i}'
    named.append(p)
  return named


def _ParamCosts(layer_params_list):
  costs = []
  for p in layer_params_list:
    layer = p.Instantiate()
    costs.append(float(sum(np.prod(v.shape) for v in layer.trainable_variables)))
    del layer
  return costs


def _TimeCosts(layer_params_list, input_shapes):
  """Median forward + backward seconds of each layer (profiler.ProfileLayers)."""
  return [p.forward_s + p.backward_s for p in
          profiler.ProfileLayers(layer_params_list, tuple(input_shapes), memory=False)]


COST_KINDS = ('auto', 'flops', 'params', 'time')


def LayerCosts(layer_params_list, input_shape, cost='auto'):
  """Per-layer costs: FLOPs (FPropMeta), parameter count or measured time."""
  layer_params_list = _Named(layer_params_list)
  if cost == 'auto':
    cost = 'flops' if all(p.cls.HasFPropMeta() for p in layer_params_list) else 'params'
  if cost == 'flops':
    missing = sorted({p.cls.__name__ for p in layer_params_list if not p.cls.HasFPropMeta()})
    if missing:
      raise ValueError(f"cost='flops' needs FPropMeta on every layer; missing on {missing}.")
    return _FlopCosts(layer_params_list, _ShapesAsArgs(input_shape))
  if cost == 'params':
    return _ParamCosts(layer_params_list)
  if cost == 'time':
    return _TimeCosts(layer_params_list, _ShapesAsArgs(input_shape))
  raise ValueError(f'Unknown cost {cost!r}; expected one of {list(COST_KINDS)} or a list of '
                   'per-layer numbers.')


def PartitionSequentialLayers(layer_params_list, num_partitions, input_shape, cost='auto'):
  """Cuts a layer list into `num_partitions` balanced FeatureExtractionLayer params.

  Args:
    layer_params_list: layer params, run in order.
    num_partitions: K, the number of stages.
    input_shape: the first layer's input tf.TensorShape (or TensorSpec), or a
      list of them for several inputs, or a NestedMap of them for one NestedMap.
    cost: 'auto' (FLOPs if every layer has FPropMeta, else parameter count),
      'flops', 'params', 'time' (profile each layer forward+backward once), or a
      list of per-layer numbers.

  Returns:
    K FeatureExtractionLayer params named cell0..cell{K-1}.
  """
  named = _Named(layer_params_list)
  costs = list(cost) if isinstance(cost, (list, tuple)) else LayerCosts(named, input_shape, cost)
  if len(costs) != len(named):
    raise ValueError(f'Got {len(costs)} costs for {len(named)} layers.')
  return CellsFromEnds(named, partition.Balance(costs, num_partitions))


def CellsFromEnds(layer_params_list, ends, act_fetch_layers=()):
  """FeatureExtractionLayer params cell0.. holding layers [ends[k-1], ends[k]).

  act_fetch_layers: names of layers whose outputs are fetched, in whichever cell.
  """
  cells = []
  for k, (a, b) in enumerate(zip([0] + list(ends[:-1]), ends)):
    sub = layer_params_list[a:b]
    cells.append(FeatureExtractionLayer.Params().Set(
        name=f'cell{k}', sub=sub,
        act_fetch_layers=[q.name for q in sub if q.name in act_fetch_layers]))
  return cells
