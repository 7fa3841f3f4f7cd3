"""The layers of a GPipe stack's state: embedding, Transformer, softmax, conv block.

Every layer of a stack (layers_with_gpipe.py) takes and returns one NestedMap,
the *state*, holding one sub-map per *stream*:

  src: ids [B, S] int32, paddings [B, S] (1.0 where padded), and once embedded
       vecs [B, S, D] in place of the ids: the encoder's sequence.
  tgt: ids, labels [B, T] int32, paddings, weights [B, T], and vecs: the
       decoder's (or language model's) sequence.
  image: vecs [B, H, W, C], labels [B] int32, weights [B].

A layer changes only the fields of its own stream and passes the rest through,
so the encoder output (src.vecs) travels through every stage to the decoder
layers that attend to it, wherever the split falls. The softmax, the last layer,
replaces the state with per-example results that a task reduces to metrics:

  xent (label-smoothed cross entropy, the trained loss), nll (-log p(label), for
  log-perplexity), argmax (int32), labels, weights; all [B, T] (or [B]).

A decoding step (lingvo_gpipe.models.decoder) gives the stream decode_positions [B]
int32 instead of labels: the softmax then returns log_probs [B, num_classes],
each row's next-id log-probabilities at its position.

Every tensor of the state has the batch as dimension 0, as the pipeline splits
all of them into micro-batches.

Apart from the stacks, which only choose and cut these layers: a layer here is
built, tested and reused (an unpipelined reference) on its own.
"""

import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import base_layer
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import layer_utils


def _WithFields(state, stream, drop=(), **fields):
  """A copy of `state` whose sub-map `stream` has `fields` set and the keys `drop` removed."""
  out = py_utils.NestedMap(state)
  out[stream] = py_utils.NestedMap(state[stream], **fields)
  for key in drop:
    del out[stream][key]
  return out


def _Meta(flops, state_spec):
  return py_utils.NestedMap(flops=int(flops), out_shapes=(state_spec,))


def Spec(shape, dtype=tf.float32) -> tf.TensorSpec:
  """A TensorSpec of `shape`, as the state's FLOP counting takes it."""
  return tf.TensorSpec(tf.TensorShape(shape), dtype)


def _ShapeOf(spec):
  return tf.TensorShape(getattr(spec, 'shape', spec))


class GPipeEmbeddingLayer(base_layer.BaseLayer):
  """Embeds stream.ids into stream.vecs: dropout(emb * sqrt(D) + position).

  The ids leave the state here: no later layer reads them, and carried on they would be
  handed through every stage after this one.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stream', 'tgt', "The state's sub-map whose ids are embedded: 'src' or 'tgt'.")
    p.Define('vocab_size', 0, 'Number of distinct ids.')
    p.Define('embedding_dim', 0, 'Depth of the embeddings (the model dimension).')
    p.Define('max_len', 256, 'Length of the position table: the longest sequence accepted.')
    p.Define('dropout_prob', 0.0, 'Dropout probability of the embeddings.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    return {
        'emb': layers.EmbeddingLayer.Params().Set(
            vocab_size=p.vocab_size, embedding_dim=p.embedding_dim, scale_sqrt_depth=True),
        'pos': layers.PositionalEmbeddingLayer.Params().Set(
            embedding_dim=p.embedding_dim, max_len=p.max_len),
        'dropout': layers.DropoutLayer.Params().Set(keep_prob=1.0 - p.dropout_prob),
    }

  def __init__(self, params):
    super().__init__(params)
    layer_utils.CreateNamedChildren(self, self._ChildParams(self.params))

  def FProp(self, theta, state):
    ids = state[self.params.stream].ids
    vecs = self.emb.EmbLookup(theta.emb, ids)
    length = ids.shape[1] if ids.shape[1] is not None else tf.shape(ids)[1]
    vecs += self.pos.FProp(theta.pos, length)
    vecs = self.dropout.FProp(theta.dropout, vecs)
    return _WithFields(state, self.params.stream, drop=['ids'], vecs=vecs)

  @classmethod
  def FPropMeta(cls, params, state_spec):
    ids = _ShapeOf(state_spec[params.stream].ids)
    children = cls._ChildParams(params)
    vecs = ids.concatenate([params.embedding_dim])
    flops = (children['emb'].cls.FPropMeta(children['emb'], ids).flops +
             2 * vecs.num_elements() +  # Position table and the sum.
             children['dropout'].cls.FPropMeta(children['dropout'], vecs).flops)
    return _Meta(flops, _WithFields(state_spec, params.stream, drop=['ids'], vecs=Spec(vecs)))


class GPipeTransformerLayer(layers.TransformerLayer):
  """A TransformerLayer over stream.vecs, cross-attending to aux_stream.vecs if asked."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stream', 'tgt', "The state's sub-map this layer transforms: 'src' or 'tgt'.")
    p.Define('aux_stream', 'src', 'The sub-map attended to when has_aux_atten (the encoder).')
    p.Define('final_layer_norm', False,
             'Normalize the output: the last layer of a pre-layer-norm stack must.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    children = super()._ChildParams(p)
    if p.final_layer_norm:
      children['final_layer_norm'] = layers.LayerNorm.Params().Set(input_dim=p.input_dim)
    return children

  def FProp(self, theta, state):  # pylint: disable=arguments-differ
    p = self.params
    seq = state[p.stream]
    aux_vecs = aux_paddings = None
    if p.has_aux_atten:
      aux_vecs, aux_paddings = state[p.aux_stream].vecs, state[p.aux_stream].paddings
    vecs = super().FProp(theta, seq.vecs, seq.paddings, aux_vecs, aux_paddings)
    if p.final_layer_norm:
      vecs = self.final_layer_norm.FProp(theta.final_layer_norm, vecs)
    return _WithFields(state, p.stream, vecs=vecs)

  @classmethod
  def FPropMeta(cls, params, state_spec):  # pylint: disable=arguments-differ
    vecs = _ShapeOf(state_spec[params.stream].vecs)
    aux = _ShapeOf(state_spec[params.aux_stream].vecs) if params.has_aux_atten else None
    flops = super().FPropMeta(params, vecs, None, aux).flops
    if params.final_layer_norm:
      norm = cls._ChildParams(params)['final_layer_norm']
      flops += norm.cls.FPropMeta(norm, vecs).flops
    return _Meta(flops, state_spec)


class SharedEmbeddingProjection(base_layer.BaseLayer):
  """Logits against an embedding table shared with an input embedding: x @ emb^T + b.

  The table is not created here: ShareTable attaches the embedding layer's own
  tf.Variable, so both layers train one weight even on different stages.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_dim', 0, 'Depth of the inputs: the embedding depth.')
    p.Define('output_dim', 0, 'Number of classes: the embedding vocabulary size.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    self.CreateVariable('b', py_utils.WeightParams([p.output_dim],
                                                   py_utils.WeightInit.Constant(0.0)))

  def ShareTable(self, table):
    """Adopts `table`, a [output_dim, input_dim] tf.Variable, as this layer's `emb`."""
    p = self.params
    if table.shape.as_list() != [p.output_dim, p.input_dim]:
      raise ValueError(f'{self.path}: cannot share an embedding table of shape '
                       f'{table.shape.as_list()}; expected [num_classes, input_dim] = '
                       f'{[p.output_dim, p.input_dim]}.')
    self.AddSharedVariable('emb', table)

  def FProp(self, theta, inputs):
    if 'emb' not in theta:
      raise ValueError(f'{self.path}: no embedding table is shared yet; call ShareTable.')
    p = self.params
    theta = self.ToFPropDtype(theta)
    x = self.ToFPropDtype(inputs)
    return layer_utils.LastDimMatMul(x, theta.emb, p.input_dim, p.output_dim,
                                     transpose_b=True) + theta.b

  @classmethod
  def FPropMeta(cls, params, input_shape):
    projection = layers.ProjectionLayer.Params().Set(input_dim=params.input_dim,
                                                     output_dim=params.output_dim)
    return projection.cls.FPropMeta(projection, input_shape)


class TiedSoftmax(layers.SimpleFullSoftmax):
  """SimpleFullSoftmax whose weights are an input embedding's table (see ShareTable)."""

  @classmethod
  def _ProjectionParams(cls, p):
    return SharedEmbeddingProjection.Params().Set(input_dim=p.input_dim,
                                                  output_dim=p.num_classes)


class GPipeSoftmaxLayer(base_layer.BaseLayer):
  """Cross entropy of stream.vecs against stream.labels: the stack's last layer.

  Returns the per-example NestedMap described in the module docstring instead
  of the state, so only small tensors leave the pipeline.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stream', 'tgt', "The state's sub-map with vecs, labels and weights.")
    p.Define('input_dim', 0, 'Depth of the vectors (the model dimension).')
    p.Define('num_classes', 0, 'Number of classes (the output vocabulary size).')
    p.Define('label_smoothing', 0.0, 'Label smoothing of the trained cross entropy, in [0, 1).')
    p.Define('global_pool', False,
             'Average [B, H, W, C] vectors over H and W first, as image classifiers do.')
    p.Define('tie_embedding', False,
             'Use the input embedding table as weights (ShareEmbedding attaches it).')
    return p

  @classmethod
  def _ChildParams(cls, p):
    softmax_cls = TiedSoftmax if p.tie_embedding else layers.SimpleFullSoftmax
    children = {'softmax': softmax_cls.Params().Set(
        input_dim=p.input_dim, num_classes=p.num_classes, label_smoothing=p.label_smoothing)}
    if p.global_pool:
      children['pool'] = layers.GlobalPoolingLayer.Params()
    return children

  def __init__(self, params):
    super().__init__(params)
    layer_utils.CreateNamedChildren(self, self._ChildParams(self.params))

  def ShareEmbedding(self, embedding_layer):
    """Ties the softmax weights to `embedding_layer`'s (a GPipeEmbeddingLayer) table."""
    if not self.params.tie_embedding:
      raise ValueError(f'{self.path}: tie_embedding is False; nothing to share.')
    self.softmax.proj.ShareTable(embedding_layer.emb.vars.emb)

  def FProp(self, theta, state):
    p = self.params
    seq = state[p.stream]
    vecs = self.pool.FProp(theta.pool, seq.vecs) if p.global_pool else seq.vecs
    if 'decode_positions' in seq:
      return py_utils.NestedMap(log_probs=self._NextLogProbs(theta, vecs, seq.decode_positions))
    out = self.softmax.FProp(theta.softmax, vecs, seq.labels, seq.weights)
    nll = -tf.gather(out.log_probs, seq.labels, batch_dims=seq.labels.shape.rank)
    return py_utils.NestedMap(xent=out.per_example_xent, nll=nll, argmax=out.per_example_argmax,
                              labels=seq.labels, weights=tf.cast(seq.weights, tf.float32))

  def _NextLogProbs(self, theta, vecs, positions):
    """log p(next id) [B, num_classes] in float32 at each row's position of vecs [B, T, D]:
    a decoding step needs one position per row, so only those are projected."""
    at = tf.gather(vecs, positions, batch_dims=1)
    return tf.nn.log_softmax(tf.cast(self.softmax.Logits(theta.softmax, at), tf.float32))

  @classmethod
  def FPropMeta(cls, params, state_spec):
    children = cls._ChildParams(params)
    seq = state_spec[params.stream]
    vecs, flops = _ShapeOf(seq.vecs), 0
    if params.global_pool:
      pool = children['pool'].cls.FPropMeta(children['pool'], vecs)
      vecs, flops = pool.out_shapes[0], pool.flops
    flops += children['softmax'].cls.FPropMeta(children['softmax'], vecs).flops
    labels = _ShapeOf(seq.labels)
    return _Meta(flops, py_utils.NestedMap(
        xent=Spec(labels), nll=Spec(labels), argmax=Spec(labels, tf.int32),
        labels=Spec(labels, tf.int32), weights=Spec(labels)))


class GPipeConvBlock(base_layer.BaseLayer):
  """Conv-BN-ReLU, or with `residual` a ResNet basic block on image.vecs.

  Residual: relu(BN(conv3x3(relu(BN(conv3x3(x))))) + shortcut(x)), the shortcut
  being a strided 1x1 conv with BN when the shape changes, else the identity.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stream', 'image', "The state's sub-map holding the images' vecs.")
    p.Define('in_channels', 0, 'Channels of the input.')
    p.Define('out_channels', 0, 'Channels of the output.')
    p.Define('stride', 1, 'Stride of the first convolution (and of the shortcut).')
    p.Define('residual', True, 'A residual basic block; False is a single conv-BN-ReLU.')
    p.Define('bn_decay', 0.99, 'Decay of the batch-norm moving statistics.')
    return p

  @classmethod
  def _ChildParams(cls, p):
    def Conv(size, cin, stride):
      return layers.Conv2DLayer.Params().Set(
          filter_shape=[size, size, cin, p.out_channels], filter_stride=(stride, stride),
          has_bias=False)

    def Norm():
      return layers.BatchNormLayer.Params().Set(dim=p.out_channels, decay=p.bn_decay)

    children = {'conv1': Conv(3, p.in_channels, p.stride), 'bn1': Norm()}
    if p.residual:
      children.update(conv2=Conv(3, p.out_channels, 1), bn2=Norm())
      if cls._HasProjection(p):
        children.update(shortcut=Conv(1, p.in_channels, p.stride), shortcut_bn=Norm())
    return children

  @staticmethod
  def _HasProjection(p):
    return p.stride != 1 or p.in_channels != p.out_channels

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if not (isinstance(p.stride, int) and p.stride > 0):
      raise ValueError(f'{self.path}: stride must be a positive int, got {p.stride!r}.')
    layer_utils.CreateNamedChildren(self, self._ChildParams(p))

  def FProp(self, theta, state):
    p = self.params
    x = state[p.stream].vecs
    y = self.bn1.FProp(theta.bn1, self.conv1.FProp(theta.conv1, x))
    if p.residual:
      y = self.bn2.FProp(theta.bn2, self.conv2.FProp(theta.conv2, tf.nn.relu(y)))
      if self._HasProjection(p):
        x = self.shortcut_bn.FProp(theta.shortcut_bn, self.shortcut.FProp(theta.shortcut, x))
      y += x
    return _WithFields(state, p.stream, vecs=tf.nn.relu(y))

  @classmethod
  def FPropMeta(cls, params, state_spec):
    x = _ShapeOf(state_spec[params.stream].vecs)
    children = cls._ChildParams(params)

    def Run(names, shape):
      flops = 0
      for name in names:
        meta = children[name].cls.FPropMeta(children[name], shape)
        flops, shape = flops + meta.flops, meta.out_shapes[0]
      return flops, shape

    flops, y = Run(['conv1', 'bn1'], x)
    if params.residual:
      more, y = Run(['conv2', 'bn2'], y)
      flops += more + 2 * y.num_elements()  # ReLU in between and the residual sum.
      if cls._HasProjection(params):
        flops += Run(['shortcut', 'shortcut_bn'], x)[0]
    flops += y.num_elements()  # The last ReLU.
    return _Meta(flops, _WithFields(state_spec, params.stream, vecs=Spec(y)))
