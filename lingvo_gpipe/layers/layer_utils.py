"""What the layers share: argument checks that name the bad value, the bias-and-activation
tail, float32 normalization, and FPropMeta arithmetic (FLOPs and output shapes), which the
partitioner balances stages with (a multiply-add counts 2; elementwise work is an estimate)."""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils

ACTIVATIONS = {
    'NONE': tf.identity,
    'RELU': tf.nn.relu,
    'GELU': tf.nn.gelu,
    'TANH': tf.tanh,
    'SIGMOID': tf.sigmoid,
}
PADDINGS = ('SAME', 'VALID')
POOLING_TYPES = ('MAX', 'AVG')

# Estimated forward FLOPs per element of the elementwise parts, for FPropMeta.
NORM_FLOPS = 7  # Mean, centre, square, variance, rsqrt scaling, scale, bias.
SOFTMAX_FLOPS = 5  # Max, subtract, exp, sum, normalize.
DROPOUT_FLOPS = 2  # Random draw and masked scaling.

# Floor of a total weight that divides a loss, so an all-padded batch gives 0, not NaN.
TINY_WEIGHT = 1e-9


# -- validation ---------------------------------------------------------------


def IsPositiveInt(value):
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def CheckPositive(layer, **values):
  """Raises a ValueError naming the first value that is not a positive int."""
  for name, value in values.items():
    if not IsPositiveInt(value):
      raise ValueError(f'{layer.path}: {name} must be a positive int, got {value!r}.')


def CheckShape(layer, name, value, rank):
  """Raises a ValueError unless `value` is `rank` positive ints."""
  if not (isinstance(value, (list, tuple)) and len(value) == rank and
          all(IsPositiveInt(v) for v in value)):
    raise ValueError(f'{layer.path}: {name} must be {rank} positive ints, got {value!r}.')


def CheckChoice(layer, name, value, choices):
  if value not in choices:
    raise ValueError(f'{layer.path}: unknown {name} {value!r}; expected one of {list(choices)}.')


def CheckProb(layer, name, value, low_open, high_open):
  """Raises a ValueError unless `value` is a probability in the given interval."""
  py_utils.CheckInterval(layer.path, name, value, (0.0, low_open, 1.0, high_open))


def CheckDropoutProbs(layer, *names):
  """Raises a ValueError naming the first drop probability outside [0, 1)."""
  for name in names:
    CheckProb(layer, name, layer.params.Get(name), low_open=False, high_open=True)


# -- shared computation -------------------------------------------------------


def CreateNamedChildren(layer, child_params):
  """Creates the children {name: params}; they take the layer's dtype and params_init as
  any child left at the defaults does (base_layer)."""
  for name, p in child_params.items():
    layer.CreateChild(name, p)


def BiasAndActivation(x, theta, p):
  """act(x + b): the tail shared by projections and convolutions."""
  if p.has_bias:
    x += theta.b
  return ACTIVATIONS[p.activation](x)


def Normalize(x32, mean, variance, epsilon, scale, bias):
  """(x - mean) / sqrt(variance + epsilon) in float32, then scaled in scale's dtype."""
  normed = (x32 - tf.cast(mean, tf.float32)) * tf.math.rsqrt(
      tf.cast(variance, tf.float32) + epsilon)
  return tf.cast(normed, scale.dtype) * scale + bias


def LeadingDimsThen(like, keep, dims):
  """The shape of `like`'s dimensions [:keep] followed by `dims`, for tf.reshape: a constant
  where those are known, as they are in a pipeline's cells (TensorFlow reads a chunk's
  function again at each of its calls while it prepares the step, so ops saved in a cell are
  saved at every action), else a tensor read when the step runs."""
  shape = like.shape[:keep].concatenate(dims)
  if shape.is_fully_defined():
    return shape
  return tf.concat([tf.shape(like)[:keep], dims], 0)


def LastDimMatMul(x, w, input_dim, output_dim, transpose_b=False):
  """x [..., input_dim] @ w [input_dim, output_dim] (w [output_dim, input_dim] with
  transpose_b) as one 2-D matmul: an ellipsis einsum's weight gradient materializes
  [rows, in, out]. A rank-2 x needs no reshapes (LeadingDimsThen says why each op counts)."""
  if x.shape.rank == 2:
    return tf.matmul(x, w, transpose_b=transpose_b)
  y = tf.matmul(tf.reshape(x, [-1, input_dim]), w, transpose_b=transpose_b)
  return tf.reshape(y, LeadingDimsThen(x, -1, [output_dim]))


def LargeNegative(dtype):
  """A logit that softmax turns into 0, yet finite in `dtype` (bfloat16/float16 too)."""
  return tf.constant(-0.7 * dtype.max, dtype)


# -- FPropMeta helpers ----------------------------------------------------------


def AsShape(shape):
  """A tf.TensorShape from a TensorShape, TensorSpec or list of dims."""
  return tf.TensorShape(getattr(shape, 'shape', shape))


def NumElements(shape):
  n = AsShape(shape).num_elements()
  if n is None:
    raise ValueError(f'FPropMeta needs a fully defined shape, got {shape}.')
  return n


def Meta(flops, *out_shapes):
  return py_utils.NestedMap(flops=int(flops),
                            out_shapes=tuple(AsShape(s) for s in out_shapes))


def MetaOf(p, *input_shapes):
  return p.cls.FPropMeta(p, *input_shapes)


def ChainedMeta(params_list, *input_shapes):
  """FPropMeta of layers run in order, each fed the previous one's outputs."""
  flops = 0
  for p in params_list:
    meta = MetaOf(p, *input_shapes)
    flops += meta.flops
    input_shapes = meta.out_shapes
  return py_utils.NestedMap(flops=flops, out_shapes=tuple(input_shapes))


def MetaWithBiasAndActivation(p, flops, out_shape):
  """FPropMeta of a projection or convolution: its FLOPs plus those of its bias-and-activation
  tail over every output."""
  tail = NumElements(out_shape) * (int(p.has_bias) + int(p.activation != 'NONE'))
  return Meta(flops + tail, out_shape)


def WindowOutputSize(size, window, stride, padding):
  """Output length of a sliding window over `size` positions."""
  if padding == 'SAME':
    return -(-size // stride)
  return (size - window) // stride + 1


def WindowOutputShape(input_shape, window, stride, padding, depth):
  """NHWC output shape of a 2-D window (convolution or pooling)."""
  batch, height, width, _ = AsShape(input_shape).as_list()
  return tf.TensorShape([batch,
                         WindowOutputSize(height, window[0], stride[0], padding),
                         WindowOutputSize(width, window[1], stride[1], padding),
                         depth])


def OnAtLeastOneRow(fn, x):
  """fn(x) for a batch x that may have no rows, as an empty micro-batch has: a zero row is
  appended where it has none, and its output dropped (no control flow; a batch with rows
  gains none). TensorFlow 2.21's CPU convolutions return their input unchanged on no rows
  (tf.nn.conv2d of [0, 8, 8, 3] is [0, 8, 8, 3]) and oneDNN's max-pooling gradient (not the
  average's) aborts the process ("Check failed: dtype() == expected_dtype"). A concat, not tf.pad: Grappler
  folds a pad into the convolution, which then sees no rows again."""
  if isinstance(x.shape[0], int) and x.shape[0] > 0:
    return fn(x)
  rows = tf.shape(x)[0]
  extra = tf.zeros(tf.concat([[tf.maximum(1 - rows, 0)], tf.shape(x)[1:]], 0), x.dtype)
  return fn(tf.concat([x, extra], 0))[:rows]
