"""Tasks on GPipe stacks: language model, encoder-decoder, image classifier, and any
sequential stack of one's own layers with a standard loss (SequentialStackTask).

A task holds one stack (a layers_with_gpipe PipeliningLayer) as its child
`stack`. ForwardBackward runs the stack's pipeline schedule with a loss_fn
returning the metrics, so metrics such as token accuracy merge exactly over
micro-batches; FPropTower runs the pipelined forward (differentiable in
training, forward-only in eval mode) and computes the same metrics.

Metrics are (value, weight) pairs:
  loss: the trained, label-smoothed cross entropy per token (or example);
  log_pplx: -log p(label) per token, the log-perplexity;
  token_accuracy / top1: share of argmax predictions equal to the labels;
  sequence_accuracy: share of sequences all of whose weighted tokens are right.

With tied embeddings one tf.Variable appears twice in theta, and the gradients
ForwardBackward returns hold one part for each occurrence: sum them per
variable (learner.GradientsAndVariables) before applying them.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import base_model
from lingvo_gpipe.models import decoder
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.pipeline import gpipe

# Floor of a total weight that divides a metric, so an all-padded batch gives 0, not NaN.
_TINY_WEIGHT = 1e-9


def _WeightedMean(values, weights):
  """(weighted mean, total weight) in float32, whatever the pipeline's fprop_dtype."""
  values, weights = tf.cast(values, tf.float32), tf.cast(weights, tf.float32)
  total = tf.reduce_sum(weights)
  return tf.reduce_sum(values * weights) / tf.maximum(total, _TINY_WEIGHT), total


def SequenceMetrics(outputs):
  """Metrics of the softmax's per-token outputs [B, T] (see the module docstring)."""
  weights = outputs.weights
  correct = tf.cast(tf.equal(outputs.argmax, outputs.labels), tf.float32)
  has_tokens = tf.cast(tf.reduce_any(weights > 0.0, axis=-1), tf.float32)
  all_correct = tf.reduce_min(tf.where(weights > 0.0, correct, 1.0), axis=-1)
  return py_utils.NestedMap(
      loss=_WeightedMean(outputs.xent, weights),
      log_pplx=_WeightedMean(outputs.nll, weights),
      token_accuracy=_WeightedMean(correct, weights),
      sequence_accuracy=_WeightedMean(all_correct, has_tokens))


def ClassificationMetrics(outputs):
  """Metrics of the softmax's per-example outputs [B]."""
  correct = tf.cast(tf.equal(outputs.argmax, outputs.labels), tf.float32)
  return py_utils.NestedMap(loss=_WeightedMean(outputs.xent, outputs.weights),
                            log_pplx=_WeightedMean(outputs.nll, outputs.weights),
                            top1=_WeightedMean(correct, outputs.weights))


class PipelinedTask(base_model.BaseTask):
  """A task whose network is one GPipe stack; subclasses map batches and metrics."""

  # The stack class a subclass needs.
  STACK_CLASS = None

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('stack', None, 'Params of the layers_with_gpipe stack.')
    p.Define('input', None,
             'Params of the input generator feeding the task; when set, instantiation checks '
             'that they fit the stack (vocabulary, lengths, image shape).')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.stack is None or not issubclass(p.stack.cls, self.STACK_CLASS):
      raise ValueError(f'{self.path}: stack must be {self.STACK_CLASS.__name__} params, got '
                       f'{None if p.stack is None else p.stack.cls.__name__}.')
    self.CheckStack(p.stack)
    if p.input is not None:
      self.CheckInput(p.stack, p.input)
    self.CreateChild('stack', p.stack)

  def CheckStack(self, stack):
    """Raises a ValueError if the stack params do not suit this task."""

  def CheckInput(self, stack, input_params):
    """Raises a ValueError if the input params do not suit the stack."""
    raise NotImplementedError(f'{type(self).__name__}.CheckInput')

  def PipelineInput(self, input_batch):
    """The stack's input state of an input batch."""
    raise NotImplementedError(f'{type(self).__name__}.PipelineInput')

  def Metrics(self, outputs):
    """Metrics (value, weight) of the stack's outputs: the pipeline's loss_fn."""
    raise NotImplementedError(f'{type(self).__name__}.Metrics')

  def ComputePredictions(self, theta, input_batch):
    """The stack's per-token (or per-example) outputs."""
    return self.stack.FProp(theta.stack, self.PipelineInput(input_batch))

  def ComputeLoss(self, theta, predictions, input_batch):
    del theta, input_batch  # The predictions carry labels and weights.
    return self.Metrics(predictions)

  def ForwardBackward(self, theta, input_batch):
    metrics, grads = self.stack.ForwardBackward(theta.stack, self.PipelineInput(input_batch),
                                                self.Metrics)
    return metrics, py_utils.NestedMap(stack=grads)


def _CheckSequenceInput(task, stack, input_params):
  """The input's vocabulary is the stack's, and its sequences fit the position table."""
  vocab = stack.emb_tpl.vocab_size
  if input_params.vocab_size != vocab or stack.softmax_tpl.num_classes != vocab:
    raise ValueError(f'{task.path}: vocabulary mismatch: input vocab_size='
                     f'{input_params.vocab_size}, stack emb_tpl.vocab_size={vocab}, '
                     f'softmax_tpl.num_classes={stack.softmax_tpl.num_classes}; expected all '
                     'equal.')
  if input_params.seq_len > stack.max_seq_len:
    raise ValueError(f'{task.path}: input seq_len={input_params.seq_len} is longer than the '
                     f'position table, stack max_seq_len={stack.max_seq_len}; expected '
                     f'seq_len <= {stack.max_seq_len}.')


def _Prompts(ids, start):
  """ids [B, T] with only each row's prompt kept, ids 0..start (the rest 0): a decode
  cannot read the reference even where attention would let it."""
  return tf.where(tf.range(tf.shape(ids)[1])[tf.newaxis] <= start[:, tf.newaxis],
                  tf.cast(ids, tf.int32), 0)


class _DecodingTask(PipelinedTask):
  """A sequence task that decodes (lingvo_gpipe.models.decoder): it states a batch's problem and
  the stack's state of a decoding step."""

  STACK_CLASS = layers_with_gpipe.GPipeTransformerStack

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('decoder', decoder.DecoderParams(),
             'How the decoder jobs, decoder.Decode and decoder.Export decode.')
    return p

  def __init__(self, params):
    super().__init__(params)
    decoder.CheckDecoderParams(self.path, self.params.decoder)

  def DecodeProblem(self, input_batch):
    """The decoding problem of a batch of the task's input (see lingvo_gpipe.models.decoder)."""
    raise NotImplementedError(f'{type(self).__name__}.DecodeProblem')

  def ServingSpecs(self):
    """name -> tf.TensorSpec of the features an exported decoder serves (any batch)."""
    raise NotImplementedError(f'{type(self).__name__}.ServingSpecs')

  def ServingProblem(self, features):
    """The decoding problem of served features (ServingSpecs): decoded up to max_seq_len."""
    raise NotImplementedError(f'{type(self).__name__}.ServingProblem')

  def DecodeState(self, context, ids, positions):
    """The stack's input of a decoding step (its softmax returns log_probs)."""
    raise NotImplementedError(f'{type(self).__name__}.DecodeState')

  def DecodeLogProbs(self, theta, context, ids, positions):
    """[B, V] log p(next id) at each row's position of ids [B, T]: the pipelined forward."""
    return self.stack.FProp(theta.stack, self.DecodeState(context, ids, positions)).log_probs

  def _Problem(self, ids, start, targets, target_weights, context):
    return py_utils.NestedMap(ids=_Prompts(ids, start), start=start,
                              targets=tf.cast(targets, tf.int32),
                              target_weights=tf.cast(target_weights, tf.float32),
                              context=context)

  def _ServedIds(self, ids, name):
    """Served ids [B, L] padded to [B, max_seq_len]; a longer L is a ValueError."""
    max_len = self.params.stack.max_seq_len
    length = tf.shape(ids)[1]
    check = tf.debugging.assert_less_equal(
        length, max_len, message=f'{name} is longer than the model\'s max_seq_len={max_len}')
    with tf.control_dependencies([check]):
      return tf.pad(tf.cast(ids, tf.int32), [[0, 0], [0, max_len - length]])

  @staticmethod
  def _Target(ids, positions):
    """A decoding step's stream: ids, no paddings (causal attention masks what follows)."""
    return py_utils.NestedMap(ids=ids, paddings=tf.zeros(tf.shape(ids), tf.float32),
                              decode_positions=positions)


class LanguageModelTask(_DecodingTask):
  """A decoder-only Transformer LM on NestedMap(ids, labels, paddings, weights) batches."""

  def CheckStack(self, stack):
    if stack.num_encoder_layers or not stack.num_decoder_layers:
      raise ValueError(f'{self.path}: a language model needs num_encoder_layers=0 and '
                       f'num_decoder_layers > 0, got {stack.num_encoder_layers} and '
                       f'{stack.num_decoder_layers}.')

  def CheckInput(self, stack, input_params):
    _CheckSequenceInput(self, stack, input_params)

  def PipelineInput(self, input_batch):
    b = input_batch
    return py_utils.NestedMap(tgt=py_utils.NestedMap(
        ids=b.ids, labels=b.labels, paddings=b.paddings, weights=b.weights))

  def Metrics(self, outputs):
    return SequenceMetrics(outputs)

  def Inference(self, theta, input_batch):
    """The stack's predictions, evaluation mode; a batch without labels is served too.

    With labels (a training batch) every prediction; with NestedMap(ids,
    optional paddings) alone, those that need no labels: argmax (each
    position's most likely next token) and weights (1 - paddings). The batch
    size may be unknown at trace time: any batch, one example too.
    """
    if 'labels' in input_batch:
      return super().Inference(theta, input_batch)
    ids = input_batch.ids
    paddings = input_batch.get('paddings')
    paddings = (tf.zeros(tf.shape(ids), tf.float32) if paddings is None
                else tf.cast(paddings, tf.float32))
    # The softmax layer reads labels for its loss; the argmax does not depend on them.
    batch = py_utils.NestedMap(ids=ids, labels=tf.zeros_like(ids), paddings=paddings,
                               weights=1.0 - paddings)
    predictions = super().Inference(theta, batch)
    return py_utils.NestedMap(argmax=predictions.argmax, weights=predictions.weights)

  def DecodeProblem(self, input_batch):
    """The prompt is decoder.prompt_len ids, or those up to the first weighted label."""
    b = input_batch
    rows, length = tf.shape(b.ids)[0], tf.shape(b.ids)[1]
    prompt_len = self.params.decoder.prompt_len
    if prompt_len is None:
      weighted = tf.cast(b.weights > 0, tf.int32)
      start = tf.where(tf.reduce_any(weighted > 0, -1),
                       tf.argmax(weighted, -1, output_type=tf.int32), length)
    else:
      seq_len = b.ids.shape[1]
      if seq_len is not None and prompt_len >= seq_len:
        raise ValueError(f'{self.path}: decoder.prompt_len={prompt_len} leaves nothing to '
                         f'decode in sequences of {seq_len}; expected < {seq_len}.')
      start = tf.fill([rows], prompt_len - 1)
    return self._Problem(b.ids, start, b.labels, b.weights, py_utils.NestedMap())

  def ServingSpecs(self):
    return {'ids': tf.TensorSpec([None, None], tf.int32),
            'lengths': tf.TensorSpec([None], tf.int32)}

  def ServingProblem(self, features):
    """Prompts ids [B, L] of lengths [B] (>= 1), continued up to max_seq_len."""
    ids = self._ServedIds(features['ids'], 'ids')
    zeros = tf.zeros_like(ids)
    return self._Problem(ids, tf.cast(features['lengths'], tf.int32) - 1, zeros,
                         tf.cast(zeros, tf.float32), py_utils.NestedMap())

  def DecodeState(self, context, ids, positions):
    del context  # A language model reads its ids only.
    return py_utils.NestedMap(tgt=self._Target(ids, positions))


class EncoderDecoderTask(_DecodingTask):
  """A Transformer encoder-decoder on NestedMap(src, tgt) batches (teacher forcing)."""

  def CheckStack(self, stack):
    if not (stack.num_encoder_layers and stack.num_decoder_layers):
      raise ValueError(f'{self.path}: an encoder-decoder needs num_encoder_layers > 0 and '
                       f'num_decoder_layers > 0, got {stack.num_encoder_layers} and '
                       f'{stack.num_decoder_layers}.')

  def CheckInput(self, stack, input_params):
    _CheckSequenceInput(self, stack, input_params)

  def PipelineInput(self, input_batch):
    src, tgt = input_batch.src, input_batch.tgt
    return py_utils.NestedMap(
        src=py_utils.NestedMap(ids=src.ids, paddings=src.paddings),
        tgt=py_utils.NestedMap(ids=tgt.ids, labels=tgt.labels, paddings=tgt.paddings,
                               weights=tgt.weights))

  def Metrics(self, outputs):
    return SequenceMetrics(outputs)

  def DecodeProblem(self, input_batch):
    """The target is decoded from its first id (bos) on, reading the source."""
    src, tgt = input_batch.src, input_batch.tgt
    start = tf.zeros([tf.shape(tgt.ids)[0]], tf.int32)
    return self._Problem(tgt.ids, start, tgt.labels, tgt.weights, self._Source(src.ids,
                                                                               src.paddings))

  def ServingSpecs(self):
    return {'src_ids': tf.TensorSpec([None, None], tf.int32),
            'src_lengths': tf.TensorSpec([None], tf.int32)}

  def ServingProblem(self, features):
    """Sources src_ids [B, S] of src_lengths [B]; targets from decoder.bos_id on."""
    src_ids = self._ServedIds(features['src_ids'], 'src_ids')
    paddings = 1.0 - tf.sequence_mask(features['src_lengths'], tf.shape(src_ids)[1], tf.float32)
    rows = tf.shape(src_ids)[0]
    ids = tf.pad(tf.fill([rows, 1], self.params.decoder.bos_id),
                 [[0, 0], [0, self.params.stack.max_seq_len - 1]])
    zeros = tf.zeros_like(ids)
    return self._Problem(ids, tf.zeros([rows], tf.int32), zeros, tf.cast(zeros, tf.float32),
                         self._Source(src_ids, paddings))

  @staticmethod
  def _Source(ids, paddings):
    return py_utils.NestedMap(src=py_utils.NestedMap(ids=tf.cast(ids, tf.int32),
                                                     paddings=tf.cast(paddings, tf.float32)))

  def DecodeState(self, context, ids, positions):
    return py_utils.NestedMap(src=context.src,
                              tgt=self._Target(ids, positions))


# The tasks a decoder job decodes.
DECODING_TASKS = (LanguageModelTask, EncoderDecoderTask)


class ImageClassifierTask(PipelinedTask):
  """A residual conv net on NestedMap(image [B, H, W, C], label [B]) batches."""

  STACK_CLASS = layers_with_gpipe.GPipeResNetStack

  def CheckInput(self, stack, input_params):
    if (tuple(input_params.image_shape) != tuple(stack.image_shape) or
        input_params.num_classes != stack.num_classes):
      raise ValueError(f'{self.path}: input images {tuple(input_params.image_shape)} of '
                       f'{input_params.num_classes} classes, but the stack expects '
                       f'{tuple(stack.image_shape)} of {stack.num_classes} classes.')

  def PipelineInput(self, input_batch):
    labels = input_batch.label
    return py_utils.NestedMap(image=py_utils.NestedMap(
        vecs=input_batch.image, labels=labels, weights=tf.ones_like(labels, tf.float32)))

  def Metrics(self, outputs):
    return ClassificationMetrics(outputs)


_STACK_LOSSES = ('mse', 'softmax_xent', 'token_xent')


class SequentialStackTask(PipelinedTask):
  """Any PipeliningLayer of one's own layers, trained on a standard loss: no subclass.

  The stack reads input_batch[input_key]; the loss compares its output with
  input_batch[target_key]:
    mse           regression: outputs and targets of one shape; loss is the mean squared
                  error per example, with abs_error;
    softmax_xent  classification: logits [B, C], int labels [B]; loss and log_pplx are the
                  cross entropy per example, with top1;
    token_xent    sequences (an LM): logits [B, T, V], int labels [B, T], weighted by
                  input_batch[weight_key] ([B, T], e.g. 1 - paddings) if given; per token,
                  with token_accuracy.
  """

  STACK_CLASS = gpipe.PipeliningLayer

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('loss', 'mse', f'The loss of the stack\'s output: one of {list(_STACK_LOSSES)}.')
    p.Define('input_key', 'x', 'The input batch\'s field the stack reads.')
    p.Define('target_key', 'y', 'The input batch\'s field of the targets (or labels).')
    p.Define('weight_key', None, 'token_xent: the input batch\'s field of per-token weights '
             '(None: every token weighs 1).')
    return p

  def CheckStack(self, stack):
    if self.params.loss not in _STACK_LOSSES:
      raise ValueError(f'{self.path}: loss={self.params.loss!r}; expected one of '
                       f'{list(_STACK_LOSSES)}.')

  def CheckInput(self, stack, input_params):
    """The input's fields are checked when a batch arrives (their names are params)."""

  def _Field(self, input_batch, key):
    if key not in input_batch:
      raise ValueError(f'{self.path}: the input batch has no field {key!r} (fields: '
                       f'{sorted(input_batch)}); set input_key, target_key or weight_key.')
    return input_batch[key]

  def PipelineInput(self, input_batch):
    return self._Field(input_batch, self.params.input_key)

  def _Labels(self, input_batch):
    """The batch's targets (and weights): split into micro-batches as the inputs are."""
    p = self.params
    labels = py_utils.NestedMap(targets=self._Field(input_batch, p.target_key))
    if p.loss == 'token_xent' and p.weight_key is not None:
      labels.weights = self._Field(input_batch, p.weight_key)
    return labels

  def _StackMetrics(self, outputs, labels):
    """The metrics of the stack's outputs against their rows of the targets."""
    p = self.params
    targets = labels.targets
    if p.loss == 'mse':
      error = tf.cast(outputs, tf.float32) - tf.cast(targets, tf.float32)
      per_example = tf.reshape(error, [tf.shape(error)[0], -1])
      rows = tf.ones(tf.shape(error)[:1])
      return py_utils.NestedMap(
          loss=_WeightedMean(tf.reduce_mean(tf.square(per_example), axis=-1), rows),
          abs_error=_WeightedMean(tf.reduce_mean(tf.abs(per_example), axis=-1), rows))
    logits = tf.cast(outputs, tf.float32)
    label_ids = tf.cast(targets, tf.int32)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=label_ids, logits=logits)
    correct = tf.cast(tf.equal(tf.argmax(logits, -1, output_type=tf.int32), label_ids),
                      tf.float32)
    weights = labels.get('weights', tf.ones(tf.shape(label_ids)))
    accuracy = 'top1' if p.loss == 'softmax_xent' else 'token_accuracy'
    return py_utils.NestedMap(loss=_WeightedMean(xent, weights),
                              log_pplx=_WeightedMean(xent, weights),
                              **{accuracy: _WeightedMean(correct, weights)})

  def ComputeLoss(self, theta, predictions, input_batch):
    del theta
    return self._StackMetrics(predictions, self._Labels(input_batch))

  def ForwardBackward(self, theta, input_batch):
    metrics, grads = self.stack.ForwardBackward(
        theta.stack, self.PipelineInput(input_batch), self._StackMetrics,
        labels=self._Labels(input_batch))
    return metrics, py_utils.NestedMap(stack=grads)
