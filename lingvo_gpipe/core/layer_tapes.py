"""Weight gradients taken layer call by layer call: the W of a backward split into B and W.

A zero-bubble schedule splits a chunk's backward into B, the input gradient the
stage before waits for, and W, the weight gradient, run later to fill a bubble.
Taken from the chunk's tape, W walks the chunk's chain of activation gradients
a second time (B + W then cost 1.5 fused backwards). Here each layer call of the
chunk's forward records its own ops on a tape of its own (its children's ops
go on theirs): B takes, in the one walk it makes anyway, the gradients of every
call's outputs and of the inputs it hands its children (`Adjointed`), and W
takes each call's weight gradients from its own ops alone (`WeightGradients`):
a projection's W is one matmul, and the chain is walked once. (A call that
chains weights in its own ops, relu(x @ w1) @ w2, walks back between them in
its W again: one matmul more per chained weight than child calls cost.)

Exact whatever a layer does with weights. Every op is on the tape of the
innermost call running it, and activations cross from one call's ops to
another's through an identity: the inputs a call hands a child on the caller's
tape, the child's outputs on the child's. Those identities are used only across
the border, so their gradients are what flows across it, and each call's
gradients from them count its own ops exactly once. The theta a child receives
needs none: W runs the calls children first, and a child's weight gradients,
from its own ops alone, go to its caller as the gradients of the tensors it
handed on, so a weight read in the caller's own ops (outside its layer), handed
to another layer, or made into another tensor first (a transposed embedding)
gets its gradient through the caller's ops, down to the chunk's own theta.
"""

import contextlib

import tensorflow as tf


def _Floats(structure):
  return [x for x in tf.nest.flatten(structure) if isinstance(x, tf.Tensor) and
          x.dtype.is_floating]


def _Identities(structure):
  """`structure` with its float tensors passed through an identity (module doc)."""
  return tf.nest.map_structure(
      lambda x: tf.identity(x) if isinstance(x, tf.Tensor) and x.dtype.is_floating else x,
      structure)


class _Call:
  """One layer call: its tape, the theta it watches, the identities on its tape that
  cross to other calls' ops (its outputs, what it handed its children)."""

  def __init__(self, theta):
    # The float tensors of the theta it received, each once: a tensor given twice must
    # not hand its gradient on twice.
    self.theta = list({x.ref(): x for x in _Floats(theta)}.values())
    self.tape = tf.GradientTape(watch_accessed_variables=False)
    self.outputs = []
    self.handed_inputs = []  # Children's float inputs, as identities on this call's tape.
    self.children = []  # The calls it made.
    self.theta_grads = None  # Filled by W: the gradients of `theta` (None where unused).


class LayerTapes:
  """Records each layer call of one chunk's forward on a tape of its own (module doc).

  The chunk's forward runs as the root call `Run(cell_fprop, theta, args)` with
  this object in the FProp context (py_utils.Context(layer_tapes=...)); every
  BaseLayer FProp called inside comes back through Run.
  """

  def __init__(self):
    self._calls = []  # Finished calls with weights, children before their caller.
    self._open = []  # The calls running, innermost last.
    self._root = None

  def Run(self, fprop, theta, *args, **kwargs):
    """fprop(theta, *args, **kwargs) as a call of its own, inside the running call."""
    caller = self._open[-1] if self._open else None
    call = _Call(theta)
    if caller is None:
      self._root = call
    else:
      args, kwargs = _Identities((args, kwargs))
      caller.handed_inputs += _Floats((args, kwargs))
      if call.theta:  # A call without weights (dropout, an activation) has no W.
        caller.children.append(call)
    paused = caller.tape.stop_recording() if caller is not None else contextlib.nullcontext()
    with paused, call.tape:
      call.tape.watch(call.theta)
      self._open.append(call)
      try:
        out = _Identities(fprop(theta, *args, **kwargs))
      finally:
        self._open.pop()
    call.outputs = _Floats(out)
    if call.theta:
      self._calls.append(call)
    return out

  def Adjointed(self):
    """The tensors whose gradients (w.r.t. the chunk's outputs) W needs, which B takes."""
    return [x for call in self._calls for x in call.outputs + call.handed_inputs]

  def WeightGradients(self, adjoints, theta):
    """The root call's theta gradients, shaped like `theta` (zeros where unused), from
    the gradients of Adjointed() in its order."""
    adjoints = iter(adjoints)
    for call in self._calls:
      pairs = [(x, next(adjoints)) for x in call.outputs + call.handed_inputs]
      pairs += [(x, g) for child in call.children
                for x, g in zip(child.theta, child.theta_grads) if g is not None]
      pairs = [(x, tf.cast(g, x.dtype)) for x, g in pairs if g is not None]
      call.theta_grads = call.tape.gradient(
          [x for x, _ in pairs], call.theta, output_gradients=[g for _, g in pairs]) if (
              pairs) else [None] * len(call.theta)
    root = dict(zip((x.ref() for x in self._root.theta), self._root.theta_grads or []))

    def Grad(x):
      g = root.get(x.ref()) if isinstance(x, tf.Tensor) else None
      return tf.zeros_like(x) if g is None else g

    return tf.nest.map_structure(Grad, theta)
