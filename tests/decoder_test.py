"""Tests of decoding: each search against a reference built on the unpipelined model's
teacher-forced forward (not the decoding step), BLEU by hand, the export in use."""

import itertools
import math

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.inputs import input_generators
from lingvo_gpipe.models import decoder
from lingvo_gpipe.models import tasks
from lingvo_gpipe.params.lm import synthetic

NestedMap = py_utils.NestedMap
VOCAB, SEQ_LEN = 8, 8


def _Stack(encoder_layers, splits, micro_batches, schedule):
  p = synthetic.TransformerStackParams(VOCAB, SEQ_LEN, model_dim=16, num_heads=2, hidden_dim=32,
                                       num_encoder_layers=encoder_layers, num_decoder_layers=2,
                                       splits=splits, num_micro_batches=micro_batches)
  p.schedule = schedule
  return p


def _Data(cls):
  return cls.Params().Set(name='data', task='reverse', vocab_size=VOCAB, min_len=2, max_len=3,
                          seq_len=SEQ_LEN, batch_size=6, seed=1)


def _Task(name, splits, micro_batches, schedule, decoding, fprop_dtype=None):
  """A small LM ('lm') or encoder-decoder ('mt') task on its synthetic reverse data."""
  task_cls, data_cls, encoder_layers = {
      'lm': (tasks.LanguageModelTask, input_generators.SyntheticLmInput, 0),
      'mt': (tasks.EncoderDecoderTask, input_generators.SyntheticSeq2SeqInput, 2)}[name]
  p = task_cls.Params().Set(name=name, input=_Data(data_cls))
  p.stack = _Stack(encoder_layers, splits, micro_batches, schedule)
  if fprop_dtype is not None:
    p.stack.fprop_dtype = fprop_dtype
  p.decoder.Set(**decoding)
  return p.Instantiate()


def _Lm(splits=2, micro_batches=2, schedule='1f1b', **decoding):
  return _Task('lm', splits, micro_batches, schedule, decoding)


def _Mt(splits=2, micro_batches=2, schedule='1f1b', **decoding):
  return _Task('mt', splits, micro_batches, schedule, decoding)


def _Batch(task):
  return next(iter(task.params.input.Instantiate().GetDataset()))


def _Numpy(out):
  return {k: v.numpy() for k, v in out.items()}


def _Decode(task, batch):
  return _Numpy(tf.function(lambda b: decoder.Decode(task, task.theta, b),
                            autograph=False)(batch))


# -- the reference: next-id log-probabilities from the teacher-forced forward --------------


class _Reference:
  """log p(next id) of an unpipelined copy (splits=1, M=1) of a task, read off its softmax's
  nll for every label at once (V copies of the batch), and greedy decoding by a Python loop."""

  def __init__(self, make_task, batch):
    self.task = make_task(splits=1, micro_batches=1, schedule='gpipe')
    self.context = self.task.DecodeProblem(batch).context

  def LogProbs(self, ids):
    """[B, T, V] of ids [B, T]."""
    rows = ids.shape[0]
    tiled = np.tile(ids, [VOCAB, 1])
    labels = np.repeat(np.arange(VOCAB), rows)[:, None] * np.ones_like(tiled)
    tgt = NestedMap(ids=tf.constant(tiled, tf.int32), labels=tf.constant(labels, tf.int32),
                    paddings=tf.zeros(tiled.shape), weights=tf.ones(tiled.shape))
    state = NestedMap(tgt=tgt)
    if 'src' in self.context:
      state.src = self.context.src.Transform(lambda x: tf.tile(x, [VOCAB, 1]))
    with py_utils.EvalMode():
      nll = self.task.stack.FProp(self.task.stack.theta, state).nll.numpy()
    return -nll.reshape([VOCAB, rows, -1]).transpose([1, 2, 0])

  def Greedy(self, ids, start, eos_id):
    """(tokens, lengths, scores) of greedy decoding, one row and step at a time."""
    ids = np.array(ids)
    tokens = np.zeros_like(ids)
    lengths = np.zeros(len(ids), np.int32)
    scores = np.zeros(len(ids))
    for b in range(len(ids)):
      for pos in range(start[b], SEQ_LEN):
        log_probs = self.LogProbs(ids)[b, pos]
        chosen = int(np.argmax(log_probs))
        tokens[b, pos], scores[b] = chosen, scores[b] + log_probs[chosen]
        lengths[b] += 1
        if pos + 1 < SEQ_LEN:
          ids[b, pos + 1] = chosen
        if chosen == eos_id:
          break
    return tokens, lengths, scores


def _CheckGreedy(task, make_task):
  batch = _Batch(task)
  out = _Decode(task, batch)
  tokens, lengths, scores = _Reference(make_task, batch).Greedy(out['ids'], out['start'],
                                                               task.params.decoder.eos_id)
  np.testing.assert_array_equal(out['tokens'], tokens)
  np.testing.assert_array_equal(out['lengths'], lengths)
  np.testing.assert_allclose(out['scores'], scores, rtol=1e-5, atol=1e-5)
  return out


# -- tests ----------------------------------------------------------------------------------


@pytest.mark.parametrize('make_task', [_Lm, _Mt], ids=['lm', 'mt'])
def testDecodeLogProbsEqualTheTeacherForcedForward(make_task):
  task = make_task()
  batch = _Batch(task)
  problem = task.DecodeProblem(batch)
  ids = problem.ids.numpy()
  positions = np.arange(len(ids)) % SEQ_LEN
  with py_utils.EvalMode():
    got = task.DecodeLogProbs(task.theta, problem.context, problem.ids,
                              tf.constant(positions, tf.int32)).numpy()
  want = _Reference(make_task, batch).LogProbs(ids)[np.arange(len(ids)), positions]
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zb_h1'])
def testGreedyLmEqualsAReferenceLoop(schedule):
  out = _CheckGreedy(_Lm(schedule=schedule, micro_batches=4), _Lm)
  # The prompt is `bos source sep`: the ids up to the first weighted label, and no more.
  batch = _Batch(_Lm())
  for b, start in enumerate(out['start']):
    weights = batch.weights.numpy()[b]
    assert start == np.argmax(weights > 0)
    np.testing.assert_array_equal(out['ids'][b, :start + 1], batch.ids.numpy()[b, :start + 1])
    assert not out['ids'][b, start + 1:].any()


@pytest.mark.parametrize('dtype', [tf.float16, tf.bfloat16])
@pytest.mark.parametrize('algorithm', ['greedy', 'beam'])
def testAHalfPrecisionModelDecodesWithFloat32Scores(dtype, algorithm):
  """Half-precision log-probs are summed in float32; greedy equals the same-dtype reference."""
  def Make(**kwargs):
    return _Task('lm', kwargs.pop('splits', 2), kwargs.pop('micro_batches', 2),
                 kwargs.pop('schedule', '1f1b'), dict(algorithm=algorithm), fprop_dtype=dtype)

  task = Make()
  out = _Decode(task, _Batch(task))
  assert out['scores'].dtype == np.float32 and np.all(np.isfinite(out['scores']))
  assert np.all((out['tokens'] >= 0) & (out['tokens'] < VOCAB))
  if algorithm == 'greedy':
    batch = _Batch(task)
    tokens, _, _ = _Reference(Make, batch).Greedy(out['ids'], out['start'],
                                                  task.params.decoder.eos_id)
    np.testing.assert_array_equal(out['tokens'], tokens)


def testGreedyMtEqualsAReferenceLoop():
  out = _CheckGreedy(_Mt(), _Mt)
  assert not out['start'].any()  # From bos on.


def testAnExampleOfATranslationShowsItsSourceAsThePrompt():
  task = _Mt()
  batch = _Batch(task)
  examples = decoder.Examples(_Numpy(decoder.Decode(task, task.theta, batch)))
  src = batch.src
  for b, (prompt, _, _) in enumerate(examples):
    want = src.ids[b].numpy()[src.paddings[b].numpy() == 0].tolist()
    assert prompt == want and len(want) >= 2, (b, prompt, want)


def testDecodingStopsAtEos():
  first = _Decode(_Lm(eos_id=None), _Batch(_Lm()))
  rows = np.arange(len(first['start']))
  eos = int(first['tokens'][rows[0], first['start'][0]])  # Row 0's first decoded id.
  out = _Decode(_Lm(eos_id=eos), _Batch(_Lm()))
  for b, start in enumerate(out['start']):
    decoded = out['tokens'][b, start:start + out['lengths'][b]]
    assert eos not in decoded[:-1]
    assert decoded[-1] == eos or start + len(decoded) == SEQ_LEN
    assert not out['tokens'][b, start + len(decoded):].any()
  assert out['lengths'][0] == 1
  assert (first['lengths'] == SEQ_LEN - first['start']).all()  # No eos: to the end.


def testBeamSearchOfEveryIdFindsTheBestContinuation():
  """Beam size V over two steps keeps every first id, so it finds the best of all V^2
  continuations, which the reference scores one by one."""
  task = _Lm(algorithm='beam', beam_size=VOCAB, eos_id=None, prompt_len=SEQ_LEN - 1)
  batch = _Batch(task)
  out = _Decode(task, batch)
  reference = _Reference(_Lm, batch)
  ids = out['ids']
  for b in range(len(ids)):
    rows = np.tile(ids[b:b + 1], [VOCAB, 1])
    rows[:, SEQ_LEN - 1] = np.arange(VOCAB)  # Each first id, the input after SEQ_LEN - 2.
    log_probs = reference.LogProbs(rows)
    scores = {(first, second): log_probs[first, SEQ_LEN - 2, first] +
              log_probs[first, SEQ_LEN - 1, second]
              for first, second in itertools.product(range(VOCAB), repeat=2)}
    best = max(scores, key=scores.get)
    best_score = scores[best]
    assert tuple(out['tokens'][b, SEQ_LEN - 2:]) == best
    np.testing.assert_allclose(out['scores'][b], best_score, rtol=1e-5)


@pytest.mark.parametrize('make_task', [_Lm, _Mt], ids=['lm', 'mt'])
def testBeamOfOneAndTopOneSamplingAreGreedy(make_task):
  greedy = _Decode(make_task(), _Batch(make_task()))
  for decoding in (dict(algorithm='beam', beam_size=1),
                   dict(algorithm='sample', top_k=1, temperature=0.5)):
    out = _Decode(make_task(**decoding), _Batch(make_task()))
    for key in ('tokens', 'lengths'):
      np.testing.assert_array_equal(out[key], greedy[key], err_msg=str(decoding))


def testBeamScoresAreTheirSequencesLogProbabilities():
  task = _Mt(algorithm='beam', beam_size=3, length_penalty=0.6)
  batch = _Batch(task)
  out = _Decode(task, batch)
  reference = _Reference(_Mt, batch)
  ids = out['ids'].copy()
  for b, length in enumerate(out['lengths']):
    ids[b, 1:length] = out['tokens'][b, :length - 1]
  log_probs = reference.LogProbs(ids)
  for b, length in enumerate(out['lengths']):
    want = sum(log_probs[b, t, out['tokens'][b, t]] for t in range(length))
    np.testing.assert_allclose(out['scores'][b], want, rtol=1e-5, atol=1e-5)


def testSamplingDrawsFromTheTopKAndRepeatsPerSeed():
  batch = _Batch(_Lm())
  out = _Decode(_Lm(algorithm='sample', top_k=3, temperature=2.0, eos_id=None), batch)
  again = _Decode(_Lm(algorithm='sample', top_k=3, temperature=2.0, eos_id=None), batch)
  other = _Decode(_Lm(algorithm='sample', top_k=3, temperature=2.0, eos_id=None, seed=7), batch)
  np.testing.assert_array_equal(out['tokens'], again['tokens'])
  assert (out['tokens'] != other['tokens']).any()
  ids = out['ids'].copy()
  for b, start in enumerate(out['start']):
    ids[b, start + 1:] = out['tokens'][b, start:SEQ_LEN - 1]
  log_probs = _Reference(_Lm, batch).LogProbs(ids)
  for b, start in enumerate(out['start']):
    for t in range(start, SEQ_LEN):
      top3 = np.argsort(-log_probs[b, t])[:3]
      assert out['tokens'][b, t] in top3, (b, t)


def testExactMatchAndBleuByHand():
  eos = 2
  p = decoder.DecoderParams().Set(eos_id=eos)
  examples = [([1], [5, 6, 7, 8, eos], [5, 6, 7, 8, 9, eos]),  # 4 of 5 ids, all n-grams right.
              ([1], [4, eos], [4, eos])]
  means = {k: v[0] / 1.0 for k, v in decoder.BatchMetrics(examples, p).items()}
  final = decoder.FinalMetrics(means)
  assert final['exact_match'] == 0.5
  # Precisions 5/5, 3/3, 2/2, 1/1 (hypotheses of 4 and 1 ids); brevity exp(1 - 6/5).
  np.testing.assert_allclose(final['bleu'], 100 * math.exp(1 - 6 / 5))
  perfect = [([1], [4, 5, 6, 7, eos], [4, 5, 6, 7, eos])]
  assert decoder.FinalMetrics({k: v[0] for k, v in decoder.BatchMetrics(
      perfect, p).items()})['bleu'] == pytest.approx(100.0)
  assert decoder.Bleu({k: v[0] for k, v in decoder.BleuStats(
      [([1], [9, 9], [4, 5])], p).items()}) == 0.0


def testBleuOfByteTextCountsWords():
  """Byte text is scored on its words: 'the cat sat on' against 'the cat sat on the mat' has
  every n-gram right (4, 3, 2, 1 of them) and a brevity penalty of exp(1 - 6/4); on bytes the
  same decode would score otherwise."""
  p = decoder.DecoderParams().Set(eos_id=None, detokenize='bytes')
  hyp, ref = list(b'the cat  sat\non'), list(b'the cat sat on the mat')
  stats = {k: v[0] for k, v in decoder.BleuStats([([1], hyp, ref)], p).items()}
  assert stats['bleu_hyp_len'] == 4 and stats['bleu_ref_len'] == 6
  np.testing.assert_allclose(decoder.Bleu(stats), 100 * math.exp(1 - 6 / 4))
  ids = decoder.DecoderParams().Set(eos_id=None)
  on_ids = {k: v[0] for k, v in decoder.BleuStats([([1], hyp, ref)], ids).items()}
  assert on_ids['bleu_hyp_len'] == len(hyp) and decoder.Bleu(on_ids) != decoder.Bleu(stats)


def testExportServesAnyBatchAndLength(tmp_path):
  task = _Lm()
  export_dir = decoder.Export(task, str(tmp_path / 'export'))
  serve = tf.saved_model.load(export_dir).signatures['serving_default']
  reference = _Reference(_Lm, _Batch(task))
  for prompts in ([[1, 5, 6, 3]], [[1, 7, 3, 0, 0], [1, 4, 5, 6, 3], [1, 6, 5, 3, 0]]):
    lengths = np.array([len([i for i in p if i]) for p in prompts], np.int32)
    out = _Numpy(serve(ids=tf.constant(prompts, tf.int32), lengths=tf.constant(lengths)))
    ids = np.zeros([len(prompts), SEQ_LEN], np.int32)
    for b, prompt in enumerate(prompts):
      ids[b, :lengths[b]] = prompt[:lengths[b]]
    tokens, want_lengths, _ = reference.Greedy(ids, lengths - 1, task.params.decoder.eos_id)
    np.testing.assert_array_equal(out['start'], lengths - 1)
    np.testing.assert_array_equal(out['tokens'], tokens)
    np.testing.assert_array_equal(out['lengths'], want_lengths)
  with pytest.raises(tf.errors.InvalidArgumentError, match='max_seq_len=8'):
    serve(ids=tf.ones([1, SEQ_LEN + 1], tf.int32), lengths=tf.constant([2]))


@pytest.mark.parametrize('key,value,expected', [
    ('algorithm', 'nucleus', "one of ['greedy', 'sample', 'beam']"),
    ('temperature', 0.0, 'a finite number > 0'),
    ('temperature', float('nan'), 'a finite number > 0'),
    ('top_k', -1, 'an int >= 0'),
    ('beam_size', 0, 'an int >= 1'),
    ('length_penalty', 'long', 'a finite number'),
    ('eos_id', -2, 'an int >= 0, or None'),
    ('prompt_len', 0, 'an int >= 1, or None'),
    ('detokenize', 'utf8', "one of ['ids', 'bytes']"),
])
def testBadDecoderParamsAreOneValueError(key, value, expected):
  with pytest.raises(ValueError) as e:
    _Lm(**{key: value})
  assert f'lm.decoder.{key}={value!r}: expected {expected}.' in str(e.value)


def testAPromptAsLongAsTheSequenceIsRefused():
  task = _Lm(prompt_len=SEQ_LEN)
  with pytest.raises(ValueError, match='prompt_len=8 leaves nothing to decode'):
    task.DecodeProblem(_Batch(task))


def testDecodeLinesAndMarkdown():
  p = decoder.DecoderParams().Set(detokenize='bytes', eos_id=2)
  line = decoder.Line(p, (list(b'a\tb'), list(b'c|\n') + [2], list(b'c|\n') + [2]))
  assert line == '1\ta\\tb\tc|\\n\tc|\\n'
  table = decoder.Markdown([line]).splitlines()
  assert table[0] == '| match | prompt | hypothesis | reference |'
  assert table[2] == '| 1 | a\\tb | c\\|\\n | c\\|\\n |'
