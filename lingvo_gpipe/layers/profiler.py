"""Measuring layers one by one: forward and backward time, parameter, input and activation
bytes.

The balance planner plans from these profiles; LayerCosts gives the per-layer
costs PartitionSequentialLayers balances by (FLOPs, parameters or time). Each
layer runs at the given batch size on random inputs (the previous layer's
outputs), as a tf.function, so a profile is of the compiled step, not of Python.
"""

import dataclasses
import time

from absl import logging
import numpy as np
import tensorflow as tf

from lingvo_gpipe import layers as layers_lib
from lingvo_gpipe.foundation import memory_stats
from lingvo_gpipe.foundation import py_utils


@dataclasses.dataclass
class LayerProfile:
  """One layer measured at the micro-batch size; seconds and bytes.

  activation_bytes is the allocator peak of its forward and backward above the
  live set, less its weight gradients: what it holds for its backward (0 when
  memory was not measured).
  """
  name: str
  forward_s: float
  backward_s: float
  param_bytes: int
  input_bytes: int
  activation_bytes: int


def RandomInput(spec, batch_size=None):
  """A random tensor of TensorSpec (or TensorShape, float32) `spec`; zeros for integers
  (valid ids and labels). batch_size, if given, replaces the batch dimension."""
  if isinstance(spec, dict):
    return py_utils.NestedMap({k: RandomInput(v, batch_size) for k, v in spec.items()})
  dtype = getattr(spec, 'dtype', tf.float32)
  shape = list(tf.TensorShape(getattr(spec, 'shape', spec)))
  if batch_size is not None:
    shape[0] = batch_size
  if dtype.is_floating:
    return tf.random.stateless_normal(shape, [0, 1], dtype=dtype)
  return tf.zeros(shape, dtype)


def _Bytes(structure):
  return int(sum(x.shape.num_elements() * x.dtype.size for x in tf.nest.flatten(structure)
                 if isinstance(x, (tf.Tensor, tf.Variable))))


def _Median(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    tf.nest.map_structure(lambda x: x.numpy() if hasattr(x, 'numpy') else x, fn())
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def _ProfileOne(layer, theta, args, repeats, memory):
  """(LayerProfile, outputs) of one layer on `args`."""
  floats = [x for x in tf.nest.flatten(args) if x.dtype.is_floating]
  weights = [v for v in tf.nest.flatten(theta) if v.trainable]

  @py_utils.DistinctFunction(autograph=False)
  def Forward():
    return layer.FProp(theta, *args)

  @py_utils.DistinctFunction(autograph=False)
  def ForwardBackward():
    with tf.GradientTape() as tape:
      tape.watch(floats)
      out = layer.FProp(theta, *args)
      total = tf.add_n([tf.reduce_sum(tf.cast(x, tf.float32)) for x in tf.nest.flatten(out)
                        if x.dtype.is_floating])
    return tape.gradient(total, floats + weights,
                         unconnected_gradients=tf.UnconnectedGradients.ZERO)

  out = Forward()
  ForwardBackward()  # Trace and warm up.
  forward = _Median(Forward, repeats)
  both = _Median(ForwardBackward, repeats)
  activation_bytes = 0
  if memory:
    grads, peak = memory_stats.PeakBytes(ForwardBackward)
    activation_bytes = max(int(peak) - _Bytes(grads), 0)
  profile = LayerProfile(name=layer.params.name, forward_s=forward,
                         backward_s=max(both - forward, 0.0), param_bytes=_Bytes(weights),
                         input_bytes=_Bytes(args), activation_bytes=activation_bytes)
  return profile, out


def ProfileLayers(layer_params_list, input_spec, batch_size=None, repeats=3, tie_fn=None,
                  progress=None, memory=True, parent=None):
  """LayerProfiles of layers run in order on random inputs.

  Args:
    layer_params_list: the layers' params, in the order they run (named).
    input_spec: TensorSpec or TensorShape (or a NestedMap of them) of the first
      layer's input, or a tuple of them for several inputs.
    batch_size: if given, replaces the batch dimension (use the micro-batch size).
    repeats: timed runs per layer; the median is kept.
    tie_fn: optional callable(list of built layers) sharing weights among them,
      as their pipeline does (e.g. a tied softmax).
    progress: optional callable(i, n, LayerProfile) after each layer.
    memory: measure activation bytes (needs memory_stats' allocator statistics).
    parent: params (e.g. the pipeline's) whose dtype, fprop_dtype, random_seed and
      params_init the layers inherit, as they do in their pipeline.
  """
  stack = layers_lib.SequentialLayer.Params().Set(name='profile', sub=layer_params_list)
  if parent is not None:
    stack.Set(dtype=parent.dtype, fprop_dtype=parent.fprop_dtype,
              random_seed=parent.random_seed, params_init=parent.params_init.Copy())
  stack = stack.Instantiate()
  if tie_fn:
    tie_fn(stack.sub)
  specs = input_spec if isinstance(input_spec, tuple) else (input_spec,)
  args = tuple(RandomInput(spec, batch_size) for spec in specs)
  profiles = []
  for i, (layer, theta) in enumerate(zip(stack.sub, stack.theta.sub)):
    profile, out = _ProfileOne(layer, theta, args, repeats, memory)
    profiles.append(profile)
    if progress:
      progress(i, len(stack.sub), profile)
    args = out if isinstance(out, tuple) else (out,)
  implausible = ImplausibleTimes(profiles)
  if implausible:
    logging.warning('%s', implausible)
  return profiles


# A backward computes about two matmuls per forward one; measured at less than half the
# forward, the timings are noise (a loaded machine), not the model.
_LEAST_BACKWARD_PER_FORWARD = 0.5


def ImplausibleTimes(profiles):
  """Why `profiles`' times cannot be the model's (a backward below half its forward), or None."""
  forward = sum(p.forward_s for p in profiles)
  backward = sum(p.backward_s for p in profiles)
  if forward > 0 and backward < _LEAST_BACKWARD_PER_FORWARD * forward:
    return (f'The profiled backward ({backward * 1e3:.3g} ms) is {backward / forward:.2f}x the '
            f'forward ({forward * 1e3:.3g} ms), where about 2x is expected: the timings are '
            'likely noise of a busy machine, and a plan made from them may be wrong. Profile '
            'again on an idle machine, or with more repeats.')
  return None


# -- per-layer costs for balancing --------------------------------------------------


def _ShapesAsArgs(input_shape):
  if isinstance(input_shape, (list, tuple)) and not isinstance(input_shape, tf.TensorShape):
    if input_shape and all(isinstance(s, (tf.TensorShape, tf.TensorSpec, py_utils.NestedMap))
                           for s in input_shape):
      return tuple(input_shape)
  return (input_shape,)


def _FlopCosts(layer_params_list, input_shapes):
  costs = []
  for p in layer_params_list:
    meta = p.cls.FPropMeta(p, *input_shapes)
    costs.append(float(meta.flops))
    input_shapes = tuple(meta.out_shapes)
  return costs


def Named(layer_params_list):
  """Copies of the params, each named (layer<i> where it had no name)."""
  named = []
  for i, p in enumerate(layer_params_list):
    p = p.Copy()
    p.name = p.name or f'layer{i}'
    named.append(p)
  return named


def _ParamCosts(layer_params_list):
  costs = []
  for p in layer_params_list:
    layer = p.Instantiate()
    costs.append(float(sum(np.prod(v.shape) for v in layer.trainable_variables)))
    del layer
  return costs


def _TimeCosts(layer_params_list, input_shapes):
  """Median forward + backward seconds of each layer (ProfileLayers)."""
  return [p.forward_s + p.backward_s for p in
          ProfileLayers(layer_params_list, tuple(input_shapes), memory=False)]


COST_KINDS = ('auto', 'flops', 'params', 'time')


def LayerCosts(layer_params_list, input_shape, cost='auto'):
  """Per-layer costs to balance stages by: FLOPs (FPropMeta), parameter count or measured
  time (forward and backward).

  input_shape: the first layer's input tf.TensorShape (or TensorSpec), or a list
  of them for several inputs, or a NestedMap of them for one NestedMap.
  """
  layer_params_list = Named(layer_params_list)
  if cost == 'auto':
    cost = 'flops' if all(p.cls.HasFPropMeta() for p in layer_params_list) else 'params'
  if cost == 'flops':
    missing = sorted({p.cls.__name__ for p in layer_params_list if not p.cls.HasFPropMeta()})
    if missing:
      raise ValueError(f"cost='flops' needs FPropMeta on every layer; missing on {missing}.")
    return _FlopCosts(layer_params_list, _ShapesAsArgs(input_shape))
  if cost == 'params':
    return _ParamCosts(layer_params_list)
  if cost == 'time':
    return _TimeCosts(layer_params_list, _ShapesAsArgs(input_shape))
  raise ValueError(f'Unknown cost {cost!r}; expected one of {list(COST_KINDS)} or a list of '
                   'per-layer numbers.')
