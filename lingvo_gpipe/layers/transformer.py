"""Multi-headed attention and the Transformer layer built of it (self-attention, optional
cross-attention, feed-forward; pre-layer-norm residual blocks)."""

import tensorflow as tf

from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.layers import basic
from lingvo_gpipe.layers import layer_utils


def _DropoutParams(drop_prob):
  return basic.DropoutLayer.Params().Set(keep_prob=1.0 - drop_prob)


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
    into = basic.ProjectionLayer.Params().Set(input_dim=p.input_dim, output_dim=_HiddenDim(p))
    return {
        'query_proj': into,
        'key_proj': into.Copy(),
        'value_proj': into.Copy(),
        'post_proj': basic.ProjectionLayer.Params().Set(input_dim=_HiddenDim(p),
                                                  output_dim=p.input_dim),
    }

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    layer_utils.CheckPositive(self, input_dim=p.input_dim, hidden_dim=_HiddenDim(p),
                   num_heads=p.num_heads)
    if _HiddenDim(p) % p.num_heads:
      raise ValueError(f'{self.path}: hidden_dim={_HiddenDim(p)} is not divisible by '
                       f'num_heads={p.num_heads}.')
    layer_utils.CheckDropoutProbs(self, 'atten_dropout_prob')
    children = self._ProjectionParams(p)
    children['atten_dropout'] = _DropoutParams(p.atten_dropout_prob)
    layer_utils.CreateNamedChildren(self, children)

  @property
  def _head_dim(self):
    return _HiddenDim(self.params) // self.params.num_heads

  def _SplitHeads(self, x):
    """[B, T, hidden_dim] -> [B, T, num_heads, head_dim]."""
    return tf.reshape(x, layer_utils.LeadingDimsThen(
        x, -1, [self.params.num_heads, self._head_dim]))

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
      t = tf.shape(query)[1] if t is None else t
      s = tf.shape(key)[1] if s is None else s
      causal = tf.range(t)[:, tf.newaxis] >= tf.range(s)
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
      logits = tf.where(valid, logits, layer_utils.LargeNegative(logits.dtype))
    probs = tf.cast(tf.nn.softmax(logits), q.dtype)
    probs = self.atten_dropout.FProp(theta.atten_dropout, probs)
    context = tf.einsum('bnts,bsnh->btnh', probs, v)
    context = tf.reshape(context, layer_utils.LeadingDimsThen(
        context, -2, [_HiddenDim(self.params)]))
    return self.post_proj.FProp(theta.post_proj, context)

  @classmethod
  def FPropMeta(cls, params, query_shape, key_shape=None, value_shape=None,
                paddings_shape=None):
    del value_shape, paddings_shape  # value has key's shape; masking is not counted.
    query = layer_utils.AsShape(query_shape)
    key = query if key_shape is None else layer_utils.AsShape(key_shape)
    batch, t, s = query[0], query[1], key[1]
    hidden = _HiddenDim(params)
    proj = cls._ProjectionParams(params)
    flops = (layer_utils.MetaOf(proj['query_proj'], query).flops +
             layer_utils.MetaOf(proj['key_proj'], key).flops +
             layer_utils.MetaOf(proj['value_proj'], key).flops +
             layer_utils.MetaOf(proj['post_proj'], [batch, t, hidden]).flops)
    probs_shape = [batch, params.num_heads, t, s]
    flops += 2 * 2 * batch * t * s * hidden  # Logits and context einsums.
    flops += layer_utils.SOFTMAX_FLOPS * layer_utils.NumElements(probs_shape)
    flops += layer_utils.MetaOf(_DropoutParams(params.atten_dropout_prob), probs_shape).flops
    return layer_utils.Meta(flops, query)


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
        'layer_norm': basic.LayerNorm.Params().Set(input_dim=p.input_dim),
        'atten': MultiHeadedAttention.Params().Set(
            input_dim=p.input_dim, hidden_dim=p.hidden_dim, num_heads=p.num_heads,
            causal=p.is_masked, atten_dropout_prob=p.atten_dropout_prob),
        'residual_dropout': _DropoutParams(p.residual_dropout_prob),
    }

  def __init__(self, params):
    super().__init__(params)
    layer_utils.CheckDropoutProbs(self, 'residual_dropout_prob')
    layer_utils.CreateNamedChildren(self, self._ChildParams(self.params))

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
    flops = (layer_utils.MetaOf(children['layer_norm'], query_shape).flops +
             layer_utils.MetaOf(children['atten'], query_shape, source).flops +
             layer_utils.MetaOf(children['residual_dropout'], query_shape).flops +
             layer_utils.NumElements(query_shape))  # The residual sum.
    return layer_utils.Meta(flops, query_shape)


class TransformerFeedForwardLayer(base_layer.BaseLayer):
  """Pre-layer-norm feed-forward block: x + dropout(W2 dropout(act(W1 LN(x))))."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of inputs and outputs.')
    p.Define('hidden_dim', 0, 'Depth of the hidden layer.')
    p.Define('activation', 'RELU', f'Hidden activation, one of {list(layer_utils.ACTIVATIONS)}.')
    p.Define('residual_dropout_prob', 0.0, 'Dropout probability of the block output.')
    p.Define('relu_dropout_prob', 0.0, 'Dropout probability of the hidden activations.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    """The children in the order the residual branch runs them."""
    return {
        'layer_norm': basic.LayerNorm.Params().Set(input_dim=p.input_dim),
        'fc1': basic.ProjectionLayer.Params().Set(input_dim=p.input_dim, output_dim=p.hidden_dim,
                                            activation=p.activation),
        'relu_dropout': _DropoutParams(p.relu_dropout_prob),
        'fc2': basic.ProjectionLayer.Params().Set(input_dim=p.hidden_dim, output_dim=p.input_dim),
        'residual_dropout': _DropoutParams(p.residual_dropout_prob),
    }

  def __init__(self, params):
    super().__init__(params)
    layer_utils.CheckDropoutProbs(self, 'residual_dropout_prob', 'relu_dropout_prob')
    layer_utils.CreateNamedChildren(self, self._ChildParams(self.params))

  def FProp(self, theta, inputs):
    """[..., input_dim] -> [..., input_dim]."""
    x = self.ToFPropDtype(inputs)
    h = self.fc1.FProp(theta.fc1, self.layer_norm.FProp(theta.layer_norm, x))
    h = self.fc2.FProp(theta.fc2, self.relu_dropout.FProp(theta.relu_dropout, h))
    return x + self.residual_dropout.FProp(theta.residual_dropout, h)

  @classmethod
  def FPropMeta(cls, params, input_shape):
    branch = layer_utils.ChainedMeta(cls._ChildParams(params).values(), input_shape)
    return layer_utils.Meta(branch.flops + layer_utils.NumElements(input_shape), input_shape)


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
             f'Feed-forward hidden activation, one of {list(layer_utils.ACTIVATIONS)}.')
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
    layer_utils.CreateNamedChildren(self, self._ChildParams(self.params))

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
    flops = (layer_utils.MetaOf(children['self_atten'], inputs_shape).flops +
             layer_utils.MetaOf(children['ff'], inputs_shape).flops)
    if params.has_aux_atten:
      flops += layer_utils.MetaOf(children['aux_atten'], inputs_shape, None, aux_shape).flops
    return layer_utils.Meta(flops, inputs_shape)
