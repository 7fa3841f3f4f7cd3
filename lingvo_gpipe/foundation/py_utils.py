"""NestedMap, weight specifications, seeds and the scoped FProp context."""

import contextlib
import contextvars
import dataclasses
import functools
import math
import zlib

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams

_DICT_ATTRS = frozenset(dir(dict))


class NestedMap(dict):
  """A dict with attribute access; `tf.nest` treats it as a dict.

  Keys are identifiers, so `m.a.b` reads like a struct and flattening is
  deterministic (sorted keys).
  """

  def __init__(self, *args, **kwargs):
    super().__init__(*args, **kwargs)
    for key in self:
      self._CheckKey(key)

  @staticmethod
  def _CheckKey(key):
    if not isinstance(key, str) or not key.isidentifier() or key in _DICT_ATTRS:
      raise ValueError(f'NestedMap key {key!r} is invalid: expected an identifier '
                       'that is not a dict attribute.')

  def __setitem__(self, key, value):
    self._CheckKey(key)
    super().__setitem__(key, value)

  def __getattr__(self, name):
    try:
      return self[name]
    except KeyError:
      raise AttributeError(f'NestedMap has no key {name!r}; keys: {sorted(self)}.') from None

  def __setattr__(self, name, value):
    self[name] = value

  def __delattr__(self, name):
    try:
      del self[name]
    except KeyError:
      raise AttributeError(f'NestedMap has no key {name!r}.') from None

  def copy(self):
    return NestedMap(self)

  def DeepCopy(self):
    return tf.nest.map_structure(lambda x: x, self)

  def Flatten(self):
    """Leaves in `tf.nest` order."""
    return tf.nest.flatten(self)

  def FlattenItems(self):
    """(dotted key, leaf) pairs in `tf.nest` order; list items read 'a[0]'."""
    return list(_FlattenItems(self, ''))

  def Pack(self, values):
    """A structure like self with `values` as its leaves."""
    return tf.nest.pack_sequence_as(self, list(values))

  def Transform(self, fn):
    """Applies fn to every leaf."""
    return tf.nest.map_structure(fn, self)

  def Filter(self, fn):
    """Keeps leaves where fn(leaf) is true; drops emptied sub-maps and lists."""
    kept = _Filter(self, fn)
    return NestedMap() if kept is _DROPPED else kept

  def IsCompatible(self, other):
    """True when `other` has the same nested structure (keys and list lengths)."""
    try:
      tf.nest.assert_same_structure(self, other, check_types=False)
    except (ValueError, TypeError):
      return False
    return True

  def DebugString(self):
    """One 'key  value' line per leaf, sorted by key."""
    items = self.FlattenItems()
    width = max((len(k) for k, _ in items), default=0)
    return '\n'.join(f'{k:<{width}}  {_Describe(v)}' for k, v in items)


def _Describe(value):
  """Tensors and variables as dtype[shape]; other leaves as repr."""
  if hasattr(value, 'dtype') and hasattr(value, 'shape'):
    return f'{tf.as_dtype(value.dtype).name}{list(value.shape)}'
  return repr(value)


def _FlattenItems(value, prefix):
  if isinstance(value, dict):
    for key in sorted(value):
      yield from _FlattenItems(value[key], f'{prefix}.{key}' if prefix else key)
  elif isinstance(value, (list, tuple)):
    for i, v in enumerate(value):
      yield from _FlattenItems(v, f'{prefix}[{i}]')
  else:
    yield prefix, value


_DROPPED = object()


def _Filter(value, fn):
  if isinstance(value, dict):
    kept = ((k, _Filter(v, fn)) for k, v in value.items())
    out = type(value)((k, v) for k, v in kept if v is not _DROPPED)
    return out if out or not value else _DROPPED
  if isinstance(value, (list, tuple)):
    kept = [v for v in (_Filter(v, fn) for v in value) if v is not _DROPPED]
    return type(value)(kept) if kept or not value else _DROPPED
  return value if fn(value) else _DROPPED


# -- weights -----------------------------------------------------------------


class WeightInit:
  """Factories for initializer specs (Params, so they print and parse)."""

  @staticmethod
  def _Spec(method, scale):
    p = hyperparams.Params()
    p.Define('method', method, 'Initializer name.')
    p.Define('scale', scale, 'Scale (std, bound, gain or constant value).')
    return p

  @staticmethod
  def Gaussian(scale=1.0):
    """Normal(0, scale)."""
    return WeightInit._Spec('gaussian', float(scale))

  @staticmethod
  def Uniform(scale=1.0):
    """Uniform(-scale, scale)."""
    return WeightInit._Spec('uniform', float(scale))

  @staticmethod
  def Xavier(scale=1.0):
    """Glorot uniform: bound = scale * sqrt(6 / (fan_in + fan_out))."""
    return WeightInit._Spec('xavier', float(scale))

  @staticmethod
  def Constant(value=0.0):
    """Every element equals `value`."""
    return WeightInit._Spec('constant', float(value))


def CheckInterval(owner, name, value, interval):
  """Raises a ValueError naming `owner`'s `name` unless `value` is a finite number in
  `interval`, (low, low open, high, high open): (0.0, False, 1.0, True) is [0, 1)."""
  low, low_open, high, high_open = interval
  is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
  if not (is_number and math.isfinite(value) and (value > low if low_open else value >= low)
          and (value < high if high_open else value <= high)):
    raise ValueError(f'{owner}: {name} must be in {"(" if low_open else "["}{low:g}, {high:g}'
                     f'{")" if high_open else "]"}, got {value!r}.')


def WeightParams(shape, init=None, dtype=None, trainable=True):
  """What CreateVariable needs: shape, initializer spec, dtype, trainability."""
  p = hyperparams.Params()
  p.Define('shape', list(shape), 'Variable shape.')
  p.Define('init', init, 'A WeightInit spec; None takes the layer params_init.')
  p.Define('dtype', dtype, 'Variable dtype; None takes the layer dtype.')
  p.Define('trainable', trainable, 'Whether optimizers update it.')
  return p


def _Fans(shape):
  if not shape:
    return 1, 1
  if len(shape) == 1:
    return shape[0], shape[0]
  receptive = 1
  for d in shape[:-2]:
    receptive *= d
  return shape[-2] * receptive, shape[-1] * receptive


def InitialValue(init, shape, dtype, seed):
  """Initial value of a variable: a pure function of (init, shape, dtype, seed)."""
  shape = [int(d) for d in shape]
  method, scale = init.method, init.scale
  if method == 'constant':
    return tf.fill(shape, tf.cast(scale, dtype))
  if method == 'gaussian':
    return tf.random.stateless_normal(shape, seed, stddev=scale, dtype=dtype)
  if method == 'uniform':
    return tf.random.stateless_uniform(shape, seed, -scale, scale, dtype=dtype)
  if method == 'xavier':
    fan_in, fan_out = _Fans(shape)
    bound = scale * (6.0 / (fan_in + fan_out)) ** 0.5
    return tf.random.stateless_uniform(shape, seed, -bound, bound, dtype=dtype)
  raise ValueError(f'Unknown WeightInit method {method!r}; expected one of '
                   'gaussian, uniform, xavier, constant.')


def PathSeed(random_seed, path):
  """A stateless seed pair from a layer seed and a variable's path."""
  return tf.constant([int(random_seed) & 0x7FFFFFFF, zlib.crc32(path.encode()) & 0x7FFFFFFF],
                     dtype=tf.int64)


# -- the FProp context ---------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FPropContext:
  """What a forward pass may depend on besides theta and its inputs.

  training: dropout and batch-norm statistics on (True) or off (False).
  step: the step seeding random ops (int or scalar tensor); None lets the
    called layer count its own calls (BaseLayer.TrainingStep).
  batch_slice: where the examples being computed sit in the step's whole
    batch, so that random ops draw per example whatever the micro-batching.
  updates: a list that collects batch-norm statistics, or None to apply them
    at once; the pipeline sets it so recomputed forwards update nothing twice.
  step_stats: a list that pipelines append one timing record per schedule step
    to (opt-in measurement), or None not to measure.
  loss_scale: None, or a float32 scalar (float16 loss scaling, lingvo_gpipe.training.loss_scale):
    ForwardBackward differentiates loss_scale * loss and divides its gradients by
    it, so they come out unscaled.
  """
  training: bool = True
  step: object = None
  batch_slice: object = None
  updates: object = None
  step_stats: object = None
  loss_scale: object = None


@dataclasses.dataclass(frozen=True)
class BatchSlice:
  """Examples [offset, offset + size) of a whole batch along dimension batch_dim.

  offset and size may be tensors. Outside a pipeline (None in the context) a
  layer computes the whole batch.
  """
  offset: object
  size: object
  batch_dim: int = 0


_CONTEXT = contextvars.ContextVar('lingvo_gpipe_fprop_context', default=FPropContext())


def CurrentContext():
  """The FPropContext in force."""
  return _CONTEXT.get()


@contextlib.contextmanager
def Context(**changes):
  """Scopes changes to the FPropContext, e.g. `with Context(training=False):`."""
  token = _CONTEXT.set(dataclasses.replace(_CONTEXT.get(), **changes))
  try:
    yield _CONTEXT.get()
  finally:
    _CONTEXT.reset(token)


# The scope of the variables a pipeline makes for itself (gradient sums, clocks): not
# the model's and never saved; a runner that manages variables by name (estimator.py)
# leaves them alone.
SCRATCH_SCOPE = 'pipeline_scratch'


def IsFloatTensor(x):
  """Whether x is a floating tensor or variable (what has gradients)."""
  return isinstance(x, (tf.Tensor, tf.Variable)) and x.dtype.is_floating


def Replaced(values, positions, replacements):
  """A copy of `values` with values[positions[i]] = replacements[i]."""
  values = list(values)
  for i, x in zip(positions, replacements):
    values[i] = x
  return values


def Tensors(structure):
  """The tensors of a structure (what an op waits for to wait for all of it)."""
  return [x for x in tf.nest.flatten(structure) if isinstance(x, tf.Tensor)]


def ScaledGradients(tape, loss, sources):
  """tape.gradient(loss, sources), unconnected ones 0, through the context's loss scale:
  scale * loss is differentiated and the gradients divided by the scale, so that a float16
  backward keeps its small values and the caller gets unscaled gradients."""
  scale = CurrentContext().loss_scale
  if scale is not None:
    with tape:
      loss = loss * tf.cast(scale, loss.dtype)
  grads = tape.gradient(loss, sources, unconnected_gradients=tf.UnconnectedGradients.ZERO)
  if scale is None:
    return grads


  def Unscaled(g):
    if isinstance(g, tf.IndexedSlices):  # A gathered embedding's gradient stays sparse.
      return tf.IndexedSlices(Unscaled(g.values), g.indices, g.dense_shape)
    return g / tf.cast(scale, g.dtype)

  return [Unscaled(g) for g in grads]


def EvalMode():
  """Context for evaluation and inference: no dropout, moving statistics."""
  return Context(training=False)


def _Mix(x):
  """A bijective avalanche of uint32 tensor x (xor-shifts and odd multiplies): integer ops,
  which XLA and TensorFlow's kernels compute alike."""
  for shift, factor in ((16, 0x7FEB352D), (15, 0x846CA68B)):
    x = tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(shift, tf.uint32)))
    x *= tf.constant(factor, tf.uint32)
  return tf.bitwise.bitwise_xor(x, tf.bitwise.right_shift(x, tf.constant(16, tf.uint32)))


def _Words(x):
  """(low, high) 32-bit words of int64 tensor x, as uint32."""
  low = tf.cast(tf.bitwise.bitwise_and(x, tf.constant(0xFFFFFFFF, tf.int64)), tf.uint32)
  return low, tf.cast(tf.bitwise.right_shift(x, tf.constant(32, tf.int64)), tf.uint32)


def _HashUniform(layer_seed, step, start, size):
  """Uniform [0, 1) float32 numbers of positions start.. start + size - 1 (modulo 2^32): a
  hash of (layer_seed, step, position), so any slice of positions gets its numbers alone,
  the same on every device and under XLA (whose stateless random kernels give other numbers
  than TensorFlow's). One avalanche per number, of the position times an odd multiplier
  plus an offset, both from the key: another (seed, step) scatters the positions anew."""
  xor = tf.bitwise.bitwise_xor
  step_low, step_high = _Words(tf.cast(step, tf.int64))
  key = _Mix(tf.constant((int(layer_seed) & 0x7FFFFFFF) ^ 0x9E3779B9, tf.uint32))
  key = _Mix(xor(_Mix(xor(key, step_low)), step_high))
  multiplier = tf.bitwise.bitwise_or(_Mix(key), tf.constant(1, tf.uint32))
  positions = _Words(start)[0] + tf.cast(tf.range(tf.cast(size, tf.int32)), tf.uint32)
  bits = _Mix(positions * multiplier + key)
  # The top 24 bits: float32 holds them exactly, so no number rounds up to 1.
  return tf.cast(tf.bitwise.right_shift(bits, tf.constant(8, tf.uint32)), tf.float32) * 2.0**-24


def BatchUniform(layer_seed, step, like):
  """Uniform [0, 1) float32 noise shaped like tensor `like`, for the context's BatchSlice.

  The numbers are _HashUniform's of the floats' positions in the whole batch
  (batch dimension first): a micro-batch draws its part of the whole batch's
  noise, so dropout masks are the same for any number of micro-batches,
  replicas or stages, again in a recomputed forward, and compiled by XLA or
  not. Each (layer_seed, step) gives another stream. `like` must hold the
  slice's examples along the batch dimension, in batch-major order.
  """
  where = CurrentContext().batch_slice or BatchSlice(0, None)
  rank = like.shape.rank
  if where.batch_dim >= rank:
    raise ValueError(f'Random noise for a tensor of shape {like.shape} needs its batch '
                     f'dimension {where.batch_dim}.')
  perm = [where.batch_dim] + [d for d in range(rank) if d != where.batch_dim]
  shape = tf.gather(tf.shape(like, out_type=tf.int64), perm)
  size = tf.reduce_prod(shape)
  rows = shape[0] if where.size is None else tf.cast(where.size, tf.int64)
  # Floats per example (of a reshaped tensor too); an empty micro-batch draws none.
  start = tf.cast(where.offset, tf.int64) * (size // tf.maximum(rows, 1))
  noise = tf.reshape(_HashUniform(layer_seed, step, start, size), shape)
  return tf.transpose(noise, tf.argsort(perm)) if where.batch_dim else noise


def CombineMoments(stats_list):
  """NestedMap(mean, variance, count) of the union of batches, each given as such a map
  (count: the examples each statistic is over); variances are biased, as tf.nn.moments'.
  A batch of count 0 (an empty micro-batch, whose moments are NaN) adds nothing."""
  count = tf.add_n([s.count for s in stats_list])
  mean = tf.add_n([tf.math.multiply_no_nan(s.mean, s.count) for s in stats_list]) / count
  variance = tf.add_n([tf.math.multiply_no_nan(s.variance + tf.square(s.mean - mean), s.count)
                       for s in stats_list]) / count
  return NestedMap(mean=mean, variance=variance, count=count)


def DistinctFunction(fn=None, name=None, **kwargs):
  """tf.function(fn, **kwargs), also as a decorator, whose traces TensorFlow's retracing
  warning counts apart; its graphs' functions are named `name` (default: fn's name).

  TensorFlow counts traces per code object, so one function per layer or cell made from
  the same method or closure, each traced once, would look like one function traced again
  and again (a warning that blames the user).
  """
  if fn is None:
    return functools.partial(DistinctFunction, name=name, **kwargs)
  distinct = functools.partial(fn)
  distinct.__name__ = name or getattr(fn, '__name__', 'function')
  return tf.function(distinct, **kwargs)
