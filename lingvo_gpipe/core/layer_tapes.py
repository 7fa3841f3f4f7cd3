"""Weight gradients taken layer call by layer call: the W of a backward split into B and W.

A zero-bubble schedule splits a chunk's backward into B, the input gradient the
stage before waits for, and W, the weight gradient, run later to fill a bubble.
Taken from the chunk's tape, W walks the chunk's chain of activation gradients
a second time (B + W then cost 1.5 fused backwards). Here each layer call of the
chunk's forward is recorded on its own: B takes, in the one walk it makes
anyway, the gradients W will start from (`Adjointed`), and W takes each call's
weight gradients from its own ops alone (`WeightGradients`), so the chain is
walked once and a projection's W is one matmul.

Each call's ops go on a tape of its own. Traced in a graph (as a pipeline step
is), W starts at each call's frontier (`_Frontier`): the own ops where its
weights meet anything else, a matmul or a bias add, differentiated alone, so a
layer that chains weights in its own ops (relu(x @ w1) @ w2, a Keras
Sequential) costs its W no more than child calls would. Run eagerly, or for a
call that reads one weight tensor in two of its own ops, W walks the call's
tape back from its outputs and the inputs it handed its children (then a call
that chains weights walks back between them again: one matmul more per
chained weight).

Exact whatever a layer does with weights. Each call reads its own copies of
the theta it received (identities on its caller's tape), so the ops reading
them are its own and its children's copies, and activations cross from one
call's ops to another's through an identity: the inputs a call hands a child on
the caller's tape, the child's outputs on the child's. W runs the calls children
first, and a child's weight gradients go to its caller as the gradients of its
copies, so a weight read in the caller's own ops (outside its layer), handed to
another layer, or made into another tensor first (a transposed embedding) gets
its gradient through the caller's ops, down to the chunk's own theta.
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
  """One layer call: the float theta it received and its own copies of it (the
  identities its ops read), its tape, the identities that cross to other calls' ops
  (its outputs, what it handed its children) and, traced in a graph, where its W
  starts (`_Frontier`)."""

  def __init__(self, received, copies):
    self.received = _Floats(received)
    self.theta = _Floats(copies)
    # Persistent: W may take several gradients from it (_Frontier).
    self.tape = tf.GradientTape(persistent=True, watch_accessed_variables=False)
    self.outputs = []
    self.handed_inputs = []  # Children's float inputs, as identities on this call's tape.
    self.children = []  # The calls it made that have weights.
    self.frontier = None  # Traced in a graph: its _Frontier.
    self.theta_grads = None  # Filled by W: the gradients of `theta` (None where unused).

  def Adjointed(self):
    if self.frontier is not None:
      return self.frontier.Adjointed()
    return self.outputs + self.handed_inputs

  def WeightGradients(self, adjoints):
    """Fills theta_grads from the gradients of Adjointed(), after its children's: from
    (tensor, gradient) pairs on this call's tape down to its theta copies."""
    if self.frontier is not None:
      pairs = self.frontier.WeightPairs(self.tape, adjoints)
    else:
      pairs = [(x, g) for x, g in zip(self.Adjointed(), adjoints) if g is not None]
    pairs += [(x, g) for child in self.children
              for x, g in zip(child.theta, child.theta_grads) if g is not None]
    self.theta_grads = self.tape.gradient(
        [x for x, _ in pairs], self.theta,
        output_gradients=[tf.cast(g, x.dtype) for x, g in pairs]) if pairs else [
            None] * len(self.theta)


class _Frontier:
  """Where a call's own ops first combine its weights with anything else (a matmul, a
  bias add), found in the graph from the consumers of the call's theta copies, which
  only its own ops and its children's copies read.

  Weight-only ops (a cast, a transpose) extend the weights; a weight-only tensor
  that leaves the call (an output, an input handed to a child) is an exit. B
  takes the gradients of the frontier ops' outputs (and of the exits) in its one
  walk; W takes each frontier op's gradient w.r.t. its weight inputs alone, then
  those down the weight-only ops to theta, on the call's tape: the activation
  chain is not walked again, however many weights a layer chains in its own ops.
  That is exact while each weight tensor feeds one op: then no path back from a
  frontier op through its activations reaches its own weight inputs. `Find`
  returns None for a call that uses one twice (a weight read by two matmuls).
  """

  def __init__(self, ops, derived, exits):
    self.ops = []  # (float outputs, weight-derived float inputs).
    for op in ops:
      if not all(o.ref() in derived for o in op.outputs):
        self.ops.append(([o for o in op.outputs if o.dtype.is_floating],
                         _Unique(x for x in op.inputs
                                 if x.ref() in derived and x.dtype.is_floating)))
    self.exits = exits

  @classmethod
  def Find(cls, call):
    # Children's copies of their theta and the call's exits take gradients from outside.
    outside = {x.ref() for x in call.outputs + call.handed_inputs} | {
        x.ref() for child in call.children for x in child.theta}
    derived = {x.ref() for x in call.theta}
    queue, ops = list(call.theta), {}
    while queue:
      readers = [op for op in queue.pop().consumers()
                 if not any(o.ref() in outside for o in op.outputs)]
      if len(readers) > 1:
        return None
      for op in readers:
        ops[op.name] = op
        fresh = [o for o in op.outputs if o.ref() not in derived]
        if fresh and all(x.ref() in derived or x.op.type == 'Const' for x in op.inputs):
          derived.update(o.ref() for o in fresh)
          queue += fresh
    exits = [x for x in call.outputs + call.handed_inputs if x.op.inputs and
             x.op.inputs[0].ref() in derived]
    return cls(ops.values(), derived, exits)

  def Adjointed(self):
    return [o for outputs, _ in self.ops for o in outputs] + self.exits

  def WeightPairs(self, tape, adjoints):
    """(weight-derived tensor, gradient) pairs from the gradients of Adjointed(): each
    frontier op's gradient w.r.t. its weight inputs alone, and the exits'."""
    adjoints = iter(adjoints)
    pairs = []
    for outputs, weights in self.ops:
      given = [(o, g) for o, g in zip(outputs, adjoints) if g is not None]
      if given and weights:
        grads = tape.gradient([o for o, _ in given], weights,
                              output_gradients=[g for _, g in given])
        pairs += [(w, g) for w, g in zip(weights, grads) if g is not None]
    return pairs + [(x, g) for x, g in zip(self.exits, adjoints) if g is not None]


def _Unique(tensors):
  return list({x.ref(): x for x in tensors}.values())


class LayerTapes:
  """Records each layer call of one chunk's forward for a split B and W (module doc).

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
    copies = _Identities(theta)  # On the caller's tape.
    call = _Call(theta, copies)
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
        out = _Identities(fprop(copies, *args, **kwargs))
      finally:
        self._open.pop()
    call.outputs = _Floats(out)
    if call.theta:
      if not tf.executing_eagerly():
        call.frontier = _Frontier.Find(call)
      self._calls.append(call)
    return out

  def Adjointed(self):
    """The tensors whose gradients (w.r.t. the chunk's outputs) W needs, which B takes."""
    return [x for call in self._calls for x in call.Adjointed()]

  def WeightGradients(self, adjoints, theta):
    """The root call's theta gradients, shaped like `theta` (zeros where unused), from
    the gradients of Adjointed() in its order."""
    adjoints = iter(adjoints)
    for call in self._calls:
      call.WeightGradients([next(adjoints) for _ in call.Adjointed()])
    root = {}
    for x, g in zip(self._root.received, self._root.theta_grads or []):
      if g is not None:  # A tensor given twice gets both copies' gradients.
        root[x.ref()] = g + root[x.ref()] if x.ref() in root else g

    def Grad(x):
      g = root.get(x.ref()) if isinstance(x, tf.Tensor) else None
      return tf.zeros_like(x) if g is None else g

    return tf.nest.map_structure(Grad, theta)
