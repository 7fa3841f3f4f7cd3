"""GPipe model stacks: Transformer encoders/decoders and a residual conv net.

A stack is a PipeliningLayer whose cells are cut from a flat list of layers
built from the stack's own params. Every layer of the list (state_layers.py)
takes and returns one NestedMap, the *state*, holding one sub-map per *stream*
(src, tgt, image); the softmax, the last layer, replaces it with per-example
results that a task reduces to metrics.

Example, a 4-stage language model run as 16 micro-batches (tasks.LanguageModelTask
wraps exactly this, with metrics as the loss_fn):

  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=256, num_heads=4, hidden_dim=1024, num_decoder_layers=8,
      max_seq_len=64, splits=4, num_micro_batches=16)
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 256
  stack = p.Instantiate()
  loss, grads = stack.ForwardBackward(stack.theta, NestedMap(tgt=batch), loss_fn)

Initial weights, dropout masks and checkpoint keys depend on each variable's
and layer's path without its cell ('stack/dec3/ff/fc1/w'): the same stack cut
into other stages, micro-batches or replicas is the same model.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.layers import profiler
from lingvo_gpipe.models import state_layers
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import partition


def _CheckPositiveInts(name, **values):
  for key, value in values.items():
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
      raise ValueError(f'{name}: {key} must be a positive int, got {value!r}.')


class _GPipeStack(gpipe.PipeliningLayer):
  """A PipeliningLayer whose cells are cut, by `splits`, from LayerParams(p)."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('splits', 1,
             'Number of cells (balanced by FLOPs; the softmax always shares a cell with the '
             'layer before it), or the ascending end indices of the cells in LayerParams; '
             'num_stages * virtual_stages cells.', kinds=(int, list))
    return p

  @classmethod
  def LayerParams(cls, p):
    """The stack's layers in the order they run; the last one is the softmax."""
    raise NotImplementedError(f'{cls.__name__}.LayerParams')

  @classmethod
  def InputSpec(cls, p):
    """A NestedMap of TensorSpecs of one example's state, for FLOP counting."""
    raise NotImplementedError(f'{cls.__name__}.InputSpec')

  @classmethod
  def StageEnds(cls, p, layer_params):
    """Ascending end indices of the cells, from `splits`."""
    n, splits = len(layer_params), p.splits
    if isinstance(splits, int) and not isinstance(splits, bool):
      if not 1 <= splits <= n - 1:
        raise ValueError(f'{p.name}: splits={splits} cells, but the stack has {n} layers, '
                         f'the softmax sharing a cell: expected 1 <= splits <= {n - 1}.')
      costs = profiler.LayerCosts(layer_params, cls.InputSpec(p))
      costs[-2] += costs.pop()  # The softmax rides with the layer before it.
      return partition.Balance(costs, splits)[:-1] + [n]
    if not isinstance(splits, (list, tuple)):
      raise ValueError(f'{p.name}: splits={splits!r} must be an int number of cells or '
                       'ascending positive end indices of the cells.')
    ends = list(splits)
    partition.CheckEnds(ends, n, f'{p.name}: splits (layers {[q.name for q in layer_params]})')
    if len(ends) > 1 and ends[-1] - ends[-2] == 1:
      raise ValueError(f'{p.name}: splits={ends} leaves the softmax alone on the last cell; '
                       f'expected the cell before it to end by {n - 2} (splits[-2] <= {n - 2}).')
    return ends

  @classmethod
  def CellParams(cls, p):
    """The pipeline cells: FeatureExtractionLayer params, num_stages * virtual_stages."""
    layer_params = cls.LayerParams(p)
    return gpipe.CellsFromEnds(layer_params, cls.StageEnds(p, layer_params))

  def __init__(self, params):
    if params.cell_tpl:
      raise ValueError(f'{params.name}: cell_tpl is built from the stack params; leave it '
                       f'empty, got {len(params.cell_tpl)} cells.')
    if params.batch_dim != 0:  # Any other would split sequences, not examples.
      raise ValueError(f'{params.name}: batch_dim={params.batch_dim!r}, but every tensor of a '
                       "stack's state has the batch as dimension 0: leave batch_dim at 0.")
    p = params.Copy()
    p.cell_tpl = self.CellParams(p)
    super().__init__(p)

  def Layers(self):
    """The stack's layers across all cells, in order."""
    return [layer for cell in self.cell for layer in cell.sub]

  def DefaultDirectInputs(self):
    """What later chunks read only, sent straight to them (direct_inputs.py): the softmax's
    labels and weights (or a decoding step's positions) to the last chunk, and a stream
    embedded after the first chunk (a translation model's target) to its embedding's."""
    stream = self.Layers()[-1].params.stream
    joins = {f'{stream}.{key}': -1 for key in ('labels', 'weights', 'decode_positions')}
    for c, cell in enumerate(self.cell):
      for layer in cell.sub:
        if isinstance(layer, state_layers.GPipeEmbeddingLayer):
          joins.update({f'{layer.params.stream}.{key}': c for key in ('ids', 'paddings')})
    return joins

  # -- the params API (lingvo_gpipe/pipeline/pipeline_params.py) ------------------

  @classmethod
  def NumStagesOf(cls, p):
    cells = len(p.cell_tpl) if p.cell_tpl else (
        p.splits if isinstance(p.splits, int) else len(p.splits))
    return cls._StagesOf(p, cells)

  @classmethod
  def LayersAndEnds(cls, p):
    layer_params = cls.LayerParams(p)
    return layer_params, cls.StageEnds(p, layer_params)

  @classmethod
  def Recut(cls, p, ends):
    cls.StageEnds(p.Copy().Set(splits=list(ends)), cls.LayerParams(p))  # Checks them.
    p.splits = list(ends)

  @classmethod
  def GluedLayers(cls, p):
    return [len(cls.LayerParams(p)) - 1]  # The softmax rides with the layer before it.


_TRANSFORMER_SET = {
    'input_dim': 'model_dim', 'num_heads': 'num_heads', 'hidden_dim': 'hidden_dim',
    'residual_dropout_prob': 'dropout_prob', 'atten_dropout_prob': 'dropout_prob',
    'relu_dropout_prob': 'dropout_prob', 'final_layer_norm': None, 'mask_self_atten': None,
    'has_aux_atten': None, 'aux_stream': None}
# {template: {field GPipeTransformerStack sets: the stack param it copies, or None where the
# layer's place in the stack decides}} (GPipeTransformerStack._FromStack).
_STACK_SET = {
    'emb_tpl': {'embedding_dim': 'model_dim', 'max_len': 'max_seq_len',
                'dropout_prob': 'dropout_prob'},
    'encoder_tpl': _TRANSFORMER_SET, 'decoder_tpl': _TRANSFORMER_SET,
    'softmax_tpl': {'input_dim': 'model_dim', 'label_smoothing': 'label_smoothing',
                    'tie_embedding': 'tie_embeddings'}}


def _StackSet(tpl, key):
  """Template `tpl` with the fields the stack sets (_STACK_SET[key]) None."""
  return tpl.Set(**{field: None for field in _STACK_SET[key]})


class GPipeTransformerStack(_GPipeStack):
  """A pipelined Transformer: embeddings, encoder and/or decoder layers, softmax.

  Encoder-only (num_decoder_layers=0) classifies every source token against
  src.labels; decoder-only (num_encoder_layers=0) is a language model over tgt
  with causal self-attention; with both, decoder layers also attend to the
  encoder output src.vecs. The layers, in order:

    src_emb, enc0..enc{E-1}, tgt_emb, dec0..dec{D-1}, softmax

  (without the absent parts). Input: the state NestedMap of state_layers'
  docstring; output: the softmax's per-token NestedMap.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('model_dim', 64, 'Depth of embeddings and Transformer layers.')
    p.Define('num_heads', 4, 'Attention heads; must divide model_dim.')
    p.Define('hidden_dim', 256, 'Depth of the feed-forward hidden layers.')
    p.Define('num_encoder_layers', 0, 'Transformer layers over src.')
    p.Define('num_decoder_layers', 2, 'Causal Transformer layers over tgt.')
    p.Define('max_seq_len', 256,
             'Longest sequence: the position tables\' length, and the length assumed when '
             'balancing stages by FLOPs.')
    # The templates' fields that the stack sets from its own params are None here.
    p.Define('emb_tpl', _StackSet(state_layers.GPipeEmbeddingLayer.Params().Set(vocab_size=32),
                                  'emb_tpl'),
             'Embedding template (vocab_size); used for src and tgt.')
    p.Define('softmax_tpl', _StackSet(state_layers.GPipeSoftmaxLayer.Params().Set(num_classes=32),
                                      'softmax_tpl'),
             'Softmax template (num_classes).')
    p.Define('encoder_tpl', _StackSet(state_layers.GPipeTransformerLayer.Params(), 'encoder_tpl'),
             'Encoder layer template (e.g. activation).')
    p.Define('decoder_tpl', _StackSet(state_layers.GPipeTransformerLayer.Params(), 'decoder_tpl'),
             'Decoder layer template (e.g. activation).')
    p.Define('label_smoothing', 0.0, 'Label smoothing of the trained cross entropy.')
    p.Define('dropout_prob', 0.0,
             'Dropout of embeddings, attention weights, block outputs and hidden activations.')
    p.Define('tie_embeddings', False,
             'The softmax uses the output stream\'s input embedding table as its weights.')
    return p

  @classmethod
  def _Check(cls, p):
    _CheckPositiveInts(p.name, model_dim=p.model_dim, num_heads=p.num_heads,
                       hidden_dim=p.hidden_dim, max_seq_len=p.max_seq_len)
    for key in ('num_encoder_layers', 'num_decoder_layers'):
      value = p.Get(key)
      if not isinstance(value, int) or value < 0:
        raise ValueError(f'{p.name}: {key} must be a non-negative int, got {value!r}.')
    if p.num_encoder_layers + p.num_decoder_layers == 0:
      raise ValueError(f'{p.name}: expected num_encoder_layers or num_decoder_layers > 0, '
                       'got none.')
    for key in ('dropout_prob', 'label_smoothing'):
      py_utils.CheckInterval(p.name, key, p.Get(key), (0.0, False, 1.0, True))
    if p.model_dim % p.num_heads:
      raise ValueError(f'{p.name}: model_dim={p.model_dim} is not divisible by '
                       f'num_heads={p.num_heads}; expected a multiple of {p.num_heads}.')
    if p.tie_embeddings and p.emb_tpl.vocab_size != p.softmax_tpl.num_classes:
      raise ValueError(f'{p.name}: tie_embeddings needs emb_tpl.vocab_size '
                       f'({p.emb_tpl.vocab_size}) == softmax_tpl.num_classes '
                       f'({p.softmax_tpl.num_classes}).')

  @classmethod
  def OutputStream(cls, p):
    """'tgt' if the stack has a decoder, else 'src'."""
    return 'tgt' if p.num_decoder_layers else 'src'

  @classmethod
  def LayerParams(cls, p):
    cls._Check(p)
    drop = p.dropout_prob
    emb = cls._FromStack(p, 'emb_tpl')

    def Transformer(key, name, stream, last, **kwargs):
      return cls._FromStack(p, key, final_layer_norm=last, aux_stream='src',
                            **kwargs).Set(name=name, stream=stream)

    out = []
    if p.num_encoder_layers:
      out.append(emb.Copy().Set(name='src_emb', stream='src'))
      out += [Transformer('encoder_tpl', f'enc{i}', 'src', i == p.num_encoder_layers - 1,
                          mask_self_atten=False, has_aux_atten=False)
              for i in range(p.num_encoder_layers)]
    if p.num_decoder_layers:
      out.append(emb.Copy().Set(name='tgt_emb', stream='tgt'))
      out += [Transformer('decoder_tpl', f'dec{i}', 'tgt', i == p.num_decoder_layers - 1,
                          mask_self_atten=True, has_aux_atten=bool(p.num_encoder_layers))
              for i in range(p.num_decoder_layers)]
    out.append(cls._FromStack(p, 'softmax_tpl').Set(name='softmax', stream=cls.OutputStream(p)))
    return out

  @classmethod
  def _FromStack(cls, p, key, **placed):
    """A copy of template p.<key> with the fields the stack sets (_STACK_SET): from its own
    params, or by the layer's place (`placed`). A field the user set in the template to
    another value is a ValueError, not silently replaced. Unset: None in the stack's own
    templates; in a template replaced by a class's fresh Params(), the class default."""
    tpl = p.Get(key)
    sources = _STACK_SET[key]
    values = dict({field: p.Get(source) for field, source in sources.items() if source},
                  **placed)
    defaults = tpl.cls.Params()
    own = any(tpl.Get(field) is None for field in sources)
    for field, value in values.items():
      mine = tpl.Get(field)
      if mine == value or mine == (None if own else defaults.Get(field)):
        continue
      source = sources[field]
      how = (f'from its {source} ({value!r}): set {source} instead' if source else
             f"to {value!r} by the layer's place in it: leave it unset")
      raise ValueError(f'{p.name}: {key}.{field} is {mine!r}, but the stack sets it {how}.')
    return tpl.Copy().Set(**values)

  @classmethod
  def InputSpec(cls, p):
    def Stream(**extra):
      return py_utils.NestedMap(ids=state_layers.Spec([1, p.max_seq_len], tf.int32),
                                paddings=state_layers.Spec([1, p.max_seq_len]), **extra)

    labeled = dict(labels=state_layers.Spec([1, p.max_seq_len], tf.int32),
                   weights=state_layers.Spec([1, p.max_seq_len]))
    spec = py_utils.NestedMap()
    if p.num_encoder_layers:
      spec.src = Stream(**({} if p.num_decoder_layers else labeled))
    if p.num_decoder_layers:
      spec.tgt = Stream(**labeled)
    return spec

  def __init__(self, params):
    super().__init__(params)
    self.TieLayers(self.params, self.Layers())

  @classmethod
  def TieLayers(cls, p, layer_list):
    if p.tie_embeddings:
      TieSoftmaxToEmbedding(layer_list)


def TieSoftmaxToEmbedding(layer_list):
  """Ties the softmax (last layer) to the embedding of the stream it predicts.

  Works on the layers of a GPipeTransformerStack, or of an unpipelined
  SequentialLayer built from the same LayerParams (a reference).
  """
  softmax = layer_list[-1]
  stream = softmax.params.stream
  emb = [layer for layer in layer_list
         if isinstance(layer, state_layers.GPipeEmbeddingLayer) and layer.params.stream == stream]
  softmax.ShareEmbedding(emb[0])


class GPipeResNetStack(_GPipeStack):
  """A pipelined residual conv net (ResNet-like) classifying images.

  Layers: stem (conv-BN-ReLU), block0..block{N-1} (residual basic blocks; a
  block whose channels grow halves the resolution), softmax (global average
  pooling and a full softmax). Input: NestedMap(image=NestedMap(vecs
  [B, H, W, C], labels [B], weights [B])).
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('image_shape', (32, 32, 3), '(height, width, channels) of the input images.')
    p.Define('num_classes', 10, 'Number of classes.')
    p.Define('stem_channels', 16, 'Channels of the stem convolution.')
    p.Define('block_channels', [16, 32, 64],
             'Output channels of each residual block; a block that grows them has stride 2.')
    p.Define('bn_decay', 0.99, 'Decay of the batch-norm moving statistics.')
    p.Define('label_smoothing', 0.0, 'Label smoothing of the trained cross entropy.')
    return p

  @classmethod
  def LayerParams(cls, p):
    if not (isinstance(p.image_shape, (list, tuple)) and len(p.image_shape) == 3):
      raise ValueError(f'{p.name}: image_shape must be (height, width, channels), got '
                       f'{p.image_shape!r}.')
    _CheckPositiveInts(p.name, num_classes=p.num_classes, stem_channels=p.stem_channels,
                       **{f'image_shape[{i}]': d for i, d in enumerate(p.image_shape)})
    if not p.block_channels:
      raise ValueError(f'{p.name}: block_channels is empty; expected at least one block.')
    _CheckPositiveInts(p.name, **{f'block_channels[{i}]': c
                                  for i, c in enumerate(p.block_channels)})
    block = state_layers.GPipeConvBlock.Params().Set(bn_decay=p.bn_decay)
    out = [block.Copy().Set(name='stem', in_channels=p.image_shape[-1],
                            out_channels=p.stem_channels, residual=False)]
    channels = p.stem_channels
    for i, c in enumerate(p.block_channels):
      out.append(block.Copy().Set(name=f'block{i}', in_channels=channels, out_channels=c,
                                  stride=2 if c > channels else 1))
      channels = c
    out.append(state_layers.GPipeSoftmaxLayer.Params().Set(
        name='softmax', stream='image', input_dim=channels, num_classes=p.num_classes,
        label_smoothing=p.label_smoothing, global_pool=True))
    return out

  @classmethod
  def InputSpec(cls, p):
    return py_utils.NestedMap(image=py_utils.NestedMap(
        vecs=state_layers.Spec([1, *p.image_shape]), labels=state_layers.Spec([1], tf.int32),
        weights=state_layers.Spec([1])))
