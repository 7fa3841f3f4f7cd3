"""Decoding a sequence task: greedy, sampled and beam-search sequences.

Each decoding step runs the task's pipelined forward, in evaluation mode, over
the whole [B, T] sequence so far and reads each row's next-id log-probabilities
at its current position (the softmax's decode_positions, state_layers).
Causal self-attention keeps a position blind to the ids after it, so the part
not decoded yet changes nothing. Nothing is cached between steps: a step costs
one forward of T positions, and the decoded model is exactly the trained one
at any cut, schedule or micro-batch count.

Positions are those of the labels: the output at position t predicts label t,
which is the id at t + 1. A task states its problem (DecodeProblem):

  ids      [B, T] int32: the first start + 1 of each row are its prompt;
  start    [B] int32: the first label position decoded;
  targets  [B, T] int32 and target_weights [B, T]: the reference, read from
           `start` on where its weight is > 0;
  context  NestedMap of [B, ...] tensors the step reads besides ids (the source
           of a translation), or empty.

and answers a step (DecodeLogProbs(theta, context, ids, positions) -> [B, V]).
"""

import collections
import math

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils

ALGORITHMS = ('greedy', 'sample', 'beam')
DETOKENIZERS = ('ids', 'bytes')
# A log-probability no hypothesis reaches, finite so that sums and divisions stay finite.
_NEVER = -1e9
BLEU_ORDER = 4


def DecoderParams():
  """How a sequence task decodes (its `decoder` params)."""
  p = hyperparams.Params()
  p.Define('algorithm', 'greedy', f'One of {list(ALGORITHMS)}.')
  p.Define('temperature', 1.0, 'sample: the log-probabilities are divided by this (> 0).')
  p.Define('top_k', 0, 'sample: draw from the k most likely ids only (0: from all).')
  p.Define('beam_size', 4, 'beam: hypotheses kept per example.')
  p.Define('length_penalty', 0.0,
           "beam: alpha of GNMT's ((5 + length) / 6) ** alpha, which divides each "
           "hypothesis' log-probability when the best is chosen (0: plain log-probability).")
  p.Define('eos_id', 2, 'The id that ends a sequence (None: decode to the full length).')
  p.Define('bos_id', 1, 'Exported encoder-decoders: the first id of every target.')
  p.Define('prompt_len', None,
           'Language models: ids given as the prompt (None: up to the first label that '
           'carries weight, e.g. `bos source sep` of the synthetic tasks).')
  p.Define('seed', 1234, 'sample: seed of the stateless draws (a checkpoint and batch '
           'decode the same every time).')
  p.Define('detokenize', 'ids', f'How decodes are written: one of {list(DETOKENIZERS)} '
           '(ids: space-separated numbers; bytes: the UTF-8 text of byte ids).')
  return p


def _IsInt(value):
  return isinstance(value, int) and not isinstance(value, bool)


def CheckDecoderParams(where, p):
  """Raises a ValueError naming a decoder setting no decode can use."""
  def Bad(key, expected):
    raise ValueError(f'{where}.decoder.{key}={p.Get(key)!r}: expected {expected}.')

  if p.algorithm not in ALGORITHMS:
    Bad('algorithm', f'one of {list(ALGORITHMS)}')
  if p.detokenize not in DETOKENIZERS:
    Bad('detokenize', f'one of {list(DETOKENIZERS)}')
  temperature = p.temperature
  if (isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or
      not 0 < temperature < float('inf')):
    Bad('temperature', 'a finite number > 0')
  for key, low in (('top_k', 0), ('beam_size', 1), ('seed', 0)):
    if not _IsInt(p.Get(key)) or p.Get(key) < low:
      Bad(key, f'an int >= {low}')
  alpha = p.length_penalty
  if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
    Bad('length_penalty', 'a finite number')
  if p.eos_id is not None and (not _IsInt(p.eos_id) or p.eos_id < 0):
    Bad('eos_id', 'an int >= 0, or None')
  if not _IsInt(p.bos_id) or p.bos_id < 0:
    Bad('bos_id', 'an int >= 0')
  if p.prompt_len is not None and (not _IsInt(p.prompt_len) or p.prompt_len < 1):
    Bad('prompt_len', 'an int >= 1, or None')


def Decode(task, theta, input_batch):
  """Decodes input_batch by task.params.decoder: NestedMap of

    tokens  [B, T] int32: the decoded labels at their positions (0 elsewhere);
    start   [B], lengths [B]: the decoded labels are tokens[start:start + lengths],
            eos included;
    scores  [B] float32: their summed log-probability;
    ids, targets, target_weights: the problem's (prompts and references);
    source, source_lengths: a translation's source ids and their count (context.src).
  """
  problem = task.DecodeProblem(input_batch)
  out = py_utils.NestedMap(_Search(task, theta, problem), start=problem.start, ids=problem.ids,
                           targets=problem.targets, target_weights=problem.target_weights)
  if 'src' in problem.context:
    src = problem.context.src
    out.source = src.ids
    out.source_lengths = tf.cast(tf.reduce_sum(1.0 - src.paddings, 1), tf.int32)
  return out


def _Search(task, theta, problem):
  """NestedMap(tokens, scores, lengths) of a problem, by task.params.decoder.algorithm."""
  p = task.params.decoder

  def LogProbs(context, ids, positions):
    # Scores add up in float32, whatever the model computes in (float16, bfloat16).
    return tf.cast(task.DecodeLogProbs(theta, context, ids, positions), tf.float32)

  with py_utils.EvalMode():
    if p.algorithm == 'beam':
      return _BeamSearch(p, problem, LogProbs)
    return _OneByOne(p, problem, LogProbs)


def Export(task, export_dir):
  """Writes a SavedModel whose 'serving_default' signature decodes as the task's decoder
  params say, for any batch: it takes task.ServingSpecs() (a language model's prompts
  `ids` [B, L] and their `lengths` [B]; an encoder-decoder's `src_ids` and `src_lengths`),
  decodes up to the model's max_seq_len and returns tokens [B, max_seq_len], start [B] and
  lengths [B] (the decode is tokens[b, start:start + lengths], eos included) and scores [B].
  Serving it needs only TensorFlow. Returns export_dir.
  """
  def Serve(**features):
    problem = task.ServingProblem(features)
    out = _Search(task, task.theta, problem)
    return dict(tokens=out.tokens, start=problem.start, lengths=out.lengths, scores=out.scores)

  serving = tf.function(Serve, autograph=False).get_concrete_function(**task.ServingSpecs())
  module = tf.Module()
  module.task = task
  tf.saved_model.save(module, export_dir, signatures={'serving_default': serving})
  return export_dir


def _Chooser(p):
  """step, log_probs [B, V] -> ids [B]: greedy's argmax, or a draw of sampling."""
  if p.algorithm == 'greedy':
    return lambda step, log_probs: tf.argmax(log_probs, -1, output_type=tf.int32)

  def Draw(step, log_probs):
    logits = log_probs / p.temperature
    if p.top_k:
      k = tf.minimum(p.top_k, tf.shape(logits)[-1])
      kth = tf.math.top_k(logits, k).values[:, -1:]
      logits = tf.where(logits < kth, _NEVER, logits)
    seed = tf.stack([tf.constant(p.seed, tf.int32), tf.cast(step, tf.int32)])
    return tf.cast(tf.random.stateless_categorical(logits, 1, seed)[:, 0], tf.int32)

  return Draw


def _At(positions, length):
  """[B, length] bool: True at each row's position."""
  return tf.equal(tf.range(length)[tf.newaxis], positions[:, tf.newaxis])


def _Written(ids, tokens, positions, chosen, active):
  """(ids, tokens) with `chosen` [B] written where `active` [B]: as the label at
  `positions` and as the id after it (the next step's input)."""
  length = tf.shape(ids)[1]
  chosen = chosen[:, tf.newaxis]
  tokens = tf.where(_At(positions, length) & active[:, tf.newaxis], chosen, tokens)
  ids = tf.where(_At(positions + 1, length) & active[:, tf.newaxis], chosen, ids)
  return ids, tokens


def _Ends(p, chosen):
  """[B] bool: which chosen ids end their sequence."""
  if p.eos_id is None:
    return tf.zeros_like(chosen, tf.bool)
  return tf.equal(chosen, p.eos_id)


def _NumSteps(problem):
  return tf.shape(problem.ids)[1] - tf.reduce_min(problem.start)


def _State(ids, scores):
  """A decode's loop state: the step, the ids so far (prompt and decode), the decoded tokens,
  which rows (hypotheses) ended, their scores and decoded lengths."""
  rows = tf.shape(ids)[0]
  return py_utils.NestedMap(step=tf.constant(0), ids=ids, tokens=tf.zeros_like(ids),
                            done=tf.zeros([rows], tf.bool), scores=scores,
                            lengths=tf.zeros([rows], tf.int32))


def _OneByOne(p, problem, log_probs_fn):
  """Greedy or sampled decoding: one id per row and step."""
  length = tf.shape(problem.ids)[1]
  choose = _Chooser(p)

  def Active(s):
    return ~s.done & (problem.start + s.step < length)

  def Continue(s):
    return (s.step < _NumSteps(problem)) & tf.reduce_any(Active(s))

  def Body(s):
    positions = tf.minimum(problem.start + s.step, length - 1)
    log_probs = log_probs_fn(problem.context, s.ids, positions)
    chosen = choose(s.step, log_probs)
    active = Active(s)
    ids, tokens = _Written(s.ids, s.tokens, positions, chosen, active)
    picked = tf.gather(log_probs, chosen, batch_dims=1)
    return py_utils.NestedMap(
        step=s.step + 1, ids=ids, tokens=tokens, done=s.done | (active & _Ends(p, chosen)),
        scores=s.scores + tf.where(active, picked, 0.0),
        lengths=s.lengths + tf.cast(active, tf.int32))

  initial = _State(problem.ids, tf.zeros([tf.shape(problem.ids)[0]], tf.float32))
  final = tf.while_loop(Continue, lambda s: [Body(s)], [initial])[0]
  return py_utils.NestedMap(tokens=final.tokens, scores=final.scores, lengths=final.lengths)


def _Beams(x, k):
  """[B, ...] -> [B * k, ...]: each row k times, one after another."""
  return tf.repeat(x, k, axis=0)


def _BeamSearch(p, problem, log_probs_fn):
  """Beam search: beam_size hypotheses per row, extended by their best continuations.

  A hypothesis that ended (eos) or reached the last position stays in the beam
  with its score, and competes with the others to the end. Hypotheses are kept
  flat, [B * k, T], so that each step is one forward of B * k rows.
  """
  k = p.beam_size
  rows, length = tf.shape(problem.ids)[0], tf.shape(problem.ids)[1]
  start = _Beams(problem.start, k)
  context = problem.context.Transform(lambda x: _Beams(x, k))
  # Only the first beam of a row is alive at first, so the k best start from it.
  first = tf.tile(tf.concat([[0.0], tf.fill([k - 1], _NEVER)], 0), [rows])

  def Frozen(s):
    return s.done | (start + s.step >= length)

  def Continue(s):
    return (s.step < _NumSteps(problem)) & ~tf.reduce_all(Frozen(s))

  def Body(s):
    positions = tf.minimum(start + s.step, length - 1)
    log_probs = log_probs_fn(context, s.ids, positions)
    vocab = tf.shape(log_probs)[-1]
    frozen = Frozen(s)
    # A frozen hypothesis has one continuation, id 0 at no cost, which changes nothing.
    stay = tf.where(tf.range(vocab) == 0, 0.0, _NEVER)[tf.newaxis]
    log_probs = tf.where(frozen[:, tf.newaxis], stay, log_probs)
    candidates = tf.reshape(s.scores[:, tf.newaxis] + log_probs, [rows, k * vocab])
    best, index = tf.math.top_k(candidates, k)
    parent = tf.reshape(index // vocab + tf.range(rows)[:, tf.newaxis] * k, [-1])
    chosen = tf.reshape(index % vocab, [-1])
    ids, tokens, done, lengths = (tf.gather(x, parent)
                                  for x in (s.ids, s.tokens, s.done, s.lengths))
    active = ~tf.gather(frozen, parent)
    ids, tokens = _Written(ids, tokens, positions, chosen, active)
    return py_utils.NestedMap(
        step=s.step + 1, ids=ids, tokens=tokens, done=done | (active & _Ends(p, chosen)),
        scores=tf.reshape(best, [-1]), lengths=lengths + tf.cast(active, tf.int32))

  final = tf.while_loop(Continue, lambda s: [Body(s)], [_State(_Beams(problem.ids, k), first)])[0]
  penalty = ((5.0 + tf.cast(final.lengths, tf.float32)) / 6.0) ** p.length_penalty
  pick = tf.argmax(tf.reshape(final.scores / penalty, [rows, k]), -1, output_type=tf.int32)
  pick += tf.range(rows) * k
  return py_utils.NestedMap(tokens=tf.gather(final.tokens, pick),
                            scores=tf.gather(final.scores, pick),
                            lengths=tf.gather(final.lengths, pick))


# -- the decodes as data ----------------------------------------------------------


def Examples(out):
  """[(prompt ids, hypothesis ids, reference ids)] of Decode's numpy outputs, one per row; a
  translation's prompt is its source (its target prompt is only the bos id)."""
  examples = []
  for b, start in enumerate(out['start']):
    start = int(start)
    hypothesis = out['tokens'][b, start:start + int(out['lengths'][b])]
    reference = out['targets'][b, start:][out['target_weights'][b, start:] > 0]
    prompt = (out['source'][b, :int(out['source_lengths'][b])] if 'source' in out else
              out['ids'][b, :start + 1])
    examples.append((prompt.tolist(), hypothesis.tolist(), reference.tolist()))
  return examples


def _NGrams(tokens, n):
  return collections.Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def _BleuUnits(p, tokens):
  """What BLEU counts of a decode: the words of byte text (p.detokenize 'bytes': the decoded
  text split at whitespace), else the ids; eos never."""
  if p.detokenize == 'bytes':
    return Text(p, tokens).split()
  return [t for t in tokens if t != p.eos_id]


def BleuStats(examples, p):
  """Sums of corpus BLEU over examples (decoder params p say what is counted, _BleuUnits):
  NestedMap of (value, 1.0) pairs, so that base_runner.Evaluate's mean over batches keeps
  their ratios."""
  stats = collections.Counter()
  for _, hypothesis, reference in examples:
    hyp, ref = _BleuUnits(p, hypothesis), _BleuUnits(p, reference)
    stats['hyp_len'] += len(hyp)
    stats['ref_len'] += len(ref)
    for n in range(1, BLEU_ORDER + 1):
      hyp_grams, ref_grams = _NGrams(hyp, n), _NGrams(ref, n)
      stats[f'match_{n}'] += sum(min(c, ref_grams[g]) for g, c in hyp_grams.items())
      stats[f'total_{n}'] += max(len(hyp) - n + 1, 0)
  keys = ['hyp_len', 'ref_len'] + [f'{kind}_{n}' for n in range(1, BLEU_ORDER + 1)
                                   for kind in ('match', 'total')]
  return py_utils.NestedMap({f'bleu_{key}': (float(stats[key]), 1.0) for key in keys})


def Bleu(stats):
  """Corpus BLEU in [0, 100] (Papineni et al.: geometric mean of the 1..4-gram precisions
  times the brevity penalty) from BleuStats' sums; 0 if any order has no match."""
  precisions = []
  for n in range(1, BLEU_ORDER + 1):
    total = stats[f'bleu_total_{n}']
    if not total or not stats[f'bleu_match_{n}']:
      return 0.0
    precisions.append(stats[f'bleu_match_{n}'] / total)
  hyp_len, ref_len = stats['bleu_hyp_len'], stats['bleu_ref_len']
  brevity = 1.0 if hyp_len > ref_len else math.exp(1.0 - ref_len / hyp_len)
  return 100.0 * brevity * math.exp(sum(math.log(x) for x in precisions) / BLEU_ORDER)


def BatchMetrics(examples, p):
  """(value, weight) pairs of one batch's decodes (decoder params p): exact_match (of the ids)
  and the BLEU sums."""
  matches = [hypothesis == reference for _, hypothesis, reference in examples]
  metrics = BleuStats(examples, p)
  metrics.exact_match = (sum(matches) / max(len(matches), 1), float(len(matches)))
  return metrics


def FinalMetrics(means):
  """exact_match and bleu from the means over batches of BatchMetrics."""
  return {'exact_match': means['exact_match'], 'bleu': Bleu(means)}


def Text(p, tokens):
  """A decode as text, by p.detokenize (bytes: eos, if any, dropped)."""
  if p.detokenize == 'bytes':
    return bytes(t % 256 for t in tokens if t != p.eos_id).decode('utf-8', errors='replace')
  return ' '.join(str(t) for t in tokens)


LINE_HEADER = 'match\tprompt\thypothesis\treference\n'


def Line(p, example):
  """One example's decodes-<step>.txt line: match (0/1), prompt, hypothesis, reference; tabs
  and newlines of byte text written as \\t and \\n."""
  _, hypothesis, reference = example
  texts = [Text(p, x).replace('\\', '\\\\').replace('\t', '\\t').replace('\n', '\\n')
           for x in example]
  return '\t'.join([str(int(hypothesis == reference))] + texts)


def Markdown(lines):
  """Decode lines as a Markdown table, for TensorBoard's text tab."""
  rows = [line.replace('|', '\\|').split('\t') for line in lines]
  header = LINE_HEADER.strip().split('\t')
  table = [header, ['---'] * len(header)] + rows
  return '\n'.join('| ' + ' | '.join(row) + ' |' for row in table)
