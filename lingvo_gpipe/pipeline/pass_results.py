"""What a pipelined pass hands its caller: outputs and gradients of whole batches.

The actions fill a pass's state one micro-batch at a time; its caller sees the
whole batch: the last chunk's outputs and the first chunk's input gradients
merged from the micro-batches, output gradients split into them, and each
chunk's weight gradients summed. Apart from the actions (executor.py), which
never merge.
"""

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import microbatch
from lingvo_gpipe.pipeline import pass_state


class PassResults(pass_state.PassState):
  """A pass's merged results, and the output gradients its caller hands in."""

  def GradientSums(self):
    """Per chunk, the sum of its weight gradients over the micro-batches (read after the
    last add, `last_adds`)."""
    return [self.functions[c].grad_sum.Read(self.thetas[c], added)
            for c, added in enumerate(self.last_adds)]

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
