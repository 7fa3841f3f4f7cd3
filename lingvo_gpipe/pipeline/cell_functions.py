"""A pipeline chunk's actions as traced functions, and the running sum of its weight gradients.

Each kind of action of chunk c (F, BW, B, W, and the adds to its gradient sum)
is one function traced once per chunk, so a step's graph holds one call op per
action whatever M is (CellFunctions). A backward adds its weight gradients to the
chunk's GradientSum, a variable per weight on the chunk's device, in place.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import packing
from lingvo_gpipe.pipeline import saved_forward
from lingvo_gpipe.pipeline import step_timing
from lingvo_gpipe.pipeline import weight_grads


class GradientSum:
  """A chunk's running sum of weight gradients, in variables updated in place.

  A sum passed along as a value (`total + grads`) holds the old sum, the new
  one and the micro-batch's gradients at once: three copies of the chunk's
  weights. Added in place, one tensor as soon as the backward makes it, the
  sum is one copy beside the gradients not yet added. The variables are made
  once, on the chunk's device, outside the model: not trainable, not saved.
  They keep their memory between passes; a read of the sum stays what it was
  when the next pass writes (TensorFlow copies a variable read elsewhere first).
  """

  def __init__(self, device, name):
    self._device = device
    self._name = name  # Unique per pipeline, replica and chunk.
    self._sums = None

  def Variables(self, theta):
    """The sum's variables, shaped like theta (made on first use: the caller of a tf.function
    that adds makes them, as one made while tracing would make it trace again)."""
    if self._sums is None:
      with tf.init_scope(), tf.device(self._device):
        self._sums = [tf.Variable(tf.zeros(x.shape, x.dtype), trainable=False,
                                  name=f'{py_utils.SCRATCH_SCOPE}/{self._name}/grad_sum{i}')
                      for i, x in enumerate(tf.nest.flatten(theta))]
    return self._sums

  def Zero(self, theta):
    """Starts a pass's sum at zero; returns a token that exists once it is."""
    return self._Done([s.assign(tf.zeros_like(s), read_value=False)
                       for s in self.Variables(theta)])

  def Add(self, theta, grads):
    """Adds `grads`; returns a token that exists once they are added."""
    return self._Done([s.assign_add(g, read_value=False)
                       for s, g in zip(self.Variables(theta), tf.nest.flatten(grads))])

  @staticmethod
  def _Done(ops):
    with tf.control_dependencies([op for op in ops if op is not None]):
      return tf.constant(True)

  def Read(self, theta, token):
    """The sum, shaped like theta, once the add that made `token` is done."""
    with tf.control_dependencies(py_utils.Tensors(token)):
      return tf.nest.pack_sequence_as(theta, [s.read_value() for s in self.Variables(theta)])


def CreateGradientSums(layer):
  """Makes a PipeliningLayer's gradient sums now, shaped like its cells' variables (tied ones
  included, so once the model is whole): the trainer calls it before it traces its step,
  which would otherwise make them and so trace the step twice at every start."""
  for functions in layer.cell_functions:
    for function, cell in zip(functions, layer.cell):
      function.grad_sum.Variables(cell.vars)


def _MayBeEmpty(rows):
  """Whether a micro-batch of `rows` rows (an int, or a tensor known when it runs) may have
  none: a batch of fewer rows than M leaves micro-batches empty."""
  return not (isinstance(rows, int) and rows > 0)


def _AddToSum(total, theta, grads, rows):
  """Adds a chunk's weight gradients of a micro-batch of `rows` rows to its GradientSum
  `total`; returns the add's token. An empty
  micro-batch adds zeros: its gradients are 0 but where a layer's statistics over no rows
  are NaN (0 * NaN in Keras's batch norm)."""
  if _MayBeEmpty(rows):
    grads = tf.nest.map_structure(
        lambda g: tf.where(rows > 0, g, tf.zeros_like(g)), tf.nest.map_structure(
            tf.convert_to_tensor, grads))
  return total.Add(theta, grads)


def Watch(tape, theta, args):
  """Watches the float inputs and weights (not a Keras layer's integer state, e.g. a seed)."""
  tape.watch([x for x in tf.nest.flatten((args, theta)) if py_utils.IsFloatTensor(x)])


def _Gradients(tape, targets, target_grads, sources):
  """Gradients of the float `targets` (weighted by target_grads) w.r.t. the list `sources`."""
  pairs = [(t, g) for t, g in zip(tf.nest.flatten(targets), tf.nest.flatten(target_grads))
           if py_utils.IsFloatTensor(t)]
  return tape.gradient(
      [t for t, _ in pairs], sources,
      output_gradients=[tf.zeros_like(t) if g is None else tf.cast(g, t.dtype) for t, g in pairs],
      unconnected_gradients=tf.UnconnectedGradients.ZERO)


def CellGradients(tape, targets, target_grads, args=None, theta=None):
  """(gradients w.r.t. the float tensors of `args`, shaped like args with None elsewhere;
  gradients w.r.t. theta), in one call; either is None when not asked for."""
  flat = tf.nest.flatten(args) if args is not None else []
  index = [i for i, x in enumerate(flat) if py_utils.IsFloatTensor(x)]
  flat_theta = tf.nest.flatten(theta) if theta is not None else []
  grads = _Gradients(tape, targets, target_grads, [flat[i] for i in index] + flat_theta)
  d_args = None if args is None else tf.nest.pack_sequence_as(
      args, py_utils.Replaced([None] * len(flat), index, grads[:len(index)]))
  d_theta = None if theta is None else tf.nest.pack_sequence_as(theta, grads[len(index):])
  return d_args, d_theta


def _FloatPositions(structure):
  return [i for i, x in enumerate(tf.nest.flatten(structure)) if py_utils.IsFloatTensor(x)]


def _ZerosWhereNone(like, grads):
  return tf.nest.map_structure(lambda x, g: tf.zeros_like(x) if g is None else g, like, grads)


def _Context(layer, where, step, training, updates=None):
  offset, size = where[0], where[1]
  return py_utils.Context(training=training, step=step, updates=updates,
                          batch_slice=py_utils.BatchSlice(offset, size, layer.params.batch_dim))


class CellFunctions:
  """Chunk c's actions, each traced once as a function: one call op per action.

  Inlined, every action would add its chunk's ops to the step's graph, so graph
  size and tracing would grow with K x M; a call's ops are traced once per chunk,
  whatever M (docs/benchmarks/2026-12-01-startup.md).
  `_noinline` stops TensorFlow from inlining the calls back before it optimizes
  the graph (unless inline_cell_functions: an op failing inside a call that is not
  inlined may reach the caller only as the other devices' cancelled receives). Where
  the micro-batch sits in the batch and the step are tensor arguments, so one trace
  serves every micro-batch; batch-norm statistics come
  back keyed by layer path, so no trace leaves state behind that another
  trace's calls would rely on. A backward adds the weight gradients to the
  chunk's `grad_sum` in place, which `Zero` starts each pass at.

    Forward       the chunk's outputs;
    SavingForward the chunk's outputs and what its backward needs, where it is
                  not re-materialized (saved_forward.py);
    SavedBackward BW without remat: both gradients from what SavingForward saved;
    Backward      BW: the recompute and both gradients;
    InputGrad     B: the recompute, the input gradient, and what W needs, as
                  tensors (weight_grads.py) in TensorLists (packing.py);
    WeightGrad    W: the weight gradients from what B handed over;
    Zero          starts the sum of a pass.
  """

  def __init__(self, layer, chunk, device, replica=0):
    self._layer = layer
    self._chunk = chunk
    self._device = device
    options = dict(autograph=False, experimental_attributes={
        '_noinline': not layer.params.inline_cell_functions})
    jit = dict(options, jit_compile=layer.params.jit_compile)

    def Function(method, **kwargs):  # Named e.g. chunk1_InputGrad in graphs and traces.
      return py_utils.DistinctFunction(method, name=f'chunk{chunk}{method.__name__}', **kwargs)

    self._forward = Function(self._Forward, **jit)
    self._saving_forward = Function(self._SavingForward, **options)
    # What _SavingForward calls: inlinable, as a nested call per F cost 8-15% of a step.
    self._inlined_forward = Function(self._Forward, autograph=False)
    self._saved_backward = Function(self._SavedBackward, **options)
    self._saved_by, self._saved_layouts = [], []  # Per trace of _SavingForward: its graph,
    # and how its saved tensors come back (saved_forward.Pair, packing.Packing).
    self._backward = Function(self._Backward, **jit)
    self._input_grad = Function(self._InputGrad, **options)
    self._weight_grad = Function(self._WeightGrad, **options)
    self._zero = Function(self._Zero, **options)
    self._packing = None  # How Weights packs the chunk's theta (packing.py).
    self._handed = None  # How B packs what it hands W (B's last trace's).
    self._plan = None  # B's last trace's weight_grads.WeightGradPlan (None: B takes W too).
    self.fused_split_reason = None  # Why the chunk's B takes the weight gradients too.
    self.grad_sum = GradientSum(device, f'{layer.path}/replica{replica}/chunk{chunk}')

  @property
  def splits(self):
    """Whether B hands W what it needs (else B takes the weight gradients itself)."""
    return self._plan is not None

  def Weights(self, theta):
    """theta as the chunk's calls take it, made once a pass: packed (one input per dtype,
    packing.py) in a graph, theta itself eagerly and under XLA."""
    if tf.executing_eagerly() or self._layer.params.jit_compile:
      return theta
    if self._packing is None:
      self._packing = packing.Packing(theta)
    with tf.device(self._device), tf.name_scope(f'packed_weights{self._chunk}'):
      return self._packing.Pack(theta)

  def _Theta(self, weights):
    """The theta of what Weights made."""
    if isinstance(weights, packing.Packed):
      return self._packing.Unpack(weights)
    return weights

  def _Fprop(self, theta, args):
    return self._layer.CellFProp(self._chunk, theta, args)

  def _Forward(self, weights, args, where, step, training):
    updates = []
    with tf.device(self._device), _Context(self._layer, where, step, training, updates):
      out, acts = self._Fprop(self._Theta(weights), args)
    stats = {}
    for layer, layer_stats in updates:
      stats.setdefault(layer.path, []).append(layer_stats)
    return out, acts, stats

  def _SavingForward(self, weights, args, where, step, training):
    result, pair, saved = saved_forward.Forward(self._inlined_forward, self._Theta(weights), args,
                                                where, step, training)
    layout = packing.Packing(saved)
    self._saved_by.append(tf.compat.v1.get_default_graph())
    self._saved_layouts.append((pair, layout))
    return result, layout.Pack(saved)

  def _SavedBackward(self, weights, packed, grads_in, where, trace, arg_grads, may_be_empty):
    pair, layout = self._saved_layouts[trace]
    theta = self._Theta(weights)
    with tf.device(self._device):
      d_theta, d_args = saved_forward.Backward(pair, layout.Unpack(packed), grads_in)[:2]
      added = self._Add(theta, _ZerosWhereNone(theta, d_theta), where, may_be_empty)
    return d_args if arg_grads else None, added

  def _Add(self, theta, d_theta, where, may_be_empty):
    return _AddToSum(self.grad_sum, theta, d_theta, where[1] if may_be_empty else 1)

  def _Backward(self, weights, args, grads_in, where, step, training, clock, arg_grads,
                may_be_empty):
    theta = self._Theta(weights)
    with tf.device(self._device), _Context(self._layer, where, step, training, []):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        # Watched, an argument's gradient is taken even if not asked for.
        Watch(tape, theta, args if arg_grads else ())
        targets = self._Fprop(theta, args)
      recomputed = None if clock is None else step_timing.Stamp(clock, targets)
      d_args, d_theta = CellGradients(tape, targets, grads_in, args if arg_grads else None,
                                       theta)
      return d_args, self._Add(theta, d_theta, where, may_be_empty), recomputed

  def _InputGrad(self, weights, args, grads_in, where, step, training, clock, arg_grads,
                 may_be_empty):
    theta = self._Theta(weights)
    with tf.device(self._device), _Context(self._layer, where, step, training, []):
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        Watch(tape, theta, args)  # Theta too, so that the frontier ops are recorded.
        targets, plan, why = weight_grads.WeightGradPlan.Trace(self._Fprop, theta, args)
      if not tf.executing_eagerly():  # An eager run leaves what the traced W uses alone.
        self._plan, self.fused_split_reason = plan, why
      recomputed = None if clock is None else step_timing.Stamp(clock, targets)
      if plan is None:
        d_args, d_theta = CellGradients(tape, targets, grads_in,
                                         args if arg_grads else None, theta)
        return d_args, (), self._Add(theta, d_theta, where, may_be_empty), recomputed
      (d_args, adjoints), _ = CellGradients(tape, targets, grads_in,
                                             (args if arg_grads else (), plan.adjointed))
      handed = (plan.saved, adjoints)
      self._handed = packing.Packing(handed)
      return d_args if arg_grads else None, self._handed.Pack(handed), None, recomputed

  def _WeightGrad(self, weights, handed, where, may_be_empty):
    theta = self._Theta(weights)
    saved, adjoints = self._handed.Unpack(handed)
    with tf.device(self._device):
      d_theta = self._plan.WeightGradients(theta, saved, adjoints)
      d_theta = tf.nest.pack_sequence_as(theta, py_utils.Replaced(
          [None] * len(tf.nest.flatten(theta)), _FloatPositions(theta), d_theta))
      return self._Add(theta, _ZerosWhereNone(theta, d_theta), where, may_be_empty)

  def _Zero(self, theta):
    with tf.device(self._device):
      return self.grad_sum.Zero(theta)

  def Zero(self, theta):
    """The token of starting grad_sum at zero."""
    return self._zero(theta)

  def Forward(self, weights, args, where, step, training):
    """(outputs, activations, [(layer, stats)]) of the chunk; `weights` is Weights(theta),
    `where` the micro-batch's (offset in the whole batch, size), `step` the training step
    (tensors)."""
    return self._WithLayers(self._forward(weights, args, where, step, training))

  def SavingForward(self, weights, args, where, step, training):
    """Forward's (outputs, activations, [(layer, stats)]) and what SavedBackward takes for
    the backward without a recompute: (which trace saved it, its tensors packed)."""
    result, packed = self._saving_forward(weights, args, where, step, training)
    graph = self._saving_forward.get_concrete_function(weights, args, where, step,
                                                       training).graph
    return self._WithLayers(result) + ((self._saved_by.index(graph), packed),)

  def _WithLayers(self, result):
    out, acts, stats = result
    by_path = self._layer.cell[self._chunk].LayersByPath()
    return out, acts, [(by_path[path], s) for path in sorted(stats) for s in stats[path]]

  def SavedBackward(self, weights, saved, grads_in, where, rows, arg_grads=True):
    """(input grads (None without arg_grads), the token of adding the weight gradients to
    grad_sum) of the forward that left `saved`, its outputs weighted by `grads_in`."""
    trace, packed = saved
    return self._saved_backward(weights, packed, grads_in, where, trace, arg_grads,
                                _MayBeEmpty(rows))

  def Backward(self, weights, args, grads_in, where, step, training, rows, clock=None,
               arg_grads=True):
    """(input grads (None without arg_grads), the token of adding the weight gradients to
    grad_sum, the time the recompute ended if a clock is given); `rows` is the micro-batch's
    (may_be_empty)."""
    return self._backward(weights, args, grads_in, where, step, training, clock, arg_grads,
                          _MayBeEmpty(rows))

  def InputGrad(self, weights, args, grads_in, where, step, training, rows, clock=None,
                arg_grads=True):
    """(input grads, what W takes (B's saved activations and adjoints, packed: packing.py),
    the token of adding the weight gradients if B took them (not `splits`) else None, the
    recompute's end stamp)."""
    return self._input_grad(weights, args, grads_in, where, step, training, clock, arg_grads,
                            _MayBeEmpty(rows))

  def WeightGrad(self, weights, pending, where, rows):
    """The token of adding the weight gradients from B's `pending` to grad_sum."""
    return self._weight_grad(weights, pending, where, _MayBeEmpty(rows))
