"""A backward split into B and W, as a zero-bubble schedule runs it.

B recomputes the chunk, hands the input gradient to the chunk before and keeps
in the pass's `pending_w` what W needs (weight_grads.py); W, later, takes the
weight gradients from it and adds them to the chunk's sum. Apart from the fused
actions (executor.py): what B keeps for W, and a B that took the weight
gradients itself, are bookkeeping of their own.
"""

import tensorflow as tf

from lingvo_gpipe.pipeline import pass_state


class SplitBackward(pass_state.PassState):
  """B and W of a pass; mixed into executor.Pass, whose _Begin, _End and _HandOn they use."""

  def _InputGrad(self, action, device):
    """B: the input gradient, and what W needs, from one call that recomputes the chunk."""
    m, c = action.micro_batch, action.chunk
    grads_in = self._GradsIn(m, c)
    fn = self.functions[c]
    waits, start = self._Begin(device, grads_in)
    # A B that takes the weight gradients too (fn.splits is False) adds after the last add.
    with tf.control_dependencies(self._LastAdd(c, waits)):
      d_args, pending, added, recomputed = fn.InputGrad(
          self.weights[c], self.inputs.pop((m, c)), grads_in, self._Where(m, device), self.step,
          self.training, self.sizes[m], self._Clock(device), self._WantsArgGrads(c))
    if added is not None:
      self._Added(c, added)
    self.pending_w[(m, c)] = pending if added is None else added
    self._HandOn(m, c, d_args)
    # The device's next action waits for the pending tensors too: a first chunk's B may have
    # no input gradient to wait for.
    return self._End(device, action, start, (d_args, pending, added), recomputed)

  def _WeightGrad(self, action, device):
    """W: the weight gradients from what B handed over, added to the chunk's sum."""
    m, c = action.micro_batch, action.chunk
    pending = self.pending_w.pop((m, c))
    waits, start = self._Begin(device, ())
    if isinstance(pending, tf.Tensor):  # B took the weight gradients: nothing left to do.
      return self._End(device, action, start, pending)
    with tf.control_dependencies(self._LastAdd(c, waits)):
      added = self.functions[c].WeightGrad(self.weights[c], pending, self._Where(m, device),
                                           self.sizes[m])
    return self._End(device, action, start, self._Added(c, added))
