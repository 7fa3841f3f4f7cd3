"""Tests of tasks: metrics, tied gradients, pipelined training that learns, config errors."""

import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import layers_with_gpipe
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.models import tasks
from lingvo_gpipe.runners import pipeline_check
from lingvo_gpipe.training import learner

NestedMap = py_utils.NestedMap


def _Close(actual, expected, tol=2e-5):
  np.testing.assert_allclose(np.asarray(actual), np.asarray(expected), rtol=tol, atol=tol)


def _Key(var):
  """A variable's path below its task's stack ('lm/stack/...'), or below the reference's root."""
  parts = var.name.split(':')[0].split('/')
  return '/'.join(parts[2:] if parts[1:2] == ['stack'] else parts[1:])


# -- gradients of tied variables and metrics ------------------------------------------------


def testGradientsAndVariablesSumsEachVariableOnce():
  a, b = tf.Variable([1.0, 2.0]), tf.Variable(3.0)
  frozen = tf.Variable(0.0, trainable=False)
  variables = NestedMap(x=[a, b], y=NestedMap(a=a, frozen=frozen))
  grads = NestedMap(x=[tf.constant([1.0, 1.0]), tf.constant(5.0)],
                    y=NestedMap(a=tf.constant([0.5, 2.0]), frozen=tf.constant(9.0)))
  pairs = learner.GradientsAndVariables(variables, grads)
  assert [v for _, v in pairs] == [a, b]  # Order of first occurrence; no frozen one.
  _Close(pairs[0][0], [1.5, 3.0])
  _Close(pairs[1][0], 5.0)


def testSequenceMetricsMatchHandCounts():
  outputs = NestedMap(
      xent=tf.constant([[1.0, 2.0, 9.0], [3.0, 4.0, 5.0]]),
      nll=tf.constant([[0.5, 1.0, 9.0], [1.5, 2.0, 2.5]]),
      argmax=tf.constant([[1, 2, 0], [1, 1, 1]]),
      labels=tf.constant([[1, 2, 3], [1, 0, 1]]),
      weights=tf.constant([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]))
  m = tasks.SequenceMetrics(outputs)
  _Close(m.loss, (15.0 / 5, 5.0))
  _Close(m.log_pplx, (7.5 / 5, 5.0))
  _Close(m.token_accuracy, (4.0 / 5, 5.0))
  _Close(m.sequence_accuracy, (0.5, 2.0))  # The padded mistake of sequence 0 does not count.


def testClassificationMetricsMatchHandCounts():
  outputs = NestedMap(xent=tf.constant([1.0, 3.0]), nll=tf.constant([1.0, 3.0]),
                      argmax=tf.constant([4, 2]), labels=tf.constant([4, 1]),
                      weights=tf.constant([1.0, 3.0]))
  m = tasks.ClassificationMetrics(outputs)
  _Close(m.loss, (2.5, 4.0))
  _Close(m.top1, (0.25, 4.0))


# -- tasks on small stacks ----------------------------------------------------------


def _Stack(**kwargs):
  p = layers_with_gpipe.GPipeTransformerStack.Params().Set(
      name='stack', model_dim=8, num_heads=2, hidden_dim=16, max_seq_len=6, splits=2,
      num_micro_batches=4, num_decoder_layers=2)
  p.emb_tpl.vocab_size = p.softmax_tpl.num_classes = 9
  return p.Set(**kwargs)


def _Ints(shape, seed, high=9):
  return tf.random.stateless_uniform(shape, [seed, 1], 1, high, dtype=tf.int32)


def _LmBatch():
  weights = tf.sequence_mask([6, 3, 5, 1], 6, dtype=tf.float32)
  return NestedMap(ids=_Ints([4, 6], 1), labels=_Ints([4, 6], 2), paddings=1.0 - weights,
                   weights=weights)


def _MtBatch():
  src_paddings = 1.0 - tf.sequence_mask([4, 2, 1, 3], 4, dtype=tf.float32)
  tgt = _LmBatch()
  return NestedMap(src=NestedMap(ids=_Ints([4, 4], 3), paddings=src_paddings), tgt=tgt)


def _ImageBatch():
  return NestedMap(image=tf.random.stateless_normal([4, 8, 8, 3], [4, 1]),
                   label=_Ints([4], 5, high=3))


_TASKS = {
    'lm': lambda: (tasks.LanguageModelTask.Params().Set(name='lm', stack=_Stack()), _LmBatch()),
    'mt': lambda: (tasks.EncoderDecoderTask.Params().Set(
        name='mt', stack=_Stack(num_encoder_layers=2, splits=3)), _MtBatch()),
    'image': lambda: (tasks.ImageClassifierTask.Params().Set(
        name='image', stack=layers_with_gpipe.GPipeResNetStack.Params().Set(
            name='stack', image_shape=(8, 8, 3), num_classes=3, stem_channels=4,
            block_channels=[4, 8], splits=2, num_micro_batches=2)), _ImageBatch()),
}


@pytest.mark.parametrize('kind', sorted(_TASKS))
def testScheduledForwardBackwardEqualsTapeOverFPropTower(kind):
  """The pipeline schedule's metrics and gradients equal the differentiable FProp's."""
  params, batch = _TASKS[kind]()
  task = params.Instantiate()
  metrics, grads = task.ForwardBackward(task.theta, batch)
  tape_metrics, tape_grads = super(tasks.PipelinedTask, task).ForwardBackward(task.theta, batch)
  assert sorted(metrics) == sorted(tape_metrics)
  tf.nest.map_structure(_Close, metrics, tape_metrics)
  tf.nest.map_structure(lambda a, b: _Close(a, tf.convert_to_tensor(b)), grads, tape_grads)
  with py_utils.EvalMode():
    predictions = task.Inference(task.theta, batch)
    eval_metrics = task.FPropTower(task.theta, batch)
  assert predictions.argmax.dtype == tf.int32
  _Close(eval_metrics.loss[0], tf.reduce_sum(predictions.xent * predictions.weights) /
         tf.reduce_sum(predictions.weights))


def testTiedGradientSumEqualsTheSingleWeightGradient():
  """Embedding on stage 0, softmax on stage 1: their two gradient parts add up."""
  p = tasks.LanguageModelTask.Params().Set(name='lm', stack=_Stack(tie_embeddings=True))
  task, batch = p.Instantiate(), _LmBatch()
  table = task.stack.cell[0].sub[0].vars.emb.emb
  assert task.stack.cell[1].sub[-1].vars.softmax.proj.emb is table
  metrics, grads = task.ForwardBackward(task.theta, batch)
  pairs = learner.GradientsAndVariables(task.vars, grads)
  parts = [g for v, g in zip(tf.nest.flatten(task.vars), tf.nest.flatten(grads)) if v is table]
  assert len(parts) == 2 and all(np.abs(tf.convert_to_tensor(g)).max() > 0 for g in parts)

  # One device, one weight used for both the input embedding and the logits.
  stack_p = p.stack
  ref = layers.SequentialLayer.Params().Set(
      name='ref', sub=stack_p.cls.LayerParams(stack_p)).Instantiate()
  layers_with_gpipe.TieSoftmaxToEmbedding(ref.sub)
  values = {_Key(v): v for v in task.variables}
  for v in ref.variables:
    v.assign(values[_Key(v)])
  with tf.GradientTape() as tape:
    loss = tasks.SequenceMetrics(ref.FProp(ref.theta, task.PipelineInput(batch))).loss[0]
  ref_grads = dict(zip([_Key(v) for v in ref.trainable_variables],
                       tape.gradient(loss, ref.trainable_variables)))
  _Close(metrics.loss[0], loss)
  assert len(pairs) == len(ref_grads)
  for grad, var in pairs:
    _Close(grad, tf.convert_to_tensor(ref_grads[_Key(var)]))


# -- configuration errors -------------------------------------------------------------


def _LmInput(**kwargs):
  return model_registry.GetParams('lm.synthetic.GPipeTransformerLmTiny', 'Train').input.Set(
      **kwargs)


@pytest.mark.parametrize('make_params,message', [
    (lambda: tasks.LanguageModelTask.Params().Set(
        name='lm', stack=_Stack(), input=_LmInput(vocab_size=10, seq_len=6, max_len=2)),
     r'vocabulary mismatch: input vocab_size=10, stack emb_tpl.vocab_size=9'),
    (lambda: tasks.LanguageModelTask.Params().Set(
        name='lm', stack=_Stack(**{'emb_tpl.vocab_size': 14, 'softmax_tpl.num_classes': 14}),
        input=_LmInput()),
     r'input seq_len=14 is longer than the position table, stack max_seq_len=6'),
    (lambda: tasks.LanguageModelTask.Params().Set(
        name='lm', stack=_Stack(num_encoder_layers=1)),
     r'language model needs num_encoder_layers=0'),
    (lambda: tasks.EncoderDecoderTask.Params().Set(name='mt', stack=_Stack()),
     r'encoder-decoder needs num_encoder_layers > 0'),
    (lambda: tasks.ImageClassifierTask.Params().Set(name='image', stack=_Stack()),
     r'stack must be GPipeResNetStack params, got GPipeTransformerStack'),
    (lambda: _TASKS['image']()[0].Set(input=model_registry.GetParams(
        'image.synthetic.GPipeConvNet', 'Train').input),
     r'input images \(16, 16, 3\) of 10 classes, but the stack expects \(8, 8, 3\) of 3'),
])
def testBadConfigsAreClearErrorsAtInstantiation(make_params, message):
  with pytest.raises(ValueError, match=message):
    make_params().Instantiate()


# -- training learns --------------------------------------------------------------------


class _Adam:
  """Plain Adam, written here so the test assumes nothing of the library's optimizers."""

  def __init__(self, variables, learning_rate, beta1=0.9, beta2=0.999, epsilon=1e-8):
    self.lr, self.b1, self.b2, self.eps = learning_rate, beta1, beta2, epsilon
    self.m = [tf.Variable(tf.zeros_like(v)) for v in variables]
    self.v = [tf.Variable(tf.zeros_like(v)) for v in variables]
    self.t = tf.Variable(0.0)

  def Apply(self, grads_and_vars):
    t = self.t.assign_add(1.0)
    scale = self.lr * tf.sqrt(1.0 - self.b2 ** t) / (1.0 - self.b1 ** t)
    for (g, var), m, v in zip(grads_and_vars, self.m, self.v):
      m.assign(self.b1 * m + (1.0 - self.b1) * g)
      v.assign(self.b2 * v + (1.0 - self.b2) * g * g)
      var.assign_sub(scale * m / (tf.sqrt(v) + self.eps))


def _TrainRegisteredModel(key, steps):
  """Dev metrics before and after `steps` pipelined Adam steps of a registered model."""
  p = model_registry.GetParams(key, 'Train')
  task = p.task.Instantiate()
  train = iter(p.input.Instantiate().GetDataset())
  dev = list(model_registry.GetParams(key, 'Dev').input.Instantiate().GetDataset())
  adam = _Adam([v for _, v in learner.GradientsAndVariables(task.vars, task.vars)],
               p.task.train.learning_rate)

  @tf.function
  def Step(batch, step):
    with py_utils.Context(step=step):
      metrics, grads = task.ForwardBackward(task.theta, batch)
    adam.Apply(learner.GradientsAndVariables(task.vars, grads))
    return metrics.loss[0]

  @tf.function
  def Evaluate(batch):
    with py_utils.EvalMode():
      return task.FPropTower(task.theta, batch)

  def DevMetrics():
    results = [Evaluate(batch) for batch in dev]
    return {name: float(sum(r[name][0] * r[name][1] for r in results) /
                        sum(r[name][1] for r in results)) for name in results[0]}

  before = DevMetrics()
  start = time.time()
  for i in range(steps):
    Step(next(train), tf.constant(i, tf.int64))
  after = DevMetrics()
  print(f'{key}: {steps} steps in {time.time() - start:.1f}s; dev before {before}, after {after}')
  return before, after


def testTinyLmLearnsToReverse():
  before, after = _TrainRegisteredModel('lm.synthetic.GPipeTransformerLmTiny', steps=200)
  assert before['loss'] > 2.5  # Chance is log(14) = 2.64.
  assert after['loss'] < before['loss'] - 1.5
  assert after['token_accuracy'] > 0.6


def testEncoderDecoderLearnsToReverse():
  before, after = _TrainRegisteredModel('mt.synthetic.GPipeTransformerReverse', steps=200)
  assert before['loss'] > 2.5
  assert after['loss'] < before['loss'] - 1.5
  assert after['token_accuracy'] > 0.6


def testRegisteredLmServesAnyBatchWithoutLabels():
  """One [None, T] trace of Inference takes ids and paddings only, for 1, 5 (uneven over
  M=2) and 32 examples: the argmax of the labeled evaluation, and of the unpipelined model."""
  model_params = model_registry.GetParams('lm.synthetic.GPipeTransformerLmTiny', 'Train')
  task = model_params.task.Instantiate()
  plain = pipeline_check.UnpipelinedParams(model_params).task.Instantiate()
  for a, b in zip(plain.variables, task.variables):
    a.assign(b)
  batch = next(iter(model_params.input.Instantiate().GetDataset()))
  with py_utils.EvalMode():
    want = task.ComputePredictions(task.theta, batch).argmax.numpy()
  seq_len = batch.ids.shape[1]

  def Serve(model):
    return tf.function(
        lambda ids, paddings: model.Inference(model.theta,
                                              py_utils.NestedMap(ids=ids, paddings=paddings)),
        input_signature=[tf.TensorSpec([None, seq_len], tf.int32),
                         tf.TensorSpec([None, seq_len], tf.float32)])

  serve, serve_plain = Serve(task), Serve(plain)
  for rows in (1, 5, 32):
    ids, paddings = batch.ids[:rows], tf.cast(batch.paddings[:rows], tf.float32)
    out = serve(ids, paddings)
    np.testing.assert_array_equal(out.argmax.numpy(), want[:rows])
    np.testing.assert_array_equal(serve_plain(ids, paddings).argmax.numpy(), want[:rows])


def testLmOnUnevenMicroBatchesEqualsTapeOverFPropTower():
  """7 sequences of uneven lengths, M=3 (3, 2, 2): the token-weighted metrics and gradients
  of a per-micro-batch schedule (1F1B) equal the differentiable FProp's on the whole batch."""
  task, whole = (tasks.LanguageModelTask.Params().Set(name='lm', stack=stack).Instantiate()
                 for stack in (_Stack(num_micro_batches=3, schedule='1f1b'),
                               _Stack(num_micro_batches=1)))
  for a, b in zip(whole.variables, task.variables):
    a.assign(b)
  weights = tf.sequence_mask([6, 3, 5, 1, 2, 6, 4], 6, dtype=tf.float32)
  batch = NestedMap(ids=_Ints([7, 6], 1), labels=_Ints([7, 6], 2), paddings=1.0 - weights,
                    weights=weights)
  metrics, grads = task.ForwardBackward(task.theta, batch)
  tape_metrics, tape_grads = super(tasks.PipelinedTask, whole).ForwardBackward(whole.theta,
                                                                               batch)
  tf.nest.map_structure(_Close, metrics, tape_metrics)
  tf.nest.map_structure(lambda a, b: _Close(a, tf.convert_to_tensor(b)), grads, tape_grads)


def _StackTask(loss, out_dim, schedule='1f1b', **kwargs):
  # pylint: disable-next=g-import-not-at-top,import-outside-toplevel
  from lingvo_gpipe.pipeline import gpipe
  cells = [layers.ProjectionLayer.Params().Set(name='hidden', input_dim=6, output_dim=16,
                                               activation='RELU'),
           layers.ProjectionLayer.Params().Set(name='out', input_dim=16, output_dim=out_dim)]
  stack = gpipe.PipeliningLayer.Params().Set(cell_tpl=cells, num_micro_batches=3,
                                             schedule=schedule)
  return tasks.SequentialStackTask.Params().Set(name='mine', stack=stack, loss=loss,
                                                **kwargs).Instantiate()


def _PlainLoss(loss, out, batch):
  """The loss in plain TensorFlow, on the whole batch."""
  if loss == 'mse':
    return tf.reduce_mean(tf.square(out - batch.y))
  xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=batch.y, logits=out)
  if loss == 'softmax_xent':
    return tf.reduce_mean(xent)
  return tf.reduce_sum(xent * batch.w) / tf.reduce_sum(batch.w)


@pytest.mark.parametrize('loss', ['mse', 'softmax_xent', 'token_xent'])
@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zb_h1'])
def testASequentialStackTaskTrainsItsLayersOnAStandardLoss(loss, schedule):
  """SequentialStackTask: the loss and gradients of a pipelined step (7 rows, M=3) equal
  plain TensorFlow's on the unpipelined layers."""
  rows = 7
  seq = (rows, 5) if loss == 'token_xent' else (rows,)
  x = tf.random.stateless_normal(seq + (6,), [1, 2])
  if loss == 'mse':
    y = tf.random.stateless_normal((rows, 3), [3, 4])
  else:
    y = tf.random.stateless_uniform(seq, [5, 6], maxval=3, dtype=tf.int32)
  w = tf.cast(tf.random.stateless_uniform(seq, [7, 8]) > 0.3, tf.float32)
  batch = py_utils.NestedMap(x=x, y=y, w=w)
  task = _StackTask(loss, 3, schedule, weight_key='w' if loss == 'token_xent' else None)
  metrics, grads = task.ForwardBackward(task.theta, batch)
  with tf.GradientTape() as tape:
    out = x
    for cell, theta in zip(task.stack.cell, task.theta.stack.cell):
      out = cell.FProp(theta, out)
    expected = _PlainLoss(loss, out, batch)
  expected_grads = tape.gradient(expected, task.theta.stack)
  np.testing.assert_allclose(metrics.loss[0].numpy(), expected.numpy(), rtol=1e-5)
  for g, r in zip(tf.nest.flatten(grads.stack), tf.nest.flatten(expected_grads)):
    np.testing.assert_allclose(g.numpy(), r.numpy(), rtol=1e-4, atol=1e-6)
  with py_utils.EvalMode():
    evaluated = task.FPropTower(task.theta, batch)
  np.testing.assert_allclose(evaluated.loss[0].numpy(), expected.numpy(), rtol=1e-5)


def testASequentialStackTaskNamesAMissingFieldAndABadLoss():
  task = _StackTask('mse', 3, input_key='features')
  with pytest.raises(ValueError, match=r"mine: the input batch has no field 'features' "
                     r"\(fields: \['x', 'y'\]\)"):
    task.ForwardBackward(task.theta, py_utils.NestedMap(x=tf.zeros([4, 6]),
                                                        y=tf.zeros([4, 3])))
  with pytest.raises(ValueError, match="mine: loss='hinge'; expected one of"):
    _StackTask('hinge', 3)
