"""The state of one replica's pipelined pass: what its actions hand each other.

Per replica a pass keeps the boundary activations waiting for their chunk (and,
after a forward, its input for the backward, or what a forward without remat
saved for it: saved_forward.py), output gradients
waiting for their backward, what a pending W needs, each device's tokens and
the token of each chunk's last add to its running sum of weight gradients (a
GradientSum, added to in place). It is apart from the actions that read and
write it (executor.py) because steady_state.RunLoop carries it round a loop
too: the methods here say which micro-batch, rows and tokens an action takes,
in a loop or not.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import direct_inputs
from lingvo_gpipe.pipeline import microbatch


def MicroBatchWheres(sizes, offsets):
  """(the table, per micro-batch its row): each micro-batch's (offset, size) as one int64
  vector.

  Grappler specializes a function for each call with constant inputs (here:
  the micro-batch offset), which costs optimization time for each of the K x M
  calls; it does not fold a PlaceholderWithDefault, which keeps the table
  variable: two ops and a constant per device and pass, not some per action.
  """
  table = tf.cast(tf.stack([tf.stack([o, s]) for o, s in zip(offsets, sizes)]), tf.int64)
  table = tf.raw_ops.PlaceholderWithDefault(input=table, shape=[len(sizes), 2])
  return table, tf.unstack(table)


class PassState:
  """What one replica's pipelined pass over its micro-batches holds between actions.

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
    self.micro_args = micro_args
    self.inputs = {(m, 0): args for m, args in enumerate(micro_args)}
    # The fields that go from the batch straight to a later chunk (direct_inputs.py).
    self.direct = direct_inputs.DirectInputs(layer.params.last_chunk_inputs,
                                             layer.DefaultDirectInputs(), micro_args[0],
                                             self.num_chunks)
    self.pending_w = {}
    self.outputs = {}  # The last chunk's outputs, kept for MergedOutputs (keep_outputs).
    self.to_losses = {}  # Those a micro-batch's loss (L) takes next (losses_follow).
    self.acts = {}
    self.out_grads = {}
    self.act_grads = {}
    self.input_grads = {}
    # Per chunk, the token of its last weight-gradient add or of its Zero (None before): the sum
    # itself is in the chunk's GradientSum (GradientSums reads it).
    self.last_adds = [None] * self.num_chunks
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
    # Each chunk's theta as its calls take it (CellFunctions.Weights), made once, before any
    # action: a loop's iterations take it from outside.
    with tf.control_dependencies(None):
      self.weights = [f.Weights(theta) for f, theta in zip(self.functions, thetas)]

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
      return self.micro_args[m]
    return microbatch.Part(self.batch, self._Index(m), self.sizes[0], self.layer.params.batch_dim)

  def _ChunkArgs(self, m, c, args):
    """Chunk c's arguments of micro-batch m from `args` (the batch's rows for the first, the
    chunk before's output for others): the first chunk's lack the fields that skip chunks,
    those that join chunk c are put back (direct_inputs.py)."""
    if not self.direct:
      return args
    if c == 0:
      args = self.direct.Without(args)[0]
    return self.direct.Joined(args, self._FirstArgs(m), c)

  def _ChunkArgGrads(self, c, d_args):
    """Chunk c's input gradients as the chunk before (or the pass's caller) takes them
    (DirectInputs.ArgGrads)."""
    return d_args if not self.direct or d_args is None else self.direct.ArgGrads(d_args, c)

  def MicroBatchRows(self, whole, parts, m):
    """Micro-batch m's rows of `whole`, which `parts` splits as the inputs are (labels): in a
    loop, the iteration's."""
    if self.loop is None:
      return parts[m]
    return microbatch.Part(whole, self._Index(m), self.sizes[0], self.layer.params.batch_dim)

  def CanLoop(self):
    """Whether windows of a schedule may run as loops: traced, untimed, on micro-batches of
    one size (loop_steady_state: steady_state.Looped; RunLoop checks the rest)."""
    return (not tf.executing_eagerly() and self.tracer is None and self.batch is not None and
            all(isinstance(n, int) and n == self.sizes[0] > 0 for n in self.sizes))

  def SameTrace(self, a, b):
    """Whether actions a and b of one kind and chunk may run as one traced call in a loop:
    alike micro-batches, both re-materialized or neither, neither a device's first."""
    def Kind(action):
      m = action.micro_batch
      return self._Remat(m), (m, action.chunk) in self.split, action in self.awaited

    return Kind(a) == Kind(b) and a not in self.awaited

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

  def _Remat(self, m):
    return self.remat == 'always' or (self.remat == 'except_last' and
                                      m < self.num_micro_batches - 1)

  def _GradsIn(self, m, c):
    """(output gradient, fetched activations' gradients) of micro-batch m on chunk c."""
    key = (m, c)
    no_act_grads = tf.nest.map_structure(lambda _: None, self.acts[key])
    return (self.out_grads.pop(key), self.act_grads.pop(key, no_act_grads))

  def _WantsArgGrads(self, c):
    return c > 0 or self.need_input_grads

  def _LastAdd(self, c, waits):
    """The tokens chunk c's next weight-gradient add waits for: its last add, or a Zero of
    its sum (made after `waits`) before the pass's first."""
    if self.last_adds[c] is None:
      with tf.control_dependencies(waits):
        self.last_adds[c] = self.functions[c].Zero(self.thetas[c])
    return waits + [self.last_adds[c]]

  def _Added(self, c, token):
    """Records chunk c's latest weight-gradient add."""
    self.last_adds[c] = token
    return token

  def _Clock(self, device):
    return None if self.tracer is None else self.tracer.clocks[device]
