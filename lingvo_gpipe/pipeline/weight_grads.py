"""The W of a backward split into B and W, as a function of tensors B hands over.

A zero-bubble schedule splits a chunk's backward into B, the input gradient the
stage before waits for, and W, the weight gradient, run later to fill a bubble.
Both are one call of a traced function each (cell_functions.CellFunctions), so W
cannot read B's tape: what W needs crosses from B as tensors.

While B traces the chunk's forward, `WeightGradPlan.Trace` reads the ops it
made, in the order they were made (a topological order). An op whose inputs
all derive from the chunk's weights (a cast, a transpose, a sum) is
weight-side; one that meets a weight with anything else (a matmul, a bias add,
an embedding gather) is a frontier op. B takes, in the one walk back it makes
anyway, the gradients of the frontier ops' outputs (and of weight-side
tensors that are outputs themselves), and hands them to W with the frontier
ops' other inputs (their activations). W re-creates the weight-side and
frontier ops from those tensors (same op, same attributes) and takes the
weights' gradients through them alone (tf.gradients: W's graph has no tape):
the activation chain is not walked again, and a projection's W is one matmul.

This is the chain rule, exact however the weights are used (read twice, tied,
transposed, read outside their layer): the weights' gradient is the sum, over
the ops reading anything made of them, of each op's local gradient times its
outputs' total gradient, which B took. Ops W cannot re-create (stateful ops,
function calls, custom gradients such as remat segments, control flow) make
`Trace` return no plan with the reason: B then takes the weight gradients too.
"""

import tensorflow as tf

# Ops W does not re-create: their gradient is not the registered one of their type
# (custom gradients, remat segments), or they hold a function or state.
_NOT_RECREATED = frozenset({
    'IdentityN', 'PartitionedCall', 'StatefulPartitionedCall', 'While', 'StatelessWhile',
    'If', 'StatelessIf', 'Case', 'StatelessCase', 'PreventGradient'})


def _Floats(tensors):
  return [x for x in tensors if x.dtype.is_floating]


def _Why(op):
  """Why W cannot re-create `op`, or None if it can."""
  if op.type in _NOT_RECREATED or op.op_def.is_stateful:
    return f'{op.type} op {op.name!r}'
  if '_gradient_op_type' in op.node_def.attr:
    return f'{op.type} op {op.name!r} with a custom gradient'
  if any(a.type in ('func', 'list(func)') for a in op.op_def.attr):
    return f'{op.type} op {op.name!r} holding a function'
  return None


def _Recreate(op, inputs):
  """`op` made again, with its attributes, on `inputs` in the current graph: its outputs."""
  attrs = {k: v for k, v in op.node_def.attr.items() if not k.startswith('_')}
  made = tf.compat.v1.get_default_graph().create_op(
      op.type, inputs, [o.dtype for o in op.outputs], name=op.name.rsplit('/', 1)[-1] + '_w',
      attrs=attrs)
  return list(made.outputs)


class WeightGradPlan:
  """What W re-creates of one chunk's forward, and what B hands it (module doc)."""

  def __init__(self, theta, ops, frontier, exits):
    self._theta = theta  # The chunk's float weights, as B's forward read them.
    self._ops = ops  # Weight-side and frontier ops, in the order they were made.
    self._frontier = {op.name for op in frontier}
    self._exits = exits  # Weight-side tensors that are the chunk's outputs.
    self.adjointed = _Unique([o for op in frontier for o in _Floats(op.outputs)] + exits)
    derived = {x.ref() for x in theta} | {o.ref() for op in ops if op not in frontier
                                           for o in op.outputs}
    self.saved = _Unique([x for op in frontier for x in op.inputs
                          if x.ref() not in derived and x.op.type != 'Const'])

  @classmethod
  def Trace(cls, fprop, theta, args):
    """(fprop(theta, args), the plan or None, why there is none) traced in a graph."""
    if tf.executing_eagerly():  # tf.config.run_functions_eagerly: no ops to read or re-create.
      return fprop(theta, args), None, 'the step runs eagerly'
    graph = tf.compat.v1.get_default_graph()
    first = len(graph.get_operations())
    targets = fprop(theta, args)
    flat_theta = _Floats(x for x in tf.nest.flatten(theta) if isinstance(x, tf.Tensor))
    derived = {x.ref() for x in flat_theta}
    ops, frontier = [], []
    for op in graph.get_operations()[first:]:
      if not any(x.ref() in derived for x in op.inputs):
        continue
      why = _Why(op)
      if why:
        return targets, None, f'the weights reach a {why}'
      ops.append(op)
      if all(x.ref() in derived or x.op.type == 'Const' for x in op.inputs):
        derived.update(o.ref() for o in op.outputs)
      else:
        frontier.append(op)
    exits = [x for x in _Floats(t for t in tf.nest.flatten(targets) if isinstance(t, tf.Tensor))
             if x.ref() in derived]
    return targets, cls(flat_theta, ops, frontier, exits), None

  def WeightGradients(self, theta, saved, adjoints):
    """The gradients of the float tensors of `theta` (in tf.nest order; None where unused)
    from `saved` and `adjoints` (W's copies of `saved` and of the gradients of `adjointed`)."""
    flat_theta = _Floats(x for x in tf.nest.flatten(theta) if isinstance(x, tf.Tensor))
    # B's tensors as W makes them: the weights, the saved activations (a frontier op's
    # output read by a later frontier op is one), the weight-side ops' outputs.
    made = {b.ref(): w for b, w in zip(self._theta + self.saved, flat_theta + list(saved))}
    frontier = {}  # The frontier ops' outputs, made from the weights.
    for op in self._ops:
      inputs = [made[x.ref()] if x.ref() in made else _Recreate(x.op, [])[x.value_index]
                for x in op.inputs]
      outputs = {o.ref(): w for o, w in zip(op.outputs, _Recreate(op, inputs))}
      (frontier if op.name in self._frontier else made).update(outputs)
    pairs = [(frontier.get(x.ref(), made.get(x.ref())), g)
             for x, g in zip(self.adjointed, adjoints) if g is not None]
    return tf.gradients([x for x, _ in pairs], flat_theta, grad_ys=[g for _, g in pairs])


def _Unique(tensors):
  return list({x.ref(): x for x in tensors}.values())
