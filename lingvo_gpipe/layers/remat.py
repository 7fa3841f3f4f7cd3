"""Re-materialization inside a layer stack: which layer outputs a forward keeps for its backward.

A pipeline with `remat` re-runs a cell's forward in the cell's backward and, as
it takes the cell's gradients, holds every activation of the cell's layers for
one micro-batch: a term that grows with the layers per cell. A remat policy cuts
a stack's layers (a SequentialLayer, a pipeline cell) into segments, each a
recompute checkpoint: the forward keeps only the segments' inputs, and the
backward recomputes one segment at a time just before taking its gradients, so
the stack holds its segment boundaries plus one segment's activations. In a
re-materialized cell this composes with the cell's own recompute: the cell's
backward re-runs the cell keeping the boundaries, then each segment again.

A segment is what tf.recompute_grad makes of a function (a custom gradient that
re-runs it under a tape of its own), but it waits for its output gradients by
a control dependency: tf.recompute_grad adds a zero computed from them to every
input, which copies the segment's weights at each recompute (so the peak memory
grows by up to a copy of the segment's weights).

Policies (POLICIES):
  'none'          no segments: the tape keeps every activation (the default).
  'every_layer'   every layer a segment: each layer's output is kept, its
                  internals are recomputed.
  'every_N'       segments of N layers (e.g. 'every_2'), from the stack's start.
  'a+b'           the outputs of the layers named a and b are kept; the layers
                  up to a, between a and b, and after b are the segments.

The results are those of the stack without a policy: a segment recomputes
under the FProp context of its forward (training, step, batch slice), so
stateless dropout draws the same masks, and a recompute's batch-norm
statistics go to a list nobody reads (the forward's were recorded).
"""

import dataclasses
import functools

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils

NONE = 'none'
EVERY_LAYER = 'every_layer'
_EVERY = 'every_'
POLICIES = ('none', 'every_layer', 'every_N', 'name+name')
_CHOICES = ("'none', 'every_layer', 'every_N' with N a positive int (e.g. 'every_2'), or "
            "layer names joined by '+' (e.g. 'layer3+layer7')")


def _Unknown(policy, where, why=''):
  """The ValueError of a policy that is not one: its value, why, and the choices."""
  prefix = f'{where}: ' if where else ''
  return ValueError(f'{prefix}unknown remat policy {policy!r}{why}; expected {_CHOICES}.')


def _Every(policy, where):
  """N of 'every_layer' (1) or 'every_N', None for a list of names; raises on a bad N."""
  if policy == EVERY_LAYER:
    return 1
  if not policy.startswith(_EVERY):
    return None
  n = policy[len(_EVERY):]
  if not n.isdigit() or int(n) < 1:
    raise _Unknown(policy, where, ': N of every_N must be a positive int')
  return int(n)


def _Names(policy, layer_names, where):
  """The layer names of a '+' policy, each checked to be one of layer_names."""
  names = policy.split('+')
  unknown = [n for n in names if n not in layer_names]
  if unknown:
    raise _Unknown(policy, where, f': {unknown} are not layers {list(layer_names)}')
  return names


def _CheckType(policy, where):
  if not isinstance(policy, str) or not policy:
    raise _Unknown(policy, where)


def StageSegments(policy, layer_names, start=0, end=None, where=''):
  """(first, end) layer indices of each segment of layers start..end-1 of `layer_names`.

  The stack may be a stage cut from a longer one: every_N counts from `start`,
  and of a policy's names, those outside the stage keep nothing in it.
  Returns [] for 'none' (nothing recomputed); else segments covering the stage.

  Raises:
    ValueError: naming the policy and the valid choices, if it is not one.
  """
  _CheckType(policy, where)
  end = len(layer_names) if end is None else end
  if policy == NONE:
    return []
  every = _Every(policy, where)
  if every is not None:
    ends = list(range(start + every, end, every)) + [end]
  else:
    kept = {layer_names.index(name) + 1 for name in _Names(policy, layer_names, where)}
    ends = sorted({e for e in kept if start < e < end} | {end})
  return list(zip([start] + ends[:-1], ends))


def _CellShares(policy, cells_layer_names, where):
  """Each cell's share of a pipeline's `policy`, for cells holding `cells_layer_names`.

  'none', 'every_layer' and 'every_N' apply to each cell as they are (every_N
  counts from the cell's first layer). Names may be in any cell: a cell keeps
  the outputs of those it holds, and a cell holding none is one segment.
  """
  if _Every(policy, where) is not None:
    return [policy] * len(cells_layer_names)
  names = _Names(policy, [n for cell in cells_layer_names for n in cell], where)
  shares = []
  for cell in cells_layer_names:
    held = [n for n in names if n in cell]
    shares.append('+'.join(held) if held else f'{_EVERY}{len(cell)}')
  return shares


def PolicyCells(cell_params, policy, where=''):
  """A pipeline's cell params, each given its share of the pipeline's `policy`.

  The pipeline's policy is the only one its cells take (a re-cut builds new
  cells, and the planner reads the pipeline's): a cell that sets its own is
  an error.

  Raises:
    ValueError: for an unknown policy (naming it and the valid choices), a
      cell with its own policy, or a policy for cells without remat_policy.
  """
  _CheckType(policy, where)
  for k, c in enumerate(cell_params):
    if 'remat_policy' in c and c.remat_policy != NONE:
      raise ValueError(f"{where}: cell {k} ({c.name}) sets remat_policy={c.remat_policy!r}; "
                       "set the pipeline's cell_remat_policy instead, which every cell takes "
                       'whatever the cut.')
  if policy == NONE:
    return list(cell_params)
  without = [c.name for c in cell_params if 'remat_policy' not in c]
  if without:
    raise ValueError(f'{where}: cell_remat_policy={policy!r} needs cells that are '
                     f'SequentialLayers (e.g. FeatureExtractionLayer); cells {without} are not.')
  shares = _CellShares(policy, [[q.name for q in c.sub] for c in cell_params], where)
  return [c.Copy().Set(remat_policy=share) for c, share in zip(cell_params, shares)]


def _IsFloat(x):
  return isinstance(x, tf.Tensor) and x.dtype.is_floating


def _ContextFields(context, **changes):
  fields = {f.name: getattr(context, f.name) for f in dataclasses.fields(context)}
  fields.update(changes)
  return fields


def _Recomputed(fn, theta, args):
  """fn(theta, args), keeping for the backward only theta, args and the outputs.

  The gradient flows to theta's and args' floating tensors; other leaves of
  the outputs (ids, paddings) are the forward's. The forward runs on inputs
  the caller's tape does not watch, so the tape records none of its ops; the
  backward recomputes it under a tape of its own once the output gradients
  exist (a control dependency: no input is copied, the weights least of all).
  """
  context = py_utils.CurrentContext()
  theta = tf.nest.map_structure(tf.convert_to_tensor, theta)
  flat_theta, flat_args = tf.nest.flatten(theta), tf.nest.flatten(args)
  arg_pos = [i for i, x in enumerate(flat_args) if _IsFloat(x)]
  forward = {}  # The structure and leaves of the forward's outputs.

  def Run(tensors, updates):
    layer_args = list(flat_args)
    for i, x in zip(arg_pos, tensors[len(flat_theta):]):
      layer_args[i] = x
    with py_utils.Context(**_ContextFields(context, updates=updates)):
      out = fn(tf.nest.pack_sequence_as(theta, tensors[:len(flat_theta)]),
               tf.nest.pack_sequence_as(args, layer_args))
    return out, [x for x in tf.nest.flatten(out) if _IsFloat(x)]

  @tf.custom_gradient
  def Segment(*tensors):
    out, floats = Run([tf.stop_gradient(x) for x in tensors], context.updates)
    forward.update(structure=out, flat=tf.nest.flatten(out))

    def Grad(*d_floats):
      with tf.control_dependencies([d for d in d_floats if d is not None]):
        inputs = [tf.identity(x) for x in tensors]
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(inputs)
        _, recomputed = Run(inputs, [])  # The forward recorded the batch statistics.
      grads = tape.gradient(recomputed, inputs, output_gradients=d_floats,
                            unconnected_gradients=tf.UnconnectedGradients.ZERO)
      # The input gradients start the recompute of the segment before: they wait for the
      # weight gradients, so that this segment's activations are gone by then.
      d_theta = grads[:len(flat_theta)]
      with tf.control_dependencies(d_theta):
        return d_theta + [tf.identity(g) for g in grads[len(flat_theta):]]

    return floats, Grad

  floats = iter(Segment(*flat_theta, *[flat_args[i] for i in arg_pos]))
  flat_out = [next(floats) if _IsFloat(x) else x for x in forward['flat']]
  return tf.nest.pack_sequence_as(forward['structure'], flat_out)


def RunSegments(run, theta_list, args, segments, training_step):
  """Runs a stack's layers segment by segment, each segment recomputed in the backward.

  Args:
    run: run(start, end, theta_list[start:end], args) -> (output, NestedMap of
      fetched outputs) of layers start..end-1 on the argument tuple `args`.
    theta_list: the layers' thetas, in order.
    args: the first layer's argument tuple.
    segments: StageSegments of the stack (non-empty).
    training_step: returns the step to draw random numbers with when training
      and the context has none (the stack's BaseLayer.TrainingStep): read once,
      so that every segment and its recompute draw the masks of that step.

  Returns:
    (the last layer's output, NestedMap of every segment's fetched outputs).
  """
  context = py_utils.CurrentContext()
  step = training_step() if context.training and context.step is None else context.step
  fetched = py_utils.NestedMap()
  with py_utils.Context(step=step):
    for start, end in segments:
      out, acts = _Recomputed(functools.partial(run, start, end), theta_list[start:end], args)
      fetched.update(acts)
      args = out if isinstance(out, tuple) else (out,)
  return out, fetched
