"""Basic layers: projection, layer norm, embeddings, softmax, dropout and the sequential stack.

Every FProp is a pure function of theta, its inputs and the FProp context (training flag,
step and micro-batch for dropout), so a pipeline may recompute any layer on any device and
get the same numbers. Activations run in `fprop_dtype`; moments, softmax and cross entropy
are computed in float32 and cast back. Leaf layers cast theta to `fprop_dtype` where they
use it; composite layers leave that to their children.
"""

import functools
import math

import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import layer_utils
from lingvo_gpipe.layers import remat


class ProjectionLayer(base_layer.BaseLayer):
  """Fully connected: act(x @ w + b) over the last dimension of inputs of any rank."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the inputs (their last dimension).')
    p.Define('output_dim', 0, 'Depth of the outputs.')
    p.Define('has_bias', True, 'Whether to add a learned bias.')
    p.Define('activation', 'NONE',
             f'Activation applied last, one of {list(layer_utils.ACTIVATIONS)}.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_utils.CheckPositive(self, input_dim=p.input_dim, output_dim=p.output_dim)
    layer_utils.CheckChoice(self, 'activation', p.activation, layer_utils.ACTIVATIONS)
    self.CreateVariable('w', py_utils.WeightParams([p.input_dim, p.output_dim]))
    if p.has_bias:
      self.CreateVariable('b', py_utils.WeightParams([p.output_dim],
                                                     py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., output_dim]."""
    theta = self.ToFPropDtype(theta)
    x = self.ToFPropDtype(inputs)
    y = layer_utils.LastDimMatMul(x, theta.w, self.params.input_dim, self.params.output_dim)
    return layer_utils.BiasAndActivation(y, theta, self.params)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    shape = layer_utils.AsShape(input_shape)
    out = shape[:-1].concatenate([params.output_dim])
    rows = layer_utils.NumElements(shape[:-1])
    flops = 2 * rows * params.input_dim * params.output_dim
    return layer_utils.MetaWithBiasAndActivation(params, flops, out)


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
    layer_utils.CheckPositive(self, input_dim=p.input_dim)
    self.CreateVariable('scale', py_utils.WeightParams([p.input_dim],
                                                       py_utils.WeightInit.Constant(1.0)))
    self.CreateVariable('bias', py_utils.WeightParams([p.input_dim],
                                                      py_utils.WeightInit.Constant(0.0)))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., input_dim]; moments in float32 for stability."""
    theta = self.ToFPropDtype(theta)
    x32 = tf.cast(inputs, tf.float32)
    mean, variance = tf.nn.moments(x32, axes=[-1], keepdims=True)
    return layer_utils.Normalize(x32, mean, variance, self.params.epsilon, theta.scale, theta.bias)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    return layer_utils.Meta(layer_utils.NORM_FLOPS * layer_utils.NumElements(input_shape),
                            input_shape)


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
    layer_utils.CheckPositive(self, vocab_size=p.vocab_size, embedding_dim=p.embedding_dim)
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
    out = layer_utils.AsShape(ids_shape).concatenate([params.embedding_dim])
    return layer_utils.Meta(layer_utils.NumElements(out), out)


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
    layer_utils.CheckPositive(self, embedding_dim=p.embedding_dim, max_len=p.max_len)
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
    layer_utils.CheckPositive(self, input_dim=p.input_dim, num_classes=p.num_classes)
    layer_utils.CheckProb(self, 'label_smoothing', p.label_smoothing, low_open=False,
                          high_open=True)
    layer_utils.CreateNamedChildren(self, {'proj': self._ProjectionParams(p)})

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
        avg_xent=total_xent / tf.maximum(total_weight, layer_utils.TINY_WEIGHT))

  @classmethod
  def FPropMeta(cls, params, inputs_shape, class_ids_shape=None, class_weights_shape=None):
    del class_ids_shape, class_weights_shape  # Implied by inputs_shape.
    logits = layer_utils.MetaOf(cls._ProjectionParams(params), inputs_shape)
    logits_shape = logits.out_shapes[0]
    examples = logits_shape[:-1]
    # Softmax, then smoothing the targets and their product with log_probs.
    flops = logits.flops + (layer_utils.SOFTMAX_FLOPS + 3) * layer_utils.NumElements(logits_shape)
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
    layer_utils.CheckProb(self, 'keep_prob', self.params.keep_prob, low_open=True, high_open=False)

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
    per_element = 0 if params.keep_prob == 1.0 else layer_utils.DROPOUT_FLOPS
    return layer_utils.Meta(per_element * layer_utils.NumElements(input_shape), input_shape)


class SequentialLayer(base_layer.BaseLayer):
  """Runs sub-layers in order; a tuple output is passed on as the next one's *args.

  remat_policy re-materializes inside the stack (lingvo_gpipe/layers/remat.py): e.g.
  'every_2' keeps every second layer's output for the backward and recomputes
  the rest, segment by segment, under remat.py's own custom gradient.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('sub', [], 'Params of the sub-layers, in the order they run.')
    p.Define('remat_policy', remat.NONE,
             "Which sub-layer outputs the forward keeps for the backward "
             "(lingvo_gpipe/layers/remat.py): 'none' (all activations), 'every_layer', "
             "'every_N' (e.g. 'every_2') or layer names joined by '+'; the rest is recomputed "
             "in the backward.")
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
    return layer_utils.ChainedMeta(params.sub, *input_shapes)
