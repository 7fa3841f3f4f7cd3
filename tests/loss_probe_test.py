"""Tests of the probe of per-micro-batch losses (lingvo_gpipe/pipeline/loss_probe.py)."""

import gc
import itertools
import weakref

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.pipeline import loss_probe
from lingvo_gpipe.pipeline import metrics


@pytest.mark.parametrize('dtype', [tf.float32, tf.bfloat16, tf.float16])
def testTheProbeTellsSumsAndMeansAndRefusesBatchStatistics(dtype):
  """16-bit losses are probed in float32: an exact mean or sum is told (a bfloat16 probe
  raised inside numpy), and so is a small batch-statistic term that 16-bit rounding hides;
  a statistic of an output minus a target is refused too (targets are probed with their
  micro-batches' ranges in reverse order: in the same order they cancelled)."""
  part = tf.ones([4, 8], dtype)  # One micro-batch of 4 rows; 4 of them make 16.
  mean = loss_probe.MicroBatchLoss(tf.reduce_mean, 4, 16, 0, '1f1b')(part)
  assert [float(x) for x in mean] == [1.0, 0.25]  # (value, rows / batch)
  total = loss_probe.MicroBatchLoss(tf.reduce_sum, 4, 16, 0, '1f1b')(part)
  assert [float(x) for x in total] == [128.0, 0.25]  # (value x M, 1 / M)
  for loss_fn in (lambda y, t: tf.reduce_max(y),
                  lambda y, t: tf.reduce_mean(tf.square(y - t)) + 0.05 * tf.square(
                      tf.reduce_mean(y)),
                  lambda y, t: tf.math.reduce_variance(y - t)):
    wide = tf.ones([4, 1024], dtype)  # Wide: sampling noise alone would not tell them.
    with pytest.raises(ValueError, match='is neither the sum .* nor the mean'):
      loss_probe.MicroBatchLoss(loss_fn, 4, 16, 0, '1f1b')(wide, wide)


def testALossOfProbabilitiesIsProbedWithinZeroAndOne():
  """A binary cross-entropy on probabilities is finite on the probe: told as a mean."""
  def CrossEntropy(p, t):
    return -tf.reduce_mean(t * tf.math.log(p) + (1 - t) * tf.math.log(1 - p))

  half = tf.fill([4, 8], 0.5)
  value, weight = loss_probe.MicroBatchLoss(CrossEntropy, 4, 16, 0, '1f1b')(half, half)
  assert float(value) == pytest.approx(np.log(2)) and float(weight) == 0.25


def testALossThatIsZeroOnEveryProbeCannotBeTold():
  """A loss that is 0 on every probe's outputs is the sum and the mean of its micro-batch
  values alike: refused, not guessed."""
  with pytest.raises(ValueError, match=r"random outputs \(0, not finite, or as much as the sum "
                     r'of its micro-batch values as their mean\) cannot tell which'):
    loss_probe.MicroBatchLoss(lambda y: 0.0 * tf.reduce_mean(y), 4, 16, 0, '1f1b')(tf.ones([4, 8]))


def testAPenaltyOnNegativeOutputsIsToldByTheSignedProbe():
  """The first probe's outputs are positive: a penalty on negative outputs is 0 there (it
  was refused); the signed probe tells it a mean."""
  value, weight = loss_probe.MicroBatchLoss(lambda y: tf.reduce_mean(tf.nn.relu(-y)), 4, 16, 0,
                                         '1f1b')(-tf.ones([4, 8]))
  assert (float(value), float(weight)) == (1.0, 0.25)


def testTheProbeInAStepsGraphHoldsNoCopyOfTheOutputs():
  """Probe outputs are random ops: a [8, 512, 2048] output (32 MB) adds no constant."""
  like = tf.TensorSpec([2, 512, 2048], tf.float32)
  graph = tf.function(
      lambda: loss_probe._ProbeInput(like, [2, 2, 2, 2], 0, 0, True)).get_concrete_function()
  assert graph.graph.as_graph_def().ByteSize() < 10000
  values = graph().numpy()
  assert values.shape == (8, 512, 2048)
  for m in range(4):  # Micro-batch m's values lie within 0.05 of 0.5 + 0.35 (m - 1) / 3.
    part = values[2 * m:2 * m + 2] - (0.5 + 0.35 * (m - 1) / 3)
    assert np.abs(part).max() <= 0.05 + 1e-6


def testAMeanNearZeroIsToldAsAMeanNotASum():
  """mean(y - t) on wide outputs: targets from other ranges than outputs keep its whole-batch
  value away from 0, where the sum and the mean of micro-batch values would both match (it
  was told as a sum, M times the loss, once the probe's noise fell below the tolerance)."""
  wide = tf.ones([4, 65536])
  value, weight = loss_probe.MicroBatchLoss(lambda y, t: tf.reduce_mean(y - t), 4, 16, 0, '1f1b')(
      wide, wide - 1.0)
  assert float(value) == 1.0 and float(weight) == 0.25  # A mean: (value, rows / batch).


@pytest.mark.parametrize('dtype', [tf.bfloat16, tf.float16])
def testSixteenBitLossesThatFixTheirDType(dtype):
  """A loss multiplying by a constant of its dtype cannot take the float32 probe: probed in
  its own dtype; one casting to it is compared at its precision. Both are means."""
  part = tf.ones([4, 8], dtype)
  for loss_fn in (lambda y: tf.reduce_mean(y * tf.constant(2.0, dtype)),
                  lambda y: tf.reduce_mean(tf.square(tf.cast(y, dtype)))):
    value, weight = loss_probe.MicroBatchLoss(loss_fn, 4, 16, 0, '1f1b')(part)
    assert float(weight) == 0.25, loss_fn


@pytest.mark.parametrize('num_parts,batch', [(2, 8), (3, 7), (4, 16), (8, 8)])
def testBatchStatisticsOfAnyOutputMinusAnyTargetAreRefused(num_parts, batch):
  """Two outputs and two targets: the variance and the absolute mean of the difference of
  any two of them are refused. Each tensor's micro-batches follow a line of its own, and
  any two lines cross: outputs and targets that alternated between two orders left y1 - t1
  the same in every micro-batch (its variance was told as a mean), and lines that did not
  cross kept the sign of a difference (|mean(y1 - t1)| was told as a mean: on micro-batch
  errors of alternating sign, a loss of 1.0 against the whole batch's 0.0)."""
  part = tf.ones([batch // num_parts, 1024])
  for a, b in itertools.combinations(range(4), 2):
    for statistic in (tf.math.reduce_variance, lambda x: tf.abs(tf.reduce_mean(x))):
      loss_fn = lambda *ts, a=a, b=b, statistic=statistic: statistic(ts[a] - ts[b])
      with pytest.raises(ValueError, match='is neither the sum .* nor the mean'):
        loss_probe.MicroBatchLoss(loss_fn, num_parts, batch, 0, '1f1b')(part, part, part, part)


def testAKerasLossOfAnEmptyMicroBatchWeighsNothing():
  """3 rows, M=4: Keras returns the loss of the empty micro-batch unreduced (shape (0,));
  it is 0, of weight 0, and the other micro-batches keep their shares of the batch."""
  import keras  # pylint: disable=g-import-not-at-top
  loss_fn = loss_probe.MicroBatchLoss(keras.losses.MeanSquaredError(), 4, 3, 0, '1f1b')
  value, weight = loss_fn(tf.ones([1, 8]), tf.zeros([1, 8]))
  assert (float(value), float(weight)) == (1.0, pytest.approx(1 / 3))
  value, weight = loss_fn(tf.ones([0, 8]), tf.zeros([0, 8]))
  assert (float(value), float(weight)) == (0.0, 0.0)


def _CrossEntropy(logits, labels):
  return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.maximum(labels, 0), logits)


def _BalancedCrossEntropy(logits, labels):
  """Rows weighted by 1 / their class's count in the batch."""
  labels = tf.maximum(labels, 0)
  weights = 1.0 / tf.gather(tf.cast(tf.math.bincount(labels, minlength=3), logits.dtype), labels)
  return tf.reduce_sum(_CrossEntropy(logits, labels) * weights) / tf.reduce_sum(weights)


def _MaskedMean(logits, labels, padding=-1):
  """A mean over the rows whose label is not `padding`."""
  mask = tf.cast(tf.not_equal(labels, padding), logits.dtype)
  return tf.reduce_sum(_CrossEntropy(logits, labels) * mask) / tf.reduce_sum(mask)


def _KerasIgnoring(padding):
  import keras  # pylint: disable=g-import-not-at-top
  xent = keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=padding)
  return lambda y, t, w: xent(tf.where(tf.equal(t, -1), tf.zeros_like(t), t), y)  # -1: a class.


# Losses that do not merge. A review found all but the division by the sum of sample
# weights accepted when the only probe's outputs lay within (0.2, 0.8) and its int labels
# were 0: on its data, the pipelined loss was another number than the whole batch's.
_NOT_MERGING = {
    'relu of a mean': lambda y, t, w: tf.nn.relu(tf.reduce_mean(y)),
    'abs of a mean': lambda y, t, w: tf.abs(tf.reduce_mean(y)),
    'hinge of a mean product': lambda y, t, w: tf.nn.relu(1.0 - tf.reduce_mean(y * w[:, None])),
    'mse capped at 1': lambda y, t, w: tf.minimum(tf.reduce_mean(tf.square(y - w[:, None])), 1.0),
    'masked mean': lambda y, t, w: _MaskedMean(y, t),
    'masked mean ignoring -100': lambda y, t, w: _MaskedMean(y, t, padding=-100),
    'keras ignore_class=-100 in a lambda': _KerasIgnoring(-100),
    'mean over positive targets': lambda y, t, w: tf.reduce_sum(
        tf.abs(y[:, 0] - y[:, 1]) * tf.cast(y[:, 1] > 0, y.dtype)) / tf.reduce_sum(
            tf.cast(y[:, 1] > 0, y.dtype)),
    'class-balanced': lambda y, t, w: _BalancedCrossEntropy(y, t),
    'by the sum of sample weights': lambda y, t, w: tf.reduce_sum(
        _CrossEntropy(y, t) * w) / tf.reduce_sum(w),
    '(masked mean, rows)': lambda y, t, w: (_MaskedMean(y, t), tf.cast(tf.shape(y)[0], y.dtype)),
}


def _Batch(rows, seed, scales=(1.0,)):
  """Signed logits, labels 0..2 with some -1 or -100 (padding), positive sample weights;
  the rows in len(scales) consecutive groups, the logits and weights of each times its
  scale, and each group's share of padding its own."""
  rng = np.random.default_rng(seed)
  groups = np.repeat(np.arange(len(scales)), rows // len(scales))
  scale = np.asarray(scales)[groups][:, None]
  logits = (rng.normal(0.0, 2.0, [rows, 3]) + rng.normal(0.0, 1.0, [rows, 1]) * np.arange(3))
  padding = rng.uniform(size=rows) < (0.1 + 0.6 * groups / len(scales))
  labels = np.where(padding, rng.choice([-1, -100], rows), rng.integers(0, 3, rows))
  return (tf.constant(logits * scale, tf.float32), tf.constant(labels, tf.int32),
          tf.constant(rng.uniform(0.1, 2.0, rows) * np.abs(scale[:, 0]), tf.float32))


@pytest.mark.parametrize('num_parts,batch', [(2, 8), (3, 7), (4, 16), (8, 8), (4, 3)])
@pytest.mark.parametrize('name', sorted(_NOT_MERGING))
def testLossesThatDoNotMergeAreRefused(name, num_parts, batch):
  loss_fn = _NOT_MERGING[name]
  # They do not merge: on a batch of random data, the whole batch's value is neither the
  # sum nor the row-weighted mean of its micro-batch values.
  whole = _Batch(24, seed=3, scales=(0.1, -0.5, 1.0, -3.0))
  sizes = [6, 6, 6, 6]
  values = [loss_fn(*part) for part in zip(*(tf.split(x, sizes) for x in whole))]
  values = [v[0] if isinstance(v, tuple) else v for v in values]
  value = loss_fn(*whole)
  value = float(value[0] if isinstance(value, tuple) else value)
  assert abs(value - float(tf.add_n(values))) > 1e-3
  assert abs(value - float(tf.add_n(values)) / 4) > 1e-3
  part = _Batch(max(batch // num_parts, 1), seed=0)
  with pytest.raises(ValueError, match='is neither the sum|is not the weighted mean'):
    loss_probe.MicroBatchLoss(loss_fn, num_parts, batch, 0, '1f1b')(*part)


def _KerasLosses():
  import keras  # pylint: disable=g-import-not-at-top
  losses = keras.losses
  return {
      'keras mse': lambda y, t, w: losses.MeanSquaredError()(tf.nn.softmax(y),
                                                             tf.nn.softmax(y * w[:, None])),
      'keras weighted mse': lambda y, t, w: losses.MeanSquaredError()(
          tf.nn.softmax(y), tf.nn.softmax(2 * y), sample_weight=w),
      'keras sparse xent': lambda y, t, w: losses.SparseCategoricalCrossentropy(
          from_logits=True)(tf.maximum(t, 0), y),
      'keras weighted xent': lambda y, t, w: losses.CategoricalCrossentropy(from_logits=True)(
          tf.one_hot(tf.maximum(t, 0), 3), y, sample_weight=w),
      'keras ignore_class function': lambda y, t, w: tf.reduce_mean(
          losses.sparse_categorical_crossentropy(tf.maximum(t, -1), y, from_logits=True,
                                                 ignore_class=-1)),
      'keras huber': lambda y, t, w: losses.Huber()(y, y * w[:, None]),
      'keras cosine': lambda y, t, w: losses.CosineSimilarity()(y, y + w[:, None]),
  }


_MERGING = {
    'sum': lambda y, t, w: tf.reduce_sum(tf.square(y)),
    'mean of relu': lambda y, t, w: tf.reduce_mean(tf.nn.relu(y - 1.0)),
    'sample-weighted mean': lambda y, t, w: tf.reduce_mean(_CrossEntropy(y, t) * w),
    '(masked mean, count)': lambda y, t, w: (_MaskedMean(y, t),
                                             tf.reduce_sum(tf.cast(t != -1, y.dtype))),
    '(weighted mean, sum of weights)': lambda y, t, w: (
        tf.reduce_sum(_CrossEntropy(y, t) * w) / tf.reduce_sum(w), tf.reduce_sum(w)),
}


def _AssertMergesToTheWholeBatchs(loss_fn, whole, num_parts, name):
  """loss_fn's metrics on num_parts micro-batches of `whole`, wrapped by MicroBatchLoss and
  merged, equal its value on `whole` (1e-5)."""
  batch = int(whole[0].shape[0])
  wrapped = loss_probe.MicroBatchLoss(loss_fn, num_parts, batch, 0, '1f1b')
  sizes = [len(p) for p in np.array_split(np.arange(batch), num_parts)]
  parts = zip(*(tf.split(x, sizes) for x in whole))
  merged = metrics.MergeMetrics([metrics.AsMetrics(wrapped(*part)) for part in parts])
  expected = loss_fn(*whole)
  expected = expected[0] if isinstance(expected, tuple) else expected
  np.testing.assert_allclose(float(merged.loss[0]), float(expected), rtol=1e-5, err_msg=name)


@pytest.mark.parametrize('num_parts,batch', [(2, 8), (3, 7), (4, 16), (8, 8)])
def testLossesThatMergeAreAcceptedAndMergeToTheWholeBatchsValue(num_parts, batch):
  """Sums, means and pairs, plain and Keras, pass every probe; their micro-batch metrics
  merge to the whole batch's value on random data of either sign with padding labels."""
  whole = _Batch(batch, seed=5)
  for name, loss_fn in {**_MERGING, **_KerasLosses()}.items():
    _AssertMergesToTheWholeBatchs(loss_fn, whole, num_parts, name)


def testALossThatIsAMeanOnOneProbeAndASumOnAnotherIsRefused():
  """A sum of the outputs where all are 0 or 1, else their mean: either rule would weigh
  some batches wrong."""
  def SumOfZerosAndOnes(y):
    binary = bool(tf.reduce_all((y == 0.0) | (y == 1.0)))
    return tf.reduce_sum(y) if binary else tf.reduce_mean(y)

  with pytest.raises(ValueError, match=r'outputs of 0 and 1 .* is the sum of its micro-batch '
                     r'values, but the mean on outputs within \(0\.2, 0\.8\)'):
    loss_probe.MicroBatchLoss(SumOfZerosAndOnes, 4, 16, 0, '1f1b')(tf.fill([4, 8], 0.5))


def testTheFurtherProbesStayWithinTheirBudgetOfNumbers(monkeypatch):
  """Outputs too large for 8 parts of 4 rows are probed on M parts of 4, 3, 2 or 1 rows: a
  masked mean is refused on those too. (The budget is lowered here: a row holds 9 numbers,
  8 logits and a label.)"""
  logits, labels = tf.ones([2, 8]), tf.zeros([2], tf.int32)  # M=4 of batch 8: 2 rows each.
  loss = loss_probe.MicroBatchLoss(lambda y, t: _MaskedMean(y, t), 4, 8, 0, '1f1b')
  for numbers, sizes in ((9 * 32, [4] * 8), (9 * 16, [4] * 4), (9 * 12, [3] * 4),
                         (9 * 11, [2] * 4), (9 * 8, [2] * 4), (9 * 7, [1] * 4), (1, [1] * 4)):
    monkeypatch.setattr(loss_probe, '_FURTHER_NUMBERS', numbers)
    assert loss._FurtherSizes((logits, labels)) == sizes
  for numbers in (9 * 8, 1):  # Parts of 2 rows, and of 1 (a part of padding only: 0 / 0).
    monkeypatch.setattr(loss_probe, '_FURTHER_NUMBERS', numbers)
    with pytest.raises(ValueError, match='is neither the sum'):
      loss_probe.MicroBatchLoss(lambda y, t: _MaskedMean(y, t), 4, 8, 0, '1f1b')(logits, labels)


@pytest.mark.parametrize('batch', [16, 10])
def testLossesOfMasksLengthsAndGradesThatMergeAreAccepted(batch):
  """Found refused by review: a mean over a float 0/1 mask weighed by its non-zeros (pairs
  are probed on outputs of 0 and 1, as masks are; on even micro-batches only), a mean of
  per-sequence means over int lengths (0 on the first probe: a division by 0), a pairwise
  loss over int relevance grades (labels that vary within a row), and a loss given a
  string tensor. Each merges to the whole batch's value on data of their kind."""
  rng = np.random.default_rng(7)
  logits = tf.constant(rng.normal(size=[batch, 5]), tf.float32)
  mask = tf.constant(rng.uniform(size=[batch]) < 0.6, tf.float32)
  lengths = tf.constant(rng.integers(1, 6, batch), tf.int32)
  grades = tf.constant(rng.integers(0, 4, [batch, 5]), tf.int32)
  keys = tf.constant(['k'] * batch)

  def RankNet(s, rel):
    before = tf.cast(rel[:, :, None] > rel[:, None, :], s.dtype)
    return tf.reduce_mean(tf.reduce_sum(tf.nn.softplus(s[:, None] - s[:, :, None]) * before,
                                        [1, 2]))

  cases = {
      'masked pair': (lambda y, m: (tf.reduce_sum(tf.reduce_mean(y, 1) * m) / tf.reduce_sum(m),
                                    tf.cast(tf.math.count_nonzero(m), y.dtype)), (logits, mask)),
      'per-sequence means': (lambda y, n: tf.reduce_mean(
          tf.reduce_sum(y, 1) / tf.cast(n, y.dtype)), (logits, lengths)),
      'pairwise over grades': (RankNet, (logits, grades)),
      'with a string tensor': (lambda y, k: tf.reduce_mean(tf.square(y)), (logits, keys)),
  }
  if batch % 4:
    # Known limit: on uneven micro-batches pairs are probed on outputs within (0.2, 0.8) too
    # (0/1 outputs leave (mean, 1) the same in every part), where this mask is no mask.
    loss_fn, whole = cases.pop('masked pair')
    with pytest.raises(ValueError, match='is not the weighted mean'):
      loss_probe.MicroBatchLoss(loss_fn, 4, batch, 0, '1f1b')(*(x[:3] for x in whole))
  for name, (loss_fn, whole) in cases.items():
    _AssertMergesToTheWholeBatchs(loss_fn, whole, 4, name)


def testAMaskedMeanIgnoringAVoidLabelOf255IsRefused():
  """uint8 segmentation labels whose void, 255, is left out of the mean."""
  def VoidMaskedMean(logits, labels):
    mask = tf.cast(labels != 255, logits.dtype)
    xent = _CrossEntropy(logits, tf.cast(tf.where(labels == 255, 0, labels), tf.int32))
    return tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)

  with pytest.raises(ValueError, match='int labels 0 and 255 .* is neither the sum'):
    loss_probe.MicroBatchLoss(VoidMaskedMean, 4, 16, 0, '1f1b')(tf.ones([4, 3]),
                                                           tf.zeros([4], tf.uint8))


def testAMeanOverLabelsOtherThanZeroWeighedByRowsIsRefused():
  """As a (value, weight) pair with a cross-entropy that fails on the labels -1, -100 and
  255: pairs were probed with those labels only, and it was accepted (2.25039 against the
  whole batch's 2.15725)."""
  def WeighedByRows(logits, labels):
    mask = tf.cast(labels != 0, logits.dtype)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    return tf.reduce_sum(xent * mask) / tf.reduce_sum(mask), tf.cast(tf.shape(labels)[0],
                                                                      logits.dtype)

  labels = tf.constant(np.random.default_rng(0).integers(0, 5, [4, 6]), tf.int32)
  with pytest.raises(ValueError, match=r'int labels 0 and 1 .* is not the weighted mean'):
    loss_probe.MicroBatchLoss(WeighedByRows, 4, 16, 0, '1f1b')(tf.zeros([4, 6, 5]), labels)


@pytest.mark.parametrize('batch', [16, 10])
def testPairsOfOneBasedLabelsThatDoNotMergeAreRefusedEagerlyAndInAStep(batch):
  """Pairs were probed only with labels of 0 among others, which a loss of 1-based labels
  fails on: a mean weighed 1 (uneven micro-batches) and a mean over the labels other than
  1 weighed by rows were accepted, in a traced step with another value than the whole
  batch's (1.83637 against 1.81093)."""
  def WeighedOne(logits, labels):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels - 1, logits)), 1.0

  def WeighedByRows(logits, labels):
    mask = tf.cast(labels != 1, logits.dtype)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels - 1, logits)
    return tf.reduce_sum(xent * mask) / tf.reduce_sum(mask), tf.cast(tf.shape(labels)[0],
                                                                      logits.dtype)

  labels = tf.constant(np.random.default_rng(1).integers(1, 4, [batch // 4, 6]), tf.int32)
  logits = tf.zeros([batch // 4, 6, 3])
  for loss_fn in ([WeighedOne] if batch % 4 else []) + [WeighedByRows]:
    for call in (lambda y, t: loss_probe.MicroBatchLoss(loss_fn, 4, batch, 0, '1f1b')(y, t),
                 tf.function(lambda y, t: loss_probe.MicroBatchLoss(loss_fn, 4, batch, 0,
                                                                 '1f1b')(y, t))):
      with pytest.raises(ValueError, match='is not the weighted mean'):
        call(logits, labels)


def testAMeanOverLabelsOtherThanZeroIsRefused():
  """Label 0 as padding (BERT's) or background, with a cross-entropy that fails on the
  labels -1, -100 and 255 of 3 classes: only a probe mixing 0 with a valid class tells it
  (one was accepted with the mean's rule: 3.3894 against the whole batch's 3.7783)."""
  def MeanOverNonZero(logits, labels):
    mask = tf.cast(labels != 0, logits.dtype)
    xent = tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits)
    return tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)

  rng = np.random.default_rng(2)
  logits = tf.constant(rng.normal(size=[16, 3]), tf.float32)
  labels = tf.constant([0, 0, 0, 1, 0, 2, 1, 0, 1, 2, 2, 1, 2, 1, 0, 2], tf.int32)
  merged = np.mean([float(MeanOverNonZero(y, t))
                    for y, t in zip(tf.split(logits, 4), tf.split(labels, 4))])
  assert abs(merged - float(MeanOverNonZero(logits, labels))) > 1e-2  # It does not merge.
  with pytest.raises(ValueError, match='int labels 0 and 1 .* is neither the sum'):
    loss_probe.MicroBatchLoss(MeanOverNonZero, 4, 16, 0, '1f1b')(logits[:4], labels[:4])


class _Counted:
  """A loss (a bound method) that counts its calls."""

  def __init__(self, loss_fn):
    self.calls = 0
    self._loss_fn = loss_fn

  def Loss(self, *args):
    self.calls += 1
    return self._loss_fn(*args)


def testAVerdictIsKeptPerLossFunctionAndSignatureAndHoldsNoLossAlive():
  """A kept verdict spares every probe: the loss is called once, on its micro-batch, with
  the rule the probes found; another owner, batch or shape is probed again; the verdicts
  keep no loss (nor its owner) alive."""
  verdicts = loss_probe.LossVerdicts()
  part = tf.ones([4, 8])

  def Call(loss, x, batch=16):
    return [float(v) for v in loss_probe.MicroBatchLoss(loss.Loss, 4, batch, 0, '1f1b',
                                                     verdicts)(x)]

  mean, total = _Counted(tf.reduce_mean), _Counted(tf.reduce_sum)
  assert Call(mean, part) == [1.0, 0.25] and mean.calls > 10  # Probed.
  assert Call(total, part) == [128.0, 0.25] and total.calls > 10  # Another owner: probed.
  for loss, want in ((mean, [1.0, 0.25]), (total, [128.0, 0.25])):
    before = loss.calls
    assert Call(loss, part) == want and loss.calls == before + 1  # Kept: no probe.
  for x, batch in ((part, 18), (tf.ones([4, 5]), 16)):  # Another batch, another shape.
    before = mean.calls
    Call(mean, x, batch)
    assert mean.calls > before + 1
  owner = _Counted(tf.reduce_mean)
  Call(owner, part)
  gone = weakref.ref(owner)
  del owner
  gc.collect()
  assert gone() is None


def testARefusedLossIsRefusedAgainAndAStepGraphsCheckIsNotKept():
  """Only a verdict found eagerly is kept: a refusal is not (the loss is probed and
  refused again), nor a loss probed in the step's graph (its checks run with each step)."""
  verdicts = loss_probe.LossVerdicts()
  for _ in range(2):
    with pytest.raises(ValueError, match='is neither the sum'):
      loss_probe.MicroBatchLoss(tf.reduce_max, 4, 16, 0, '1f1b', verdicts)(tf.ones([4, 8]))
  scale, step = tf.Variable(2.0), {}

  def Scaled(y):
    return step['factor'] * tf.reduce_mean(y)

  @tf.function
  def Step(x):
    step['factor'] = scale * 1.0  # A tensor of the step: the probe runs in its graph.
    return loss_probe.MicroBatchLoss(Scaled, 4, 16, 0, '1f1b', verdicts)(x)

  assert [float(v) for v in Step(tf.ones([4, 8]))] == [2.0, 0.25]
  assert Scaled not in verdicts._by_owner  # pylint: disable=protected-access
  verdicts.Put(Scaled, 'any', {})  # As the probe of an eager loss would.
  assert Scaled in verdicts._by_owner  # pylint: disable=protected-access


@pytest.mark.parametrize('batch', [16, 10])
def testALossOfOneBasedLabelsIsAcceptedEagerlyAndInAStep(batch):
  """The first probe takes the micro-batch's own labels: a loss of 1-based labels failed on
  labels of 0 and was refused eagerly. In a traced step (whose labels the eager probe cannot
  read) the further probes tell it; it was probed in the step's graph on labels of 0, and
  failed there on uneven micro-batches or a batch of unknown size. Every way, the
  micro-batches merge to the whole."""
  def OneBased(logits, labels):
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels - 1, logits))

  rng = np.random.default_rng(5)
  logits = tf.constant(rng.normal(size=[batch, 3]), tf.float32)
  labels = tf.constant(rng.integers(1, 4, size=[batch]), tf.int32)
  want = float(OneBased(logits, labels))
  sizes = [len(p) for p in np.array_split(np.arange(batch), 4)]

  def Merged(call):
    pairs = [call(y, t) for y, t in zip(tf.split(logits, sizes), tf.split(labels, sizes))]
    return float(metrics.MergeMetrics([metrics.AsMetrics(p) for p in pairs]).loss[0])

  def Wrapped(y, t, rows=batch):
    return loss_probe.MicroBatchLoss(OneBased, 4, rows, 0, '1f1b')(y, t)

  assert Merged(Wrapped) == pytest.approx(want, rel=1e-6)
  assert Merged(tf.function(Wrapped)) == pytest.approx(want, rel=1e-6)
  unknown = tf.function(lambda y, t: Wrapped(y, t, tf.constant(batch)), input_signature=[
      tf.TensorSpec([None, 3]), tf.TensorSpec([None], tf.int32)])
  assert Merged(unknown) == pytest.approx(want, rel=1e-6)


def _KnownSquares(y, t):
  """Squared errors, 0 where the target is missing (NaN); which targets are known."""
  known = tf.math.is_finite(t)
  return tf.where(known, tf.square(y - tf.where(known, t, 0.0)), 0.0), known


def _FiniteTargets(y, t):
  """A mean over the targets that are not missing, as (mean, count)."""
  squares, known = _KnownSquares(y, t)
  count = tf.reduce_sum(tf.cast(known, y.dtype))
  return tf.reduce_sum(squares) / tf.maximum(count, 1.0), count


def _Missing(rows, seed):
  """Outputs, and targets of which about a third are missing (NaN)."""
  rng = np.random.default_rng(seed)
  targets = np.where(rng.uniform(size=[rows, 2]) < 0.35, np.nan, rng.normal(size=[rows, 2]))
  return tf.constant(rng.normal(size=[rows, 2]), tf.float32), tf.constant(targets, tf.float32)


@pytest.mark.parametrize('num_parts,batch', [(2, 8), (3, 7), (4, 16)])
def testAMeanOverTargetsThatAreNotMissingIsRefusedAndItsPairAccepted(num_parts, batch):
  """Missing targets as NaN: a mean over the finite ones does not merge (accepted before
  the NaN probe); as a (mean, count) pair, or with missing ones as 0 in a mean over all,
  it merges to the whole batch's value."""
  whole = _Missing(24, seed=1)
  masked_mean = lambda y, t: _FiniteTargets(y, t)[0]
  values = [float(masked_mean(*part)) for part in zip(*(tf.split(x, 4) for x in whole))]
  assert abs(float(masked_mean(*whole)) - np.mean(values)) > 1e-3  # It does not merge.
  part = _Missing(max(batch // num_parts, 1), seed=2)
  with pytest.raises(ValueError, match=r'outputs of 0, 1 and NaN \(.* is neither the sum'):
    loss_probe.MicroBatchLoss(masked_mean, num_parts, batch, 0, '1f1b')(*part)
  zeroed = lambda y, t: tf.reduce_mean(_KnownSquares(y, t)[0])
  for name, loss_fn in (('pair', _FiniteTargets), ('zeroed', zeroed)):
    _AssertMergesToTheWholeBatchs(loss_fn, _Missing(batch, seed=3), num_parts, name)


def testAPairOverAFloatMaskOfFiniteTargetsAndALossRejectingNaNAreAccepted():
  """The NaN probe's outputs are 0s and 1s, as masks are: a (masked mean, count) pair over a
  float mask that leaves out missing targets merges there (on floats from 0.1 to 4 it did
  not, and was refused); a loss that raises on NaN (any exception) skips that probe."""
  def MaskedPair(y, t, mask):
    mask = tf.where(tf.math.is_finite(t), mask, 0.0)
    squares = tf.where(mask > 0, tf.square(y - tf.where(mask > 0, t, 0.0)), 0.0)
    return (tf.math.divide_no_nan(tf.reduce_sum(squares * mask), tf.reduce_sum(mask)),
            tf.reduce_sum(tf.cast(mask > 0, y.dtype)))

  def RejectsNaN(y, t):
    if not np.all(np.isfinite(t.numpy())):
      raise FloatingPointError('a missing target')
    return tf.reduce_mean(tf.square(y - t))

  y, t = _Missing(12, seed=4)
  mask = tf.constant((np.random.default_rng(4).uniform(size=[12, 2]) < 0.7), tf.float32)
  _AssertMergesToTheWholeBatchs(MaskedPair, (y, t, mask), 4, 'pair')
  _AssertMergesToTheWholeBatchs(RejectsNaN, (y, tf.where(tf.math.is_finite(t), t, 0.0)), 4,
                                'rejects NaN')


def testAMaskedMeanReadingATensorOfTheStepIsRefusedWhenTheStepRuns():
  """Probed in the step's graph, with labels of 0, not the micro-batch's own: those, the same
  in every part, made a mean over the tokens that are not padding (0) look like a mean, and
  it was accepted with another value than the whole batch's."""
  rng = np.random.default_rng(0)
  labels = rng.integers(1, 5, [8, 6]).astype(np.int32)
  for row in range(8):  # Micro-batches with their own shares of padding.
    labels[row, row * 6 // 8 + 1:] = 0
  logits = tf.random.stateless_normal([8, 6, 5], [1, 2])

  @tf.function
  def Step(logits, labels):
    scale = tf.reduce_sum(logits) * 0.0 + 1.0  # A tensor of the step.

    def Loss(y, t):
      mask = tf.cast(t != 0, y.dtype)
      xent = tf.nn.sparse_softmax_cross_entropy_with_logits(t, y)
      return scale * tf.reduce_sum(xent * mask) / tf.reduce_sum(mask)

    loss = loss_probe.MicroBatchLoss(Loss, 4, 8, 0, '1f1b')
    return [loss(y, t) for y, t in zip(tf.split(logits, 4), tf.split(labels, 4))]

  with pytest.raises(tf.errors.InvalidArgumentError, match='cannot tell which'):
    Step(logits, tf.constant(labels))


def testALossThatFailsOnEveryProbeIsRefusedNamingTheFailure():
  """A loss that checks its outputs (rows of probabilities) runs on the user's data but on
  no probe's random outputs: refused, saying so, not with the check's own error."""
  def Probabilities(p):
    tf.debugging.assert_near(tf.reduce_sum(p, -1), tf.ones(tf.shape(p)[:1]))
    return tf.reduce_mean(-tf.math.log(p[:, 0]))

  with pytest.raises(ValueError, match=r"'1f1b' .* probes, which tell a sum from a mean on "
                     r'random outputs, told nothing: it failed on the first \(InvalidArgument'):
    loss_probe.MicroBatchLoss(Probabilities, 4, 16, 0, '1f1b')(tf.fill([4, 2], 0.5))


def testABareIntegerMetricMergesAsASum():
  part = tf.ones([4, 8])
  result = loss_probe.MicroBatchLoss(lambda y: {'loss': tf.reduce_mean(y), 'count': tf.size(y)},
                                  4, 16, 0, '1f1b')(part)
  assert [float(x) for x in result['count']] == [128.0, 0.25]  # (32 x M, 1 / M)
