"""The pipeline executor: runs a schedule's actions (schedule_actions.py) one by one.

The executor is Python that runs once, while the step is traced: it emits
each action's ops in the schedule's order, and from then on only the graph
runs. Each action is one call of a function of its chunk (`cell_functions.CellFunctions`),
traced once per chunk and kind, so a step's graph is a thin list of calls
whatever M is. One pass of a PipeliningLayer keeps, per replica, a `Pass`: the
boundary activations waiting for their chunk, forward tapes of micro-batches
that are not re-materialized, output gradients waiting for their backward,
what a pending W needs, and the token of each chunk's last add to its running
sum of weight gradients (a GradientSum, added to in place). Each action kind
has one code path:

  F(m, c)   chunk c's forward on micro-batch m, handed to chunk c+1; without
            remat under a tape, which keeps what the call's backward needs;
  L(m)      the loss of micro-batch m (or of the whole batch) and its gradient,
            computed by the caller's `on_loss`;
  BW(m, c)  both gradients, from the forward's tape or a call that recomputes,
            the weight gradient added to the chunk's sum at once;
  B(m, c)   a call that recomputes the chunk and takes the input gradient, what
            the chunk before waits for, and what W needs: the gradients of the
            ops that read the weights and those ops' other inputs, as tensors
            (weight_grads.py); the chain of activation gradients is walked once;
  W(m, c)   a call that takes the weight gradients from what B handed over.

In graphs, each action's call waits (control dependencies) for the previous
action of the same device, so TensorFlow runs the order the schedule prints and
cannot run ahead and hold more activations than the schedule says. With R
replicas (`Replicas`) every replica runs the same actions on 1/R of the batch
and their weight gradients are summed. Parts of a batch that R or M does not
divide differ by a row (microbatch.Split); each micro-batch's random ops and
statistics use its own offset and size.
"""

import contextlib

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule_actions
from lingvo_gpipe.pipeline import steady_state

F, B, W, BW, L = (schedule_actions.FORWARD, schedule_actions.INPUT_GRAD,
                  schedule_actions.WEIGHT_GRAD, schedule_actions.BACKWARD, schedule_actions.LOSS)


def AsArgs(value):
  """A cell's output as the argument tuple of the next cell."""
  return value if isinstance(value, tuple) else (value,)


def MicroBatchWheres(sizes, offsets):
  """(the table, per micro-batch its row): each micro-batch's (offset, size) as one int64
  vector.

  Grappler specializes a function for each call with constant inputs (here:
  the micro-batch offset), which for K x M calls takes minutes; it does not
  fold a PlaceholderWithDefault, which keeps the table variable: two ops and a
  constant per device and pass, not some per action.
  """
  table = tf.cast(tf.stack([tf.stack([o, s]) for o, s in zip(offsets, sizes)]), tf.int64)
  table = tf.raw_ops.PlaceholderWithDefault(input=table, shape=[len(sizes), 2])
  return table, tf.unstack(table)


# -- one replica's pass -------------------------------------------------------------------------


class Pass:
  """One replica's pipelined pass over its micro-batches, run one action at a time.

  Args:
    layer: the PipeliningLayer (cells, devices, placement, CellFProp).
    replica: r.
    thetas: per chunk, its theta read on its device.
    micro_args: per micro-batch, the first chunk's argument tuple.
    remat: 'always', 'except_last' or 'never' (gpipe.REMAT_MODES).
    keep_inputs: keep a re-materialized chunk's input for its backward (False
      for a forward-only pass).
    step: the training step, which random ops need (BaseLayer.TrainingStep).
    first_example: where this replica's rows start in the whole batch.
    split: the (micro-batch, chunk) pairs whose backward is split into B and W.
    tracer: a StepTracer, or None.
    need_input_grads: whether a caller uses the gradients of the first chunk's
      arguments (MergedInputGradients); without, the first chunk's backward skips
      them: the projection that makes them is one of the chunk's matmuls.
    batch: the replica's whole batch that micro_args split; where a schedule's
      steady state runs as a loop, its micro-batches are taken from it.
  """

  def __init__(self, layer, replica, thetas, micro_args, remat, keep_inputs, step,
               first_example, split=frozenset(), tracer=None, need_input_grads=True,
               batch=None):
    self.layer = layer
    self.replica = replica
    self.training = py_utils.CurrentContext().training
    self.step = step  # Kept here: a backward runs when the tape asks, maybe out of context.
    self.first_example = first_example
    # Rows of each micro-batch (uneven when M does not divide the rows; tensors when the
    # batch size is unknown at trace time) and where each starts in this replica's rows.
    self.sizes = [microbatch.BatchSize(args, layer.params.batch_dim) for args in micro_args]
    self.offsets = microbatch.Offsets(self.sizes)
    self.devices = layer.ReplicaDevices(replica)
    self.placement = layer.placement
    self.functions = layer.cell_functions[replica]
    self.thetas = thetas
    self.remat = remat
    self.keep_inputs = keep_inputs
    self.split = split
    self.tracer = tracer
    self.need_input_grads = need_input_grads
    self.num_chunks = len(thetas)
    self.num_micro_batches = len(micro_args)
    self.inputs = {(m, 0): args for m, args in enumerate(micro_args)}
    self.tapes = {}
    self.pending_w = {}
    self.outputs = {}  # The last chunk's outputs, kept for MergedOutputs (keep_outputs).
    self.to_losses = {}  # Those a micro-batch's loss (L) takes next (losses_follow).
    self.acts = {}
    self.out_grads = {}
    self.act_grads = {}
    self.input_grads = {}
    # Per chunk, the token of its last weight-gradient add or of its Zero (None before): the sum
    # itself is in the chunk's GradientSum (ThetaGrads reads it).
    self.theta_grads = [None] * self.num_chunks
    self.tokens = [[] for _ in self.devices]
    self.earlier_tokens = [[] for _ in self.devices]  # Those of the action before last.
    self.awaited = set()  # Actions whose device waits idle for their input (Replicas.Execute).
    self.updates = []
    self.wheres = {}  # Per device, each micro-batch's (offset, size) (_Where).
    self.batch = batch  # The replica's rows, which micro_args split (for loops).
    self.keep_outputs = True  # Whether MergedOutputs will be asked for.
    self.losses_follow = False  # Whether L actions take micro-batches' outputs (Execute).
    self.losses = []  # What on_loss returned for each L action, in order (Replicas.Execute).
    self.loop = None  # (iteration, stride) while a loop's period is traced (_Index).
    self.released = set()  # Micro-batches whose first forward ran (_Released).
    if keep_inputs:
      # Made now, not by the first backward: a backward may run where no variable can be
      # made (a tape's gradient, in a caller's function traced again).
      for function, theta in zip(self.functions, thetas):
        function.grad_sum.Variables(theta)
    self._handlers = {F: self._Forward, B: self._InputGrad, W: self._WeightGrad,
                      BW: self._Backward}

  def Run(self, action):
    """Runs one F, B, W or BW action on its chunk's device, after that device's last one."""
    device = self.placement[action.chunk]
    with self._Scope(action):
      tokens = self._handlers[action.kind](action, device)
    self.earlier_tokens[device], self.tokens[device] = self.tokens[device], tokens

  def _Scope(self, action):
    """Device, name scope and FProp context of one action."""
    scope = contextlib.ExitStack()
    scope.enter_context(tf.device(self.devices[action.chunk]))
    if self.layer.num_replicas > 1:
      scope.enter_context(tf.name_scope(f'replica{self.replica}'))
    scope.enter_context(tf.name_scope(f'chunk{action.chunk}_{action.kind}{action.micro_batch}'))
    return scope

  def _Where(self, m, device):
    """Micro-batch m's (offset in the whole batch, size) as the device's functions take it
    (MicroBatchWheres, made once per device and pass; in a loop, the iteration's row)."""
    if device not in self.wheres:
      with tf.name_scope('micro_batch_wheres'):
        self.wheres[device] = MicroBatchWheres(
            self.sizes, [self.first_example + o for o in self.offsets])
    table, rows = self.wheres[device]
    return rows[m] if self.loop is None else tf.gather(table, self._Index(m))

  # -- a steady state run as one loop (steady_state.RunLoop) ------------------------------------

  def _Index(self, m):
    """Micro-batch m as data ops take it: in a loop, that of the iteration (a tensor)."""
    if self.loop is None:
      return m
    i, stride = self.loop
    return m + i * stride

  def _FirstArgs(self, m):
    """Micro-batch m's arguments of the first chunk: in a loop, the iteration's rows of the
    batch, taken where the batch is."""
    if self.loop is None:
      return self.inputs[(m, 0)]
    return microbatch.Part(self.batch, self._Index(m), self.sizes[0], self.layer.params.batch_dim)

  def MicroBatchRows(self, whole, parts, m):
    """Micro-batch m's rows of `whole`, which `parts` splits as the inputs are (labels): in a
    loop, the iteration's."""
    if self.loop is None:
      return parts[m]
    return microbatch.Part(whole, self._Index(m), self.sizes[0], self.layer.params.batch_dim)

  def CanLoop(self):
    """Whether windows of a schedule may run as loops: traced, untimed, on micro-batches of
    one size (steady_state.RunLoop checks the rest)."""
    return (not tf.executing_eagerly() and self.tracer is None and self.batch is not None and
            self.layer.params.loop_steady_state and
            all(isinstance(n, int) and n == self.sizes[0] > 0 for n in self.sizes))

  def SameTrace(self, a, b):
    """Whether actions a and b of one kind and chunk may run as one traced call in a loop: no
    tape kept across it (a forward not re-materialized keeps one), alike micro-batches."""
    def Kind(action):
      m = action.micro_batch
      return self._Remat(m), (m, action.chunk) in self.split, action in self.awaited

    remat, split, awaited = Kind(a)
    return Kind(a) == Kind(b) and (remat or split) and not awaited

  def CloseTokens(self):
    """Makes each device's tokens one tensor (a loop's variables keep one structure) and
    every chunk's gradient sum started."""
    for c in range(self.num_chunks):
      self._LastAdd(c, [])
    for tokens in (self.tokens, self.earlier_tokens):
      for k, waits in enumerate(tokens):
        with tf.control_dependencies(waits):
          # Not a constant, which Grappler would fold without its dependencies.
          tokens[k] = [tf.raw_ops.PlaceholderWithDefault(input=True, shape=[])]

  def _Begin(self, device, inputs):
    """What the device's next call waits for (its previous action, the start stamp) and the
    start stamp (None without a tracer)."""
    if self.tracer is None:
      return list(self.tokens[device]), None
    start = self.tracer.Start(device, (inputs, self.tokens[device]))
    return [start], start

  def _End(self, device, action, start, outputs, recompute_end=None, handed_over=()):
    """The tokens the device's next action waits for."""
    tokens = py_utils.Tensors(outputs)
    if self.tracer is not None:
      tokens.append(self.tracer.End(self.replica, device, action, start, outputs, recompute_end))
    return tokens + list(handed_over)

  def _HandOver(self, sender, consumer, value):
    """(value as `consumer` takes it from chunk `sender`, tokens for the sender's next action
    to wait for).

    A device's first action of a pass (`awaited`) waits idle for its input. The
    sender's next action is ready at once, and on a worker process whose one core
    runs it, TensorFlow's send of `value` waited for a thread behind it: 2-4 ms
    per step on two workers, against 0.2 later. For those hand-overs the value is
    copied onto the receiver, and the sender goes on once the copy exists.
    """
    to_device = self.devices[consumer.chunk]
    if (consumer not in self.awaited or to_device == self.devices[sender] or
        tf.executing_eagerly()):  # (Stages may share a device: allow_device_reuse.)
      return value, []
    with tf.name_scope(f'hand_over_to_chunk{consumer.chunk}_{consumer.micro_batch}/'), \
        tf.device(to_device):
      value = tf.nest.map_structure(
          lambda x: tf.identity(x) if isinstance(x, tf.Tensor) else x, value)
    return value, py_utils.Tensors(value)

  def _Released(self, m, device):
    """Micro-batch m's first-chunk arguments, passed on from where the batch is split only
    once the first device has run its action before last: a batch held elsewhere (in a
    host's memory, on the client) then reaches the first device a micro-batch or two at a
    time, while its previous action runs, not all of it when the step starts."""
    args = self._FirstArgs(m)
    if tf.executing_eagerly() or not self.earlier_tokens[device]:
      return args

    def Release(x):
      # Where the split is: outer device scopes cleared, and unplaced if the split is.
      with tf.name_scope(f'released_input{m}/'), tf.device(None), tf.device(x.device), \
          tf.control_dependencies(self.earlier_tokens[device]):
        return tf.identity(x)

    return tf.nest.map_structure(lambda x: Release(x) if isinstance(x, tf.Tensor) else x, args)

  def _Remat(self, m):
    return self.remat == 'always' or (self.remat == 'except_last' and
                                      m < self.num_micro_batches - 1)

  def _Forward(self, action, device):
    """F: one call of the chunk's forward; without remat under a tape, which keeps what the
    backward needs. A split backward's B recomputes: its forward keeps only its input."""
    m, c = action.micro_batch, action.chunk
    key = (m, c)
    if c == 0:
      self.inputs[key] = self._Released(m, device)
      self.released.add(m)
    args = self.inputs[key]
    waits, start = self._Begin(device, args)
    taped = not (self._Remat(m) or key in self.split)
    tape = tf.GradientTape(watch_accessed_variables=False) if taped else None
    with tf.control_dependencies(waits), tape or contextlib.nullcontext():
      if taped:
        cell_functions.Watch(tape, self.thetas[c], args if self._WantsArgGrads(c) else ())
      out, acts, updates = self.functions[c].Forward(
          self.thetas[c], args, self._Where(m, device), self.step, self.training)
    if taped:
      self.tapes[key] = (tape, args if self._WantsArgGrads(c) else None, (out, acts))
    if taped or not self.keep_inputs:
      del self.inputs[key]
    self.updates += updates
    self.acts[key] = acts
    handed_over = []
    if c + 1 < self.num_chunks:
      self.inputs[(m, c + 1)], handed_over = self._HandOver(
          c, schedule_actions.Action(F, m, c + 1), out)
    else:
      if self.keep_outputs:
        self.outputs[m] = out
      if self.losses_follow:
        self.to_losses[m] = out
    return self._End(device, action, start, (out, acts), handed_over=handed_over)

  def _GradsIn(self, m, c):
    """(output gradient, fetched activations' gradients) of micro-batch m on chunk c."""
    key = (m, c)
    no_act_grads = tf.nest.map_structure(lambda _: None, self.acts[key])
    return (self.out_grads.pop(key), self.act_grads.pop(key, no_act_grads))

  def _WantsArgGrads(self, c):
    return c > 0 or self.need_input_grads

  def _HandOn(self, m, c, d_args):
    """Passes chunk c's input gradient on; returns the tokens of an awaited hand-over."""
    if c == 0:
      self.input_grads[m] = d_args
      return []
    consumer = schedule_actions.Action(B if (m, c - 1) in self.split else BW, m, c - 1)
    self.out_grads[(m, c - 1)], handed_over = self._HandOver(c, consumer, d_args)
    return handed_over

  def _LastAdd(self, c, waits):
    """The tokens chunk c's next weight-gradient add waits for: its last add, or a Zero of
    its sum (made after `waits`) before the pass's first."""
    if self.theta_grads[c] is None:
      with tf.control_dependencies(waits):
        self.theta_grads[c] = self.functions[c].Zero(self.thetas[c])
    return waits + [self.theta_grads[c]]

  def _Added(self, c, token):
    """Records chunk c's latest weight-gradient add."""
    self.theta_grads[c] = token
    return token

  def _Clock(self, device):
    return None if self.tracer is None else self.tracer.clocks[device]

  def _Backward(self, action, device):
    """BW: both gradients, from the forward's tape or one call that recomputes; the weight
    gradient is added to the chunk's sum at once."""
    m, c = action.micro_batch, action.chunk
    grads_in = self._GradsIn(m, c)
    waits, start = self._Begin(device, grads_in)
    fn, where = self.functions[c], self._Where(m, device)
    with tf.control_dependencies(self._LastAdd(c, waits)):
      if (m, c) in self.tapes:
        tape, args, targets = self.tapes.pop((m, c))
        d_args, d_theta = cell_functions.CellGradients(tape, targets, grads_in, args,
                                                       self.thetas[c])
        added = fn.Accumulate(self.thetas[c], d_theta, where, self.sizes[m])
        recomputed = None
      else:
        d_args, added, recomputed = fn.Backward(
            self.thetas[c], self.inputs.pop((m, c)), grads_in, where, self.step,
            self.training, self.sizes[m], self._Clock(device), self._WantsArgGrads(c))
    handed_over = self._HandOn(m, c, d_args)
    return self._End(device, action, start, (d_args, self._Added(c, added)), recomputed,
                     handed_over)

  def _InputGrad(self, action, device):
    """B: the input gradient, and what W needs, from one call that recomputes the chunk."""
    m, c = action.micro_batch, action.chunk
    grads_in = self._GradsIn(m, c)
    fn = self.functions[c]
    waits, start = self._Begin(device, grads_in)
    # A B that takes the weight gradients too (fn.splits is False) adds after the last add.
    with tf.control_dependencies(self._LastAdd(c, waits)):
      d_args, pending, added, recomputed = fn.InputGrad(
          self.thetas[c], self.inputs.pop((m, c)), grads_in, self._Where(m, device), self.step,
          self.training, self.sizes[m], self._Clock(device), self._WantsArgGrads(c))
    if added is not None:
      self._Added(c, added)
    self.pending_w[(m, c)] = pending if added is None else added
    handed_over = self._HandOn(m, c, d_args)
    # The device's next action waits for the pending tensors too: a first chunk's B may have
    # no input gradient to wait for.
    return self._End(device, action, start, (d_args, pending, added), recomputed, handed_over)

  def _WeightGrad(self, action, device):
    """W: the weight gradients from what B handed over, added to the chunk's sum."""
    m, c = action.micro_batch, action.chunk
    pending = self.pending_w.pop((m, c))
    waits, start = self._Begin(device, ())
    if isinstance(pending, tf.Tensor):  # B took the weight gradients: nothing left to do.
      return self._End(device, action, start, pending)
    with tf.control_dependencies(self._LastAdd(c, waits)):
      added = self.functions[c].WeightGrad(self.thetas[c], pending, self._Where(m, device),
                                           self.sizes[m])
    return self._End(device, action, start, self._Added(c, added))

  def ThetaGrads(self):
    """Per chunk, the sum of its weight gradients over the micro-batches."""
    return [self.functions[c].grad_sum.Read(self.thetas[c], added)
            for c, added in enumerate(self.theta_grads)]

  def MergedOutputs(self):
    """(outputs, fetched activations) of the whole batch."""
    batch_dim = self.layer.params.batch_dim
    outputs = microbatch.Merge([self.outputs[m] for m in range(self.num_micro_batches)],
                               batch_dim)
    acts = py_utils.NestedMap()
    for c in range(self.num_chunks):
      for name in self.acts[(0, c)]:
        acts[name] = microbatch.Merge(
            [self.acts[(m, c)][name] for m in range(self.num_micro_batches)], batch_dim)
    return outputs, acts

  def MicroBatchOutputs(self, m):
    """(outputs, fetched activations) of micro-batch m."""
    acts = py_utils.NestedMap()
    for c in range(self.num_chunks):
      acts.update(self.acts[(m, c)])
    return self.to_losses.pop(m), acts

  def SetMicroBatchOutputGradients(self, m, d_outputs, d_acts):
    self.out_grads[(m, self.num_chunks - 1)] = d_outputs
    for c in range(self.num_chunks):
      self.act_grads[(m, c)] = py_utils.NestedMap({n: d_acts[n] for n in self.acts[(m, c)]})

  def SetOutputGradients(self, d_outputs, d_acts):
    """Splits whole-batch gradients of outputs and activations per micro-batch."""
    num = self.num_micro_batches
    batch_dim = self.layer.params.batch_dim
    outs = microbatch.Split(d_outputs, num, batch_dim)
    acts = microbatch.Split(d_acts, num, batch_dim) if d_acts else [d_acts] * num
    for m in range(num):
      self.SetMicroBatchOutputGradients(m, outs[m], acts[m])

  def MergedInputGradients(self):
    if not self.need_input_grads:
      raise ValueError('This pass was made with need_input_grads=False: its first chunk '
                       'did not take the gradients of its arguments.')
    return microbatch.Merge([self.input_grads[m] for m in range(self.num_micro_batches)],
                            self.layer.params.batch_dim)


def _FirstActions(actions, placement):
  """Each stage's first action among `actions` whose input another stage makes (a first
  chunk's forward takes the batch): until that input arrives the stage is idle."""
  firsts = {}
  for action in actions:
    if action.kind != L:
      firsts.setdefault(placement[action.chunk], action)
  return {a for a in firsts.values() if not (a.kind == F and a.chunk == 0)}


class Replicas:
  """R data-parallel copies of one pipelined pass, each on 1/R of the batch.

  Weights live on replica 0's devices; every replica reads them onto its own
  devices, and the replicas' weight gradients are summed back on replica 0's
  devices: the all-reduce that makes R replicas train like one device on the
  whole batch. With R = 1 this is just the one Pass.
  """

  def __init__(self, layer, thetas, args, num_micro_batches, remat, step, keep_inputs=True,
               split=frozenset(), tracer=None, need_input_grads=True, keep_outputs=True):
    self._layer = layer
    batch_dim = layer.params.batch_dim
    parts = microbatch.Split(args, layer.num_replicas, batch_dim) if (
        layer.num_replicas > 1) else [args]
    firsts = microbatch.Offsets([microbatch.BatchSize(part, batch_dim) for part in parts])
    self.passes = [
        Pass(layer, r, layer.ReplicaThetas(thetas, r),
             microbatch.Split(part, num_micro_batches, batch_dim), remat, keep_inputs, step,
             first_example=first, split=split, tracer=tracer,
             need_input_grads=need_input_grads, batch=part)
        for r, (part, first) in enumerate(zip(parts, firsts))]
    for one in self.passes:
      one.keep_outputs = keep_outputs
    self._whole_batch_losses = []

  def Execute(self, actions, on_loss=None):
    """Runs the actions, each on every replica; a stretch that repeats itself (a steady
    state, steady_state.Windows) runs as one loop.

    on_loss(pass, m) computes micro-batch m's loss, sets its output gradients
    (SetMicroBatchOutputGradients) and returns its metrics; on_loss(None, ALL), for
    a whole-batch L(*), those of every replica
    (SetOutputGradients); `losses` keeps what they return.
    """
    awaited = _FirstActions(actions, self._layer.placement)
    for one in self.passes:
      one.awaited = awaited
      one.losses_follow = any(a.kind == L and a.micro_batch != schedule_actions.ALL
                              for a in actions)
    done = 0
    for window in self._Windows(actions):
      for action in actions[done:window.start]:
        self._Run(action, on_loss)
      period = actions[window.start:window.start + window.period]
      try:
        steady_state.RunLoop(self.passes[0], period, window.repeats, window.stride,
                             lambda a: self._Run(a, on_loss))
      except steady_state.NotPeriodic:  # E.g. fill-drain: all its inputs stay in flight.
        for action in actions[window.start:window.end]:
          self._Run(action, on_loss)
      done = window.end
    for action in actions[done:]:
      self._Run(action, on_loss)

  def _Windows(self, actions):
    one = self.passes[0]
    if len(self.passes) > 1 or not one.CanLoop():
      return []
    return steady_state.Windows(actions, one.SameTrace)

  def _Run(self, action, on_loss):
    if action.kind == L and action.micro_batch == schedule_actions.ALL:
      self._whole_batch_losses.append(on_loss(None, schedule_actions.ALL))
    elif action.kind == L:
      for one in self.passes:
        with tf.device(one.devices[action.chunk]):
          one.losses.append(on_loss(one, action.micro_batch))
    else:
      for one in self.passes:
        one.Run(action)

  def _Merge(self, values):
    return values[0] if len(values) == 1 else microbatch.Merge(values, self._layer.params.batch_dim)

  def MergedOutputs(self):
    """(outputs, fetched activations) of the whole batch."""
    return self._Merge([one.MergedOutputs() for one in self.passes])

  def SetOutputGradients(self, d_outputs, d_acts):
    parts = microbatch.Split((d_outputs, d_acts), len(self.passes),
                             self._layer.params.batch_dim) if (
                                 len(self.passes) > 1) else [(d_outputs, d_acts)]
    for one, (d_out, d_act) in zip(self.passes, parts):
      one.SetOutputGradients(d_out, d_act)

  def MergedInputGradients(self):
    return self._Merge([one.MergedInputGradients() for one in self.passes])

  @property
  def theta_grads(self):
    """Per chunk, the weight gradients summed over replicas on replica 0's device."""
    if len(self.passes) == 1:
      return self.passes[0].ThetaGrads()
    per_replica = [one.ThetaGrads() for one in self.passes]
    sums = []
    for c, device in enumerate(self._layer.ReplicaDevices(0)):
      with tf.device(device):
        sums.append(tf.nest.map_structure(lambda *g: tf.add_n(list(g)),
                                          *[grads[c] for grads in per_replica]))
    return sums

  @property
  def losses(self):
    """What on_loss returned, per L action and replica, in the order they ran."""
    per_action = zip(*[one.losses for one in self.passes])
    return self._whole_batch_losses + [loss for losses in per_action for loss in losses]

  @property
  def updates(self):
    return [u for one in self.passes for u in one.updates]
