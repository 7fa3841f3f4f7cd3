"""Building-block layers: projections, normalization, embeddings, softmax,
attention, Transformer, convolution and pooling.

Every FProp is a pure function of theta, its inputs and the FProp context
(training flag, step and micro-batch for dropout; an update list for batch-norm
statistics), so a pipeline may recompute any layer on any device and get the
same numbers. Activations run in `fprop_dtype`; moments, softmax and cross
entropy are computed in float32 and cast back.

Leaf layers cast theta to `fprop_dtype` where they use it; composite layers
leave that to their children, so non-trainable statistics such as batch-norm
moving averages are never rounded through a low-precision dtype.

`FPropMeta` gives the forward FLOPs (a multiply-add counts 2; elementwise work
is an estimate) and output shapes, which the partitioner balances stages with.
"""

import functools
import math

import tensorflow as tf

from lingvo_gpipe.core import base_layer
from lingvo_gpipe.core import py_utils
from lingvo_gpipe.core import remat

_ACTIVATIONS = {
    'NONE': tf.identity,
    'RELU': tf.nn.relu,
    'GELU': tf.nn.gelu,
    'TANH': tf.tanh,
    'SIGMOID': tf.sigmoid,
}
_PADDINGS = ('SAME', 'VALID')
_POOLING_TYPES = ('MAX', 'AVG')

# Estimated forward FLOPs per element of the elementwise parts, for FPropMeta.
_NORM_FLOPS = 7  # Mean, centre, square, variance, rsqrt scaling, scale, bias.
_SOFTMAX_FLOPS = 5  # Max, subtract, exp, sum, normalize.
_DROPOUT_FLOPS = 2  # Random draw and masked scaling.

# Floor of a total weight that divides a loss, so an all-padded batch gives 0, not NaN.
_TINY_WEIGHT = 1e-9


# -- validation ---------------------------------------------------------------


def _IsPositiveInt(value):
  return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _CheckPositive(layer, **values):
  """Raises a ValueError naming the first value that is not a positive int."""
  for name, value in values.items():
    if not _IsPositiveInt(value):
      raise ValueError(f'{layer.path}: {name} must be a positive int, got {value!r}.')


def _CheckShape(layer, name, value, rank):
  """Raises a ValueError unless `value` is `rank` positive ints."""
  if not (isinstance(value, (list, tuple)) and len(value) == rank and
          all(_IsPositiveInt(v) for v in value)):
    raise ValueError(f'{layer.path}: {name} must be {rank} positive ints, got {value!r}.')


def _CheckChoice(layer, name, value, choices):
  if value not in choices:
    raise ValueError(f'{layer.path}: unknown {name} {value!r}; expected one of {list(choices)}.')


def _CheckProb(layer, name, value, low_open, high_open):
  """Raises a ValueError unless `value` is a probability in the given interval."""
  py_utils.CheckInterval(layer.path, name, value, (0.0, low_open, 1.0, high_open))


def _CheckDropoutProbs(layer, *names):
  """Raises a ValueError naming the first drop probability outside [0, 1)."""
  for name in names:
    _CheckProb(layer, name, layer.params.Get(name), low_open=False, high_open=True)


# -- shared computation -------------------------------------------------------


def CreateNamedChildren(layer, child_params):
  """Creates the children {name: params}; they take the layer's dtype and params_init as
  any child left at the defaults does (base_layer)."""
  for name, p in child_params.items():
    layer.CreateChild(name, p)


def _BiasAndActivation(x, theta, p):
  """act(x + b): the tail shared by projections and convolutions."""
  if p.has_bias:
    x += theta.b
  return _ACTIVATIONS[p.activation](x)


def _Normalize(x32, mean, variance, epsilon, scale, bias):
  """(x - mean) / sqrt(variance + epsilon) in float32, then scaled in scale's dtype."""
  normed = (x32 - tf.cast(mean, tf.float32)) * tf.math.rsqrt(
      tf.cast(variance, tf.float32) + epsilon)
  return tf.cast(normed, scale.dtype) * scale + bias


def _LargeNegative(dtype):
  """A logit that softmax turns into 0, yet finite in `dtype` (bfloat16/float16 too)."""
  return tf.constant(-0.7 * dtype.max, dtype)


def _DropoutParams(drop_prob):
  return DropoutLayer.Params().Set(keep_prob=1.0 - drop_prob)


# -- FPropMeta helpers ----------------------------------------------------------


def _AsShape(shape):
  """A tf.TensorShape from a TensorShape, TensorSpec or list of dims."""
  return tf.TensorShape(getattr(shape, 'shape', shape))


def _NumElements(shape):
  n = _AsShape(shape).num_elements()
  if n is None:
    raise ValueError(f'FPropMeta needs a fully defined shape, got {shape}.')
  return n


def _Meta(flops, *out_shapes):
  return py_utils.NestedMap(flops=int(flops),
                            out_shapes=tuple(_AsShape(s) for s in out_shapes))


def _MetaOf(p, *input_shapes):
  return p.cls.FPropMeta(p, *input_shapes)


def _ChainedMeta(params_list, *input_shapes):
  """FPropMeta of layers run in order, each fed the previous one's outputs."""
  flops = 0
  for p in params_list:
    meta = _MetaOf(p, *input_shapes)
    flops += meta.flops
    input_shapes = meta.out_shapes
  return py_utils.NestedMap(flops=flops, out_shapes=tuple(input_shapes))


def _BiasAndActivationFlops(p, num_outputs):
  return num_outputs * (int(p.has_bias) + int(p.activation != 'NONE'))


def _WindowOutputSize(size, window, stride, padding):
  """Output length of a sliding window over `size` positions."""
  if padding == 'SAME':
    return -(-size // stride)
  return (size - window) // stride + 1


def _WindowOutputShape(input_shape, window, stride, padding, depth):
  """NHWC output shape of a 2-D window (convolution or pooling)."""
  batch, height, width, _ = _AsShape(input_shape).as_list()
  return tf.TensorShape([batch,
                         _WindowOutputSize(height, window[0], stride[0], padding),
                         _WindowOutputSize(width, window[1], stride[1], padding),
                         depth])


# -- layers -------------------------------------------------------------------


class ProjectionLayer(base_layer.BaseLayer):
  """Fully connected: act(x @ w + b) over the last dimension of inputs of any rank."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('output_dim', 0, 'Depth of the outputs.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    p.Define('activation', 'NONE', f'Activation applied last, one of {list(_ACTIVATIONS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, input_dim=p.input_dim, output_dim=p.output_dim)
    _CheckChoice(self, 'activation', p.activation, _ACTIVATIONS)
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))
    if p.has_bias:
      self.CreateVariable('b', py_utils.WeightParams([p.output_dim],
                                                     py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., output_dim]."""
    theta = self.ToFPropDtype(theta)
    x = self.ToFPropDtype(inputs)
    # A 2-D matmul: an ellipsis einsum's weight gradient materializes [rows, in, out].
    y = tf.matmul(tf.reshape(x, [-1, self.params.input_dim]), theta.w)
    y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [self.params.output_dim]], 0))
    return _BiasAndActivation(y, theta, self.params)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    shape = _AsShape(input_shape)
    out = shape[:-1].concatenate([params.output_dim])
    rows = _NumElements(shape[:-1])
    flops = 2 * rows * params.input_dim * params.output_dim
    return _Meta(flops + _BiasAndActivationFlops(params, _NumElements(out)), out)


class LayerNorm(base_layer.BaseLayer):
  """Normalizes the last dimension to zero mean and unit variance, then scales."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('epsilon', 1e-6, 'Added to the variance so constant inputs do not divide by 0.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, input_dim=p.input_dim)
    self.CreateVariable('scale', py_utils.WeightParams([p.input_dim],
                                                       py_utils.WeightInit.Constant(1.0)))
    self.CreateVariable('bias', py_utils.WeightParams([p.input_dim],
                                                      py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., input_dim]; moments in float32 for stability."""
    theta = self.ToFPropDtype(theta)
    x32 = tf.cast(inputs, tf.float32)
    mean, variance = tf.nn.moments(x32, axes=[-1], keepdims=True)
    return _Normalize(x32, mean, variance, self.params.epsilon, theta.scale, theta.bias)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    return _Meta(_NORM_FLOPS * _NumElements(input_shape), input_shape)


class EmbeddingLayer(base_layer.BaseLayer):
  """Looks up rows of a [vocab_size, embedding_dim] table.

  Ids must lie in [0, vocab_size). On CPU tf.gather raises InvalidArgumentError
  for other ids; on GPU it returns zero rows silently, so validate ids upstream.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('vocab_size', 0, 'Number of rows (distinct ids).')
    p.Define('embedding_dim', 0, 'Depth of each embedding.')
    p.Define('scale_sqrt_depth', False,
             'Multiply embeddings by sqrt(embedding_dim), as Transformers do.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, vocab_size=p.vocab_size, embedding_dim=p.embedding_dim)
    self.CreateVariable('emb', py_utils.WeightParams([p.vocab_size, p.embedding_dim]))

  def EmbLookup(self, theta, ids):
    """Integer ids [...] -> embeddings [..., embedding_dim]."""
    # Gather first, then cast: only the looked-up rows, not the table, change dtype.
    rows = self.ToFPropDtype(tf.gather(theta.emb, ids))
    if self.params.scale_sqrt_depth:
      rows *= tf.cast(math.sqrt(self.params.embedding_dim), rows.dtype)
    return rows

  def FProp(self, theta, ids):
    return self.EmbLookup(theta, ids)

  @classmethod
  def FPropMeta(cls, params, ids_shape):
    out = _AsShape(ids_shape).concatenate([params.embedding_dim])
    return _Meta(_NumElements(out), out)


class PositionalEmbeddingLayer(base_layer.BaseLayer):
  """Sinusoidal position embeddings [sin(p * f_i), cos(p * f_i)]; no variables.

  The frequencies f_i = max_timescale^(-2i / embedding_dim) follow
  "Attention Is All You Need".
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('embedding_dim', 0, 'Depth of each embedding; even (sines and cosines).')
    p.Define('max_len', 10000, 'Longest sequence accepted; positions lie in [0, max_len).')
    p.Define('max_timescale', 1.0e4, 'Wavelength scale of the slowest sinusoid.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, embedding_dim=p.embedding_dim, max_len=p.max_len)
    if p.embedding_dim % 2:
      raise ValueError(f'{self.path}: embedding_dim must be even, got {p.embedding_dim}.')

  def FProp(self, theta, seq_length):
    """Embeddings [seq_length, embedding_dim] of positions 0..seq_length-1."""
    return self.FPropWithPosition(theta, tf.range(seq_length))

  def FPropWithPosition(self, theta, positions):
    """Integer positions [...] -> [..., embedding_dim].

    Positions >= max_len are a ValueError when statically known (eager, or
    constant in a graph); dynamic ones are not checked.
    """
    del theta  # No variables.
    p = self.params
    static = tf.get_static_value(positions)
    if static is not None and static.size and static.max() >= p.max_len:
      raise ValueError(f'{self.path}: position {static.max()} needs a sequence longer than '
                       f'max_len={p.max_len}.')
    half = p.embedding_dim // 2
    inv_timescales = tf.exp(tf.range(half, dtype=tf.float32) *
                            (-math.log(p.max_timescale) / half))
    angles = tf.cast(positions, tf.float32)[..., tf.newaxis] * inv_timescales
    return self.ToFPropDtype(tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1))


class SimpleFullSoftmax(base_layer.BaseLayer):
  """Logits by a full projection, then (label-smoothed) cross entropy in float32."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('num_classes', 0, 'Number of classes.')
    p.Define('label_smoothing', 0.0,
             'eps in targets = (1 - eps) * onehot + eps / num_classes; in [0, 1).')
    return p

  @classmethod
  def _ProjectionParams(cls, p):
    return ProjectionLayer.Params().Set(input_dim=p.input_dim, output_dim=p.num_classes)

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, input_dim=p.input_dim, num_classes=p.num_classes)
    _CheckProb(self, 'label_smoothing', p.label_smoothing, low_open=False, high_open=True)
    CreateNamedChildren(self, {'proj': self._ProjectionParams(p)})

  def Logits(self, theta, inputs):
    """[..., input_dim] -> logits [..., num_classes] in fprop_dtype."""
    return self.proj.FProp(theta.proj, inputs)

  def FProp(self, theta, inputs, class_ids, class_weights=None):
    """Cross entropy of inputs [..., input_dim] against integer class_ids [...].

    Args:
      theta: this layer's theta.
      inputs: [..., input_dim].
      class_ids: [...] integer labels.
      class_weights: [...] per-example weights (e.g. 1 - paddings); None weighs 1.

    Returns:
      NestedMap of logits [..., C] in fprop_dtype; log_probs [..., C],
      per_example_xent [...], total_xent, total_weight and
      avg_xent = total_xent / total_weight (scalars) in float32;
      per_example_argmax [...] int32.
    """
    p = self.params
    logits = self.Logits(theta, inputs)
    log_probs = tf.nn.log_softmax(tf.cast(logits, tf.float32))
    onehot = tf.one_hot(class_ids, p.num_classes, dtype=tf.float32)
    targets = (1.0 - p.label_smoothing) * onehot + p.label_smoothing / p.num_classes
    per_example_xent = -tf.reduce_sum(targets * log_probs, axis=-1)
    if class_weights is None:
      weights = tf.ones_like(per_example_xent)
    else:
      weights = tf.cast(class_weights, tf.float32)
    total_xent = tf.reduce_sum(per_example_xent * weights)
    total_weight = tf.reduce_sum(weights)
    return py_utils.NestedMap(
        logits=logits,
        log_probs=log_probs,
        per_example_xent=per_example_xent,
        per_example_argmax=tf.argmax(log_probs, axis=-1, output_type=tf.int32),
        total_xent=total_xent,
        total_weight=total_weight,
        avg_xent=total_xent / tf.maximum(total_weight, _TINY_WEIGHT))

  @classmethod
  def FPropMeta(cls, params, inputs_shape, class_ids_shape=None, class_weights_shape=None):
    del class_ids_shape, class_weights_shape  # Implied by inputs_shape.
    logits = _MetaOf(cls._ProjectionParams(params), inputs_shape)
    logits_shape = logits.out_shapes[0]
    examples = logits_shape[:-1]
    # Softmax, then smoothing the targets and their product with log_probs.
    flops = logits.flops + (_SOFTMAX_FLOPS + 3) * _NumElements(logits_shape)
    scalar = tf.TensorShape([])
    out = py_utils.NestedMap(
        logits=logits_shape, log_probs=logits_shape, per_example_xent=examples,
        per_example_argmax=examples, total_xent=scalar, total_weight=scalar, avg_xent=scalar)
    return py_utils.NestedMap(flops=flops, out_shapes=(out,))


class DropoutLayer(base_layer.BaseLayer):
  """Stateless dropout: the mask is a function of (layer, step, example).

  Each example's mask is its part of the whole batch's (py_utils.BatchUniform),
  so any cut, number of micro-batches or replicas drops the same units, and a
  recomputed forward drops them again. The step is the context's, else the
  layer's count of its training calls (BaseLayer.TrainingStep). It is the
  identity in eval mode or when keep_prob is 1.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('keep_prob', 1.0, 'Probability of keeping each unit; in (0, 1].')
    return p

  def __init__(self, params):
    super().__init__(params)
    _CheckProb(self, 'keep_prob', self.params.keep_prob, low_open=True, high_open=False)

  def FProp(self, theta, inputs):
    """Zeroes each unit with probability 1 - keep_prob and scales the kept ones."""
    del theta  # No variables.
    x = self.ToFPropDtype(inputs)
    keep_prob = self.params.keep_prob
    if keep_prob == 1.0 or not py_utils.CurrentContext().training:
      return x
    noise = py_utils.BatchUniform(self.layer_seed, self.TrainingStep(), x)
    return tf.where(noise < keep_prob, x / tf.cast(keep_prob, x.dtype), tf.zeros_like(x))

  @classmethod
  def FPropMeta(cls, params, input_shape):
    per_element = 0 if params.keep_prob == 1.0 else _DROPOUT_FLOPS
    return _Meta(per_element * _NumElements(input_shape), input_shape)


def _HiddenDim(p):
  return p.input_dim if p.hidden_dim is None else p.hidden_dim


class MultiHeadedAttention(base_layer.BaseLayer):
  """Scaled dot-product attention over num_heads heads, with learned projections.

  Query, key and value are projected to hidden_dim and split into heads; each
  head attends separately; the heads are concatenated and projected back to
  input_dim.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of query, key, value and output.')
    p.Define('hidden_dim', None, 'Total depth of all heads; None means input_dim.')
    p.Define('num_heads', 1, 'Number of heads; must divide hidden_dim.')
    p.Define('causal', False, 'Whether query t may only attend to keys <= t (needs T == S).')
    p.Define('atten_dropout_prob', 0.0, 'Dropout probability of the attention weights.')
    return p

  @classmethod
  def _ProjectionParams(cls, p):
    """Params of the query, key and value projections and the output ('post') one."""
    into = ProjectionLayer.Params().Set(input_dim=p.input_dim, output_dim=_HiddenDim(p))
    return {
        'query_proj': into,
        'key_proj': into.Copy(),
        'value_proj': into.Copy(),
        'post_proj': ProjectionLayer.Params().Set(input_dim=_HiddenDim(p),
                                                  output_dim=p.input_dim),
    }

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, input_dim=p.input_dim, hidden_dim=_HiddenDim(p),
                   num_heads=p.num_heads)
    if _HiddenDim(p) % p.num_heads:
      raise ValueError(f'{self.path}: hidden_dim={_HiddenDim(p)} is not divisible by '
                       f'num_heads={p.num_heads}.')
    _CheckDropoutProbs(self, 'atten_dropout_prob')
    children = self._ProjectionParams(p)
    children['atten_dropout'] = _DropoutParams(p.atten_dropout_prob)
    CreateNamedChildren(self, children)

  @property
  def _head_dim(self):
    return _HiddenDim(self.params) // self.params.num_heads

  def _SplitHeads(self, x):
    """[B, T, hidden_dim] -> [B, T, num_heads, head_dim]."""
    shape = tf.concat([tf.shape(x)[:-1], [self.params.num_heads, self._head_dim]], axis=0)
    return tf.reshape(x, shape)

  def _ValidMask(self, paddings, query, key):
    """Where a query may attend: bool broadcastable to [B, N, T, S], or None."""
    valid = None
    if paddings is not None:
      valid = tf.cast(paddings, tf.float32)[:, tf.newaxis, tf.newaxis, :] < 0.5
    if self.params.causal:
      t, s = query.shape[1], key.shape[1]
      if t is not None and s is not None and t != s:
        raise ValueError(f'{self.path}: causal attention needs as many queries as keys, '
                         f'got {t} and {s}.')
      causal = tf.range(tf.shape(query)[1])[:, tf.newaxis] >= tf.range(tf.shape(key)[1])
      valid = causal if valid is None else tf.logical_and(valid, causal)
    return valid

  def FProp(self, theta, query, key=None, value=None, paddings=None):
    """Attends from query [B, T, D] to key and value [B, S, D].

    Args:
      theta: this layer's theta.
      query: [B, T, input_dim].
      key: [B, S, input_dim]; None means query (self-attention).
      value: [B, S, input_dim]; None means key.
      paddings: [B, S], 1.0 at padded key positions, which get no attention;
        None means no padding.

    Returns:
      [B, T, input_dim].
    """
    query = self.ToFPropDtype(query)
    key = query if key is None else self.ToFPropDtype(key)
    value = key if value is None else self.ToFPropDtype(value)
    q = self._SplitHeads(self.query_proj.FProp(theta.query_proj, query))
    k = self._SplitHeads(self.key_proj.FProp(theta.key_proj, key))
    v = self._SplitHeads(self.value_proj.FProp(theta.value_proj, value))
    q *= tf.cast(self._head_dim ** -0.5, q.dtype)
    logits = tf.cast(tf.einsum('btnh,bsnh->bnts', q, k), tf.float32)
    valid = self._ValidMask(paddings, query, key)
    if valid is not None:
      logits = tf.where(valid, logits, _LargeNegative(logits.dtype))
    probs = tf.cast(tf.nn.softmax(logits), q.dtype)
    probs = self.atten_dropout.FProp(theta.atten_dropout, probs)
    context = tf.einsum('bnts,bsnh->btnh', probs, v)
    context = tf.reshape(context, tf.concat([tf.shape(context)[:-2], [_HiddenDim(self.params)]],
                                            axis=0))
    return self.post_proj.FProp(theta.post_proj, context)

  @classmethod
  def FPropMeta(cls, params, query_shape, key_shape=None, value_shape=None,
                paddings_shape=None):
    del value_shape, paddings_shape  # value has key's shape; masking is not counted.
    query = _AsShape(query_shape)
    key = query if key_shape is None else _AsShape(key_shape)
    batch, t, s = query[0], query[1], key[1]
    hidden = _HiddenDim(params)
    proj = cls._ProjectionParams(params)
    flops = (_MetaOf(proj['query_proj'], query).flops +
             _MetaOf(proj['key_proj'], key).flops +
             _MetaOf(proj['value_proj'], key).flops +
             _MetaOf(proj['post_proj'], [batch, t, hidden]).flops)
    probs_shape = [batch, params.num_heads, t, s]
    flops += 2 * 2 * batch * t * s * hidden  # Logits and context einsums.
    flops += _SOFTMAX_FLOPS * _NumElements(probs_shape)
    flops += _MetaOf(_DropoutParams(params.atten_dropout_prob), probs_shape).flops
    return _Meta(flops, query)


class TransformerAttentionLayer(base_layer.BaseLayer):
  """Pre-layer-norm attention block: x + dropout(Attention(LN(x), source))."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of inputs and outputs.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', None, 'Total depth of all heads; None means input_dim.')
    p.Define('is_masked', False, 'Causal self-attention: position t sees positions <= t.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout probability of the attention weights.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout probability of the block output.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    return {
        'layer_norm': LayerNorm.Params().Set(input_dim=p.input_dim),
        'atten': MultiHeadedAttention.Params().Set(
            input_dim=p.input_dim, hidden_dim=p.hidden_dim, num_heads=p.num_heads,
            causal=p.is_masked, atten_dropout_prob=p.atten_dropout_prob),
        'residual_dropout': _DropoutParams(p.residual_dropout_prob),
    }

  def __init__(self, params):
    super().__init__(params)
    _CheckDropoutProbs(self, 'residual_dropout_prob')
    CreateNamedChildren(self, self._ChildParams(self.params))

  def FProp(self, theta, query, paddings=None, source_vecs=None):
    """Self-attention of query [B, T, D], or cross-attention to source_vecs [B, S, D].

    Args:
      theta: this layer's theta.
      query: [B, T, input_dim].
      paddings: paddings of the keys, 1.0 where padded: [B, T] of query itself
        for self-attention, else [B, S] of source_vecs; None means no padding.
      source_vecs: [B, S, input_dim] to attend to (used as they are, not
        normalized); None means self-attention.

    Returns:
      [B, T, input_dim].
    """
    x = self.ToFPropDtype(query)
    normed = self.layer_norm.FProp(theta.layer_norm, x)
    source = normed if source_vecs is None else source_vecs
    out = self.atten.FProp(theta.atten, normed, source, source, paddings)
    return x + self.residual_dropout.FProp(theta.residual_dropout, out)

  @classmethod
  def FPropMeta(cls, params, query_shape, paddings_shape=None, source_shape=None):
    del paddings_shape  # Masking is not counted.
    children = cls._ChildParams(params)
    source = query_shape if source_shape is None else source_shape
    flops = (_MetaOf(children['layer_norm'], query_shape).flops +
             _MetaOf(children['atten'], query_shape, source).flops +
             _MetaOf(children['residual_dropout'], query_shape).flops +
             _NumElements(query_shape))  # The residual sum.
    return _Meta(flops, query_shape)


class TransformerFeedForwardLayer(base_layer.BaseLayer):
  """Pre-layer-norm feed-forward block: x + dropout(W2 dropout(act(W1 LN(x))))."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of inputs and outputs.')
    p.Define('hidden_dim', 0, 'Depth of the hidden layer.')
    p.Define('activation', 'RELU', f'Hidden activation, one of {list(_ACTIVATIONS)}.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout probability of the block output.')
    p.Define('relu_dropout_prob', 0.0, 'Dropout probability of the hidden activations.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """The children in the order the residual branch runs them."""
    return {
        'layer_norm': LayerNorm.Params().Set(input_dim=p.input_dim),
        'fc1': ProjectionLayer.Params().Set(input_dim=p.input_dim, output_dim=p.hidden_dim,
                                            activation=p.activation),
        'relu_dropout': _DropoutParams(p.relu_dropout_prob),
        'fc2': ProjectionLayer.Params().Set(input_dim=p.hidden_dim, output_dim=p.input_dim),
        'residual_dropout': _DropoutParams(p.residual_dropout_prob),
    }

  def __init__(self, params):
    super().__init__(params)
    _CheckDropoutProbs(self, 'residual_dropout_prob', 'relu_dropout_prob')
    CreateNamedChildren(self, self._ChildParams(self.params))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., input_dim]."""
    x = self.ToFPropDtype(inputs)
    h = self.fc1.FProp(theta.fc1, self.layer_norm.FProp(theta.layer_norm, x))
    h = self.fc2.FProp(theta.fc2, self.relu_dropout.FProp(theta.relu_dropout, h))
    return x + self.residual_dropout.FProp(theta.residual_dropout, h)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    branch = _ChainedMeta(cls._ChildParams(params).values(), input_shape)
    return _Meta(branch.flops + _NumElements(input_shape), input_shape)


class TransformerLayer(base_layer.BaseLayer):
  """Pre-layer-norm Transformer layer.

  x = x + SelfAtten(LN(x)); with has_aux_atten, x = x + CrossAtten(LN(x), aux);
  then x = x + FF(LN(x)).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of inputs and outputs.')
    p.Define('num_heads', 1, 'Number of attention heads.')
    p.Define('hidden_dim', 0, 'Depth of the feed-forward hidden layer.')
    p.Define('activation', 'RELU',
             f'Feed-forward hidden activation, one of {list(_ACTIVATIONS)}.')
    p.Define('mask_self_atten', False, 'Causal self-attention, as in a decoder.')
    p.Define('has_aux_atten', False, 'Whether to attend to aux_vecs (an encoder output).')
    p.Define('residual_dropout_prob', 0.0, 'Dropout probability of each block output.')
    p.Define('atten_dropout_prob', 0.0, 'Dropout probability of attention weights.')
    p.Define('relu_dropout_prob', 0.0, 'Dropout probability of feed-forward activations.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    atten = TransformerAttentionLayer.Params().Set(
        input_dim=p.input_dim, num_heads=p.num_heads, atten_dropout_prob=p.atten_dropout_prob,
        residual_dropout_prob=p.residual_dropout_prob)
    children = {'self_atten': atten.Copy().Set(is_masked=p.mask_self_atten)}
    if p.has_aux_atten:
      children['aux_atten'] = atten
    children['ff'] = TransformerFeedForwardLayer.Params().Set(
        input_dim=p.input_dim, hidden_dim=p.hidden_dim, activation=p.activation,
        residual_dropout_prob=p.residual_dropout_prob, relu_dropout_prob=p.relu_dropout_prob)
    return children

  def __init__(self, params):
    super().__init__(params)
    CreateNamedChildren(self, self._ChildParams(self.params))

  def FProp(self, theta, inputs, paddings=None, aux_vecs=None, aux_paddings=None):
    """One layer over inputs [B, T, D].

    Args:
      theta: this layer's theta.
      inputs: [B, T, input_dim].
      paddings: [B, T], 1.0 at padded positions; None means no padding. Padded
        positions' outputs are arbitrary but never affect the others.
      aux_vecs: [B, S, input_dim] to cross-attend to; required exactly when
        has_aux_atten.
      aux_paddings: [B, S] paddings of aux_vecs, or None.

    Returns:
      [B, T, input_dim].
    """
    p = self.params
    if (aux_vecs is not None) != p.has_aux_atten:
      raise ValueError(f'{self.path}: has_aux_atten={p.has_aux_atten} but aux_vecs is '
                       f'{"None" if aux_vecs is None else "given"}.')
    x = self.self_atten.FProp(theta.self_atten, inputs, paddings)
    if p.has_aux_atten:
      x = self.aux_atten.FProp(theta.aux_atten, x, aux_paddings, aux_vecs)
    return self.ff.FProp(theta.ff, x)

  @classmethod
  def FPropMeta(cls, params, inputs_shape, paddings_shape=None, aux_shape=None,
                aux_paddings_shape=None):
    del paddings_shape, aux_paddings_shape  # Masking is not counted.
    children = cls._ChildParams(params)
    flops = (_MetaOf(children['self_atten'], inputs_shape).flops +
             _MetaOf(children['ff'], inputs_shape).flops)
    if params.has_aux_atten:
      flops += _MetaOf(children['aux_atten'], inputs_shape, None, aux_shape).flops
    return _Meta(flops, inputs_shape)


class SequentialLayer(base_layer.BaseLayer):
  """Runs sub-layers in order; a tuple output is passed on as the next one's *args.

  remat_policy re-materializes inside the stack (core/remat.py): e.g.
  'every_2' keeps every second layer's output for the backward and recomputes
  the rest, segment by segment, with tf.recompute_grad.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'Params of the sub-layers, in the order they run.')
    p.Define('remat_policy', remat.NONE,
             "Which sub-layer outputs the forward keeps for the backward (core/remat.py): "
             "'none' (all activations), 'every_layer', 'every_N' (e.g. 'every_2') or layer "
             "names joined by '+'; the rest is recomputed in the backward.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if not self.params.sub:
      raise ValueError(f'{self.path}: SequentialLayer needs at least one sub-layer.')
    self.CreateChildren('sub', self.params.sub)
    self._segments = remat.StageSegments(
        self.params.remat_policy, [layer.params.name for layer in self.sub], where=self.path)

  def _RunLayers(self, start, end, theta_list, args, names):
    """(output, NestedMap of the outputs of `names`) of sub-layers start..end-1."""
    fetched = py_utils.NestedMap()
    for layer, layer_theta in zip(self.sub[start:end], theta_list):
      out = layer.FProp(layer_theta, *args)
      if layer.params.name in names:
        fetched[layer.params.name] = out
      args = out if isinstance(out, tuple) else (out,)
    return out, fetched

  def FPropAndOutputs(self, theta, args, names=()):
    """(the last sub-layer's output, NestedMap of the outputs of the sub-layers `names`)."""
    run = functools.partial(self._RunLayers, names=names)
    if not self._segments:
      return run(0, len(self.sub), theta.sub, args)
    return remat.RunSegments(run, theta.sub, args, self._segments, self.TrainingStep)

  def FProp(self, theta, *args):
    """The last sub-layer's output."""
    return self.FPropAndOutputs(theta, args)[0]

  @classmethod
  def FPropMeta(cls, params, *input_shapes):
    return _ChainedMeta(params.sub, *input_shapes)


class Conv2DLayer(base_layer.BaseLayer):
  """2-D convolution over NHWC inputs, then bias and activation."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('filter_shape', None, '[height, width, in_channels, out_channels].')
    p.Define('filter_stride', (1, 1), '[height stride, width stride].')
    p.Define('padding', 'SAME', f'One of {list(_PADDINGS)}.')
    p.Define('has_bias', True, 'Whether to add a learned bias per output channel.')
    p.Define('activation', 'NONE', f'Activation applied last, one of {list(_ACTIVATIONS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckShape(self, 'filter_shape', p.filter_shape, 4)
    _CheckShape(self, 'filter_stride', p.filter_stride, 2)
    _CheckChoice(self, 'padding', p.padding, _PADDINGS)
    _CheckChoice(self, 'activation', p.activation, _ACTIVATIONS)
    self.CreateVariable('w', py_utils.WeightParams(p.filter_shape))
    if p.has_bias:
      self.CreateVariable('b', py_utils.WeightParams([p.filter_shape[-1]],
                                                     py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[B, H, W, in_channels] -> [B, H', W', out_channels]."""
    p = self.params
    theta = self.ToFPropDtype(theta)
    x = self.ToFPropDtype(inputs)
    y = tf.nn.conv2d(x, theta.w, strides=[1, *p.filter_stride, 1], padding=p.padding)
    return _BiasAndActivation(y, theta, p)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    fh, fw, cin, cout = params.filter_shape
    out = _WindowOutputShape(input_shape, (fh, fw), params.filter_stride, params.padding, cout)
    flops = 2 * _NumElements(out) * fh * fw * cin
    return _Meta(flops + _BiasAndActivationFlops(params, _NumElements(out)), out)


class PoolingLayer(base_layer.BaseLayer):
  """Max or average pooling over the spatial dimensions of NHWC inputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('window_shape', (2, 2), '[height, width] of the pooling window.')
    p.Define('window_stride', (2, 2), '[height stride, width stride].')
    p.Define('pooling_type', 'MAX', f'One of {list(_POOLING_TYPES)}.')
    p.Define('padding', 'VALID', f'One of {list(_PADDINGS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckShape(self, 'window_shape', p.window_shape, 2)
    _CheckShape(self, 'window_stride', p.window_stride, 2)
    _CheckChoice(self, 'pooling_type', p.pooling_type, _POOLING_TYPES)
    _CheckChoice(self, 'padding', p.padding, _PADDINGS)

  def FProp(self, theta, inputs):
    """[B, H, W, C] -> [B, H', W', C]."""
    del theta  # No variables.
    p = self.params
    return tf.nn.pool(self.ToFPropDtype(inputs), p.window_shape, p.pooling_type,
                      strides=p.window_stride, padding=p.padding)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    depth = _AsShape(input_shape)[-1]
    out = _WindowOutputShape(input_shape, params.window_shape, params.window_stride,
                             params.padding, depth)
    window = params.window_shape[0] * params.window_shape[1]
    return _Meta(_NumElements(out) * window, out)


class GlobalPoolingLayer(base_layer.BaseLayer):
  """Averages NHWC inputs over height and width: [B, H, W, C] -> [B, C]."""

  def FProp(self, theta, inputs):
    del theta  # No variables.
    return tf.reduce_mean(self.ToFPropDtype(inputs), axis=[1, 2])

  @classmethod
  def FPropMeta(cls, params, input_shape):
    shape = _AsShape(input_shape)
    return _Meta(_NumElements(shape), [shape[0], shape[-1]])


class BatchNormLayer(base_layer.BaseLayer):
  """Batch normalization over all but the last dimension.

  Training normalizes with the batch's statistics and records them
  (RecordUpdate); the moving averages follow the combined statistics of a whole
  step's micro-batches, exactly as if the batch had not been split. Eval
  normalizes with the moving averages.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('decay', 0.999, 'moving = decay * moving + (1 - decay) * batch statistic.')
    p.Define('epsilon', 1e-3, 'Added to the variance so constant inputs do not divide by 0.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    _CheckPositive(self, dim=p.dim)
    _CheckProb(self, 'decay', p.decay, low_open=False, high_open=False)
    zeros, ones = py_utils.WeightInit.Constant(0.0), py_utils.WeightInit.Constant(1.0)
    self.CreateVariable('beta', py_utils.WeightParams([p.dim], zeros))
    self.CreateVariable('gamma', py_utils.WeightParams([p.dim], ones))
    self.CreateVariable('moving_mean', py_utils.WeightParams([p.dim], zeros, trainable=False))
    self.CreateVariable('moving_variance',
                        py_utils.WeightParams([p.dim], ones, trainable=False))

  def FProp(self, theta, inputs):
    """[..., dim] -> [..., dim]."""
    x32 = tf.cast(inputs, tf.float32)
    if py_utils.CurrentContext().training:
      mean, variance = tf.nn.moments(x32, axes=list(range(x32.shape.rank - 1)))
      count = tf.cast(tf.size(x32) // self.params.dim, tf.float32)
      self.RecordUpdate(tf.nest.map_structure(
          tf.stop_gradient, py_utils.NestedMap(mean=mean, variance=variance, count=count)))
    else:
      mean, variance = theta.moving_mean, theta.moving_variance
    return _Normalize(x32, mean, variance, self.params.epsilon,
                      self.ToFPropDtype(theta.gamma), self.ToFPropDtype(theta.beta))

  def CombineUpdates(self, stats_list):
    """The exact mean and biased variance of the union of the batches."""
    return py_utils.CombineMoments(stats_list)

  def ApplyUpdate(self, stats):
    decay = self.params.decay
    for name, batch_value in (('moving_mean', stats.mean), ('moving_variance', stats.variance)):
      var = self.vars[name]
      var.assign(decay * var + (1.0 - decay) * batch_value)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    return _Meta(_NORM_FLOPS * _NumElements(input_shape), input_shape)
