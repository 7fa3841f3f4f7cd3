"""R data-parallel copies of one pipelined pass, each on 1/R of the batch.

Every replica runs the schedule's actions on its own devices and rows; a
stretch that repeats itself runs as one loop (steady_state.py). Apart from one
replica's pass (executor.Pass): splitting the batch over replicas, summing
their weight gradients and merging their results.
"""

import tensorflow as tf

from lingvo_gpipe.pipeline import executor
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import schedule_actions
from lingvo_gpipe.pipeline import steady_state

F, L = schedule_actions.FORWARD, schedule_actions.LOSS


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
        executor.Pass(layer, r, layer.ReplicaThetas(thetas, r),
             microbatch.Split(part, num_micro_batches, batch_dim), remat, keep_inputs, step,
             first_example=first, split=split, tracer=tracer,
             need_input_grads=need_input_grads, batch=part)
        for r, (part, first) in enumerate(zip(parts, firsts))]
    for one in self.passes:
      one.keep_outputs = keep_outputs
    self._whole_batch_losses = []

  def Execute(self, instructions, on_loss=None):
    """Runs a program's instructions (program.py), each on every replica; a stretch that
    repeats itself (a steady state, steady_state.Windows) runs as one loop.

    on_loss(pass, m) computes micro-batch m's loss, sets its output gradients
    (SetMicroBatchOutputGradients) and returns (its metrics, whether loss_fn returned a
    NestedMap); on_loss(None, ALL), for a whole-batch L(*), those of every replica
    (SetOutputGradients); `losses` keeps what they return.
    """
    awaited = _FirstActions(instructions, self._layer.placement)
    for one in self.passes:
      one.awaited = awaited
      one.losses_follow = any(a.kind == L and a.micro_batch != schedule_actions.ALL
                              for a in instructions)
    done = 0
    for window in self._Windows(instructions):
      for instruction in instructions[done:window.start]:
        self._Run(instruction, on_loss)
      period = instructions[window.start:window.start + window.period]
      try:
        steady_state.RunLoop(self.passes[0], period, window.repeats, window.stride,
                             lambda a: self._Run(a, on_loss))
      except steady_state.NotPeriodic:  # E.g. fill-drain: all its inputs stay in flight.
        for instruction in instructions[window.start:window.end]:
          self._Run(instruction, on_loss)
      done = window.end
    for instruction in instructions[done:]:
      self._Run(instruction, on_loss)

  def _Windows(self, instructions):
    one = self.passes[0]
    if len(self.passes) > 1 or not one.CanLoop():
      return []
    return steady_state.Looped(steady_state.Windows(instructions, one.SameTrace),
                               self._layer.params)

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
  def gradient_sums(self):
    """Per chunk, the weight gradients summed over replicas on replica 0's device."""
    if len(self.passes) == 1:
      return self.passes[0].GradientSums()
    per_replica = [one.GradientSums() for one in self.passes]
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
