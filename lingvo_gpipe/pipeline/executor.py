"""The pipeline executor: runs a schedule's program (program.py) one instruction at a time.

The executor is Python that runs once, while the step is traced: it emits
each instruction's ops in the program's order, and from then on only the graph
runs. Each action is one call of a function of its chunk (`cell_functions.CellFunctions`),
traced once per chunk and kind, so a step's graph is a thin list of calls
whatever M is. A `Pass` runs one replica's instructions on what they hand each
other (pass_state.py). Each instruction kind has one code path:

  F(m, c)   chunk c's forward on micro-batch m, handed to chunk c+1; without
            remat one that also returns what its backward needs (saved_forward.py);
  L(m)      the loss of micro-batch m (or of the whole batch) and its gradient,
            computed by the caller's `on_loss` (replicas.Replicas.Execute);
  BW(m, c)  both gradients, from what the forward saved or a call that recomputes,
            the weight gradient added to the chunk's sum at once;
  B(m, c)   a call that recomputes the chunk and takes the input gradient, what
            the chunk before waits for, and what W needs: the gradients of the
            ops that read the weights and those ops' other inputs, as tensors
            (weight_grads.py); the chain of activation gradients is walked once;
  W(m, c)   a call that takes the weight gradients from what B handed over;
  SF, SB    a send: the value a forward or input gradient left for a chunk on another
            device, copied there ahead when that is the receiver's first action (_HandOver).

B and W are in split_backward.py, the whole-batch results a caller reads in
pass_results.py. In graphs, each action's call waits (control dependencies) for
the previous action of the same device, so TensorFlow runs the order the schedule
prints and cannot run ahead and hold more activations than the schedule says.
With R replicas (replicas.py) every replica runs the same actions on 1/R of the
batch and their weight gradients are summed. Parts of a batch that R or M does
not divide differ by a row (microbatch.Split); each micro-batch's random ops and
statistics use its own offset and size.
"""

import contextlib

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import pass_results
from lingvo_gpipe.pipeline import program
from lingvo_gpipe.pipeline import schedule_actions
from lingvo_gpipe.pipeline import split_backward

F, B, W, BW = (schedule_actions.FORWARD, schedule_actions.INPUT_GRAD, schedule_actions.WEIGHT_GRAD,
               schedule_actions.BACKWARD)


def AsArgs(value):
  """A cell's output as the argument tuple of the next cell."""
  return value if isinstance(value, tuple) else (value,)


class Pass(split_backward.SplitBackward, pass_results.PassResults):
  """One replica's pipelined pass over its micro-batches, run one action at a time; its
  arguments are pass_state.PassState's."""

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    self._handlers = {F: self._Forward, B: self._InputGrad, W: self._WeightGrad,
                      BW: self._Backward}

  def Run(self, instruction: program.Instruction) -> None:
    """Runs one F, B, W or BW action on its chunk's device, after that device's last one, or
    a send of its value."""
    device = self.placement[instruction.chunk]
    with self._Scope(instruction):
      if isinstance(instruction.kind, program.Send):
        self.tokens[device] = self.tokens[device] + self._Send(instruction)
        return
      tokens = self._handlers[instruction.kind](instruction, device)
    self.earlier_tokens[device], self.tokens[device] = self.tokens[device], tokens

  def _Scope(self, action):
    """Device, name scope and FProp context of one action."""
    scope = contextlib.ExitStack()
    scope.enter_context(tf.device(self.devices[action.chunk]))
    if self.layer.num_replicas > 1:
      scope.enter_context(tf.name_scope(f'replica{self.replica}'))
    scope.enter_context(tf.name_scope(f'chunk{action.chunk}_{action.kind}{action.micro_batch}'))
    return scope

  def _Begin(self, device, inputs):
    """What the device's next call waits for (its previous action, the start stamp) and the
    start stamp (None without a tracer)."""
    if self.tracer is None:
      return list(self.tokens[device]), None
    start = self.tracer.Start(device, (inputs, self.tokens[device]))
    return [start], start

  def _End(self, device, action, start, outputs, recompute_end=None):
    """The tokens the device's next action waits for."""
    tokens = py_utils.Tensors(outputs)
    if self.tracer is not None:
      tokens.append(self.tracer.End(self.replica, device, action, start, outputs, recompute_end))
    return tokens

  def _Send(self, send):
    """SF / SB: the value for the receiving chunk, as it takes it; returns the tokens the
    sender's next action waits for."""
    m, to = send.micro_batch, program.Receiver(send)
    if send.kind == program.SEND_ACTIVATION:
      store, consumer = self.inputs, schedule_actions.Action(F, m, to)
    else:
      store, consumer = self.out_grads, schedule_actions.Action(
          B if (m, to) in self.split else BW, m, to)
    store[(m, to)], handed_over = self._HandOver(send.chunk, consumer, store[(m, to)])
    return handed_over

  def _HandOver(self, sender, consumer, value):
    """(value as `consumer` takes it from chunk `sender`, tokens for the sender's next action
    to wait for).

    A device's first action of a pass (`awaited`) waits idle for its input. The
    sender's next action is ready at once, and on a worker process whose one core
    runs it, TensorFlow's send of `value` would wait for a thread behind that
    action, and the receiver with it (docs/benchmarks/2026-11-29-schedules.md). For
    those hand-overs the value is copied onto the receiver, and the sender goes on
    once the copy exists.
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

  def _Forward(self, action, device):
    """F: one call of the chunk's forward; without remat one that also returns what the
    backward needs (saved_forward.py), left for it where a re-materialized forward leaves its
    input. A split backward's B recomputes: its forward keeps only its input."""
    m, c = action.micro_batch, action.chunk
    key = (m, c)
    if c == 0:
      self.inputs[key] = self._Released(m, device)
      self.released.add(m)
    self.inputs[key] = args = self._ChunkArgs(m, c, self.inputs[key])
    waits, start = self._Begin(device, args)
    fn, remat = self.functions[c], self._Remat(m) or key in self.split
    with tf.control_dependencies(waits):
      try:
        call = fn.Forward if remat else fn.SavingForward
        out, acts, updates, *saved = call(self.weights[c], args, self._Where(m, device),
                                          self.step, self.training)
      except (AttributeError, KeyError) as e:
        if self.direct.Skipping(c):
          raise ValueError(self.direct.Explain(c, e)) from e
        raise
    if saved:
      self.inputs[key] = saved[0]
    elif not self.keep_inputs:
      del self.inputs[key]
    self.updates += updates
    self.acts[key] = acts
    if c + 1 < self.num_chunks:
      self.direct.CheckOutput(out, c)
      self.inputs[(m, c + 1)] = out  # A send (SF) follows where chunk c + 1 is elsewhere.
    else:
      if self.keep_outputs:
        self.outputs[m] = out
      if self.losses_follow:
        self.to_losses[m] = out
    return self._End(device, action, start, (out, acts))

  def _HandOn(self, m, c, d_args):
    """Leaves chunk c's input gradient for chunk c-1 (a send, SB, follows where that is
    elsewhere), or as the pass's input gradient."""
    d_args = self._ChunkArgGrads(c, d_args)
    if c == 0:
      self.input_grads[m] = d_args
    else:
      self.out_grads[(m, c - 1)] = d_args

  def _Backward(self, action, device):
    """BW: both gradients, from what the forward saved or one call that recomputes; the
    weight gradient is added to the chunk's sum at once."""
    m, c = action.micro_batch, action.chunk
    grads_in = self._GradsIn(m, c)
    waits, start = self._Begin(device, grads_in)
    fn, where = self.functions[c], self._Where(m, device)
    with tf.control_dependencies(self._LastAdd(c, waits)):
      if self._Remat(m):
        d_args, added, recomputed = fn.Backward(
            self.weights[c], self.inputs.pop((m, c)), grads_in, where, self.step,
            self.training, self.sizes[m], self._Clock(device), self._WantsArgGrads(c))
      else:
        d_args, added = fn.SavedBackward(self.weights[c], self.inputs.pop((m, c)), grads_in,
                                         where, self.sizes[m], self._WantsArgGrads(c))
        recomputed = None
    self._HandOn(m, c, d_args)
    return self._End(device, action, start, (d_args, self._Added(c, added)), recomputed)
