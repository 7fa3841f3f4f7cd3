"""The loss probe: is a loss_fn's bare scalar a sum or a mean of its micro-batches?

A pipeline that computes the loss per micro-batch (every schedule but fill-drain)
must merge the micro-batches' losses into the whole batch's. A (value, weight)
pair merges exactly (metrics.py); a bare scalar is merged as the sum or the mean
of its micro-batch values, which MicroBatchLoss tells by calling the loss on
random outputs split as the pipeline splits them, and refuses a loss that is
neither (batch statistics, a mean over some rows) with a ValueError that names it.
The verdict is kept per loss function and input signature (LossVerdicts).
"""

import contextlib
import inspect
import itertools
import weakref

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import failed_op_logs
from lingvo_gpipe.pipeline import metrics
from lingvo_gpipe.pipeline import microbatch


def _IsPair(value):
  return isinstance(value, (tuple, list))


def _ProbeCenters(parts, index):
  """The centers of the index-th tensor's micro-batch values: on a line through 0.5 at
  micro-batch (parts - 1) / 3, of slope +-1, +-1/2, +-1/3, ... (even tensors rising, odd
  falling) times 0.35 / (parts - 1). Any two tensors' lines cross between the first
  micro-batch and the last: their difference changes sign (so the absolute value of a
  mean of an output minus a target is not linear on the probe) and varies between
  micro-batches (so its batch statistics differ from their micro-batch values), yet its
  mean over the batch is not 0 (so a mean of it is told from a sum)."""
  slope = (1.0 if index % 2 == 0 else -1.0) / (1 + index // 2)
  steps = np.arange(parts) - (parts - 1) / 3
  return 0.5 + 0.35 * slope * steps / max(parts - 1, 1)


def _ProbeInput(like, sizes, batch_dim, index, widen):
  """Random values shaped like micro-batch tensor `like` (the index-th of loss_fn's
  flattened tensors), for a batch of micro-batches of `sizes` rows: micro-batch i's values
  lie within 0.05 (odd tensors 0.03) of _ProbeCenters(M, index)[i]. Within (0.2, 0.8), so
  logs and roots of outputs and of 1 - outputs (probabilities) stay finite; each
  micro-batch about a center of its own, so that a loss reading batch statistics (the
  square of a mean, a variance, centering by the batch's mean) gives a whole-batch value
  far from any combination of its micro-batch values. Tensors not of floats (labels) repeat
  the micro-batch's own (_Repeated). Made by random ops, not a constant:
  a probe in a step's graph would otherwise hold the whole batch's outputs in the graph.
  With `widen`, 16-bit floats come as float32: their rounding would hide a small
  batch-statistic term."""
  shape = like.shape.as_list()
  shape[batch_dim] = sum(sizes)
  if None in shape:
    raise ValueError(
        'a schedule that calls loss_fn on each micro-batch probes it on random outputs of the '
        f"batch's shape, but the outputs' shape {like.shape} has an unknown dimension besides "
        "the batch: use schedule='gpipe', or give the outputs a fixed shape (pad them)")
  if not like.dtype.is_floating:
    return _Repeated(like, shape[batch_dim], batch_dim)
  width = 0.1 if index % 2 == 0 else 0.06
  centers = np.repeat(_ProbeCenters(len(sizes), index), sizes).reshape(
      [-1 if d == batch_dim else 1 for d in range(len(shape))])
  dtype = like.dtype if like.dtype == tf.float64 or not widen else tf.float32
  values = tf.random.stateless_uniform(shape, [index, 0], -width / 2, width / 2, tf.float32)
  return tf.cast(values + centers.astype(np.float32), dtype)


def _Repeated(like, rows, batch_dim):
  """Micro-batch tensor `like` (labels, lengths: not floats) repeated to `rows` rows: values
  loss_fn takes (it failed on labels of 0 that were 1-based); zeros if it has no rows, or
  if it is a tensor of the step being traced: the eager probe cannot read it, and in the
  step's graph one micro-batch's labels in every part would hide a mean over a mask."""
  if tf.is_symbolic_tensor(like):
    shape = like.shape.as_list()
    shape[batch_dim] = rows
    return tf.zeros(shape, like.dtype)
  # One row of zeros after the others: what an empty micro-batch repeats.
  padded = tf.pad(like, [[0, int(d == batch_dim)] for d in range(like.shape.rank)])
  have = tf.maximum(tf.shape(like)[batch_dim], 1)
  return tf.gather(padded, tf.range(rows) % have, axis=batch_dim)


# The probes after the first, eager only, each on other outputs and int labels: what the
# first probe's narrow range and the micro-batch's own labels cannot tell. 'wide' (floats
# from 0.1 to 4) and 'signed' (of either sign): a bend of a batch statistic outside
# (0.2, 0.8) (relu(mean(y)), min(mse, 1)), per-row values that vary between micro-batches
# (a cross-entropy divided by the batch's sum of sample weights). Labels with a share of
# marked elements that varies between micro-batches: a normalization by the batch's labels
# (class weights from label counts; a masked mean ignoring padding: 0 as BERT's, -1, -100
# as in PyTorch, 255 as a segmentation's void); labels of 1 and 2 for a loss dividing by
# them (sequence lengths). 'binary' floats, 0 and 1, are masks as real ones are: (value,
# weight) pairs are probed on those (a mean over a float mask weighed by its count of
# non-zeros merges on 0s and 1s, not on random floats), also with labels 0 and 1 (a mean
# over the labels other than 0 weighed by rows) and 1 and 2 (1-based labels). 'nan':
# 'binary' with a share of NaN (missing targets) that varies between micro-batches: a mean
# over the finite ones.
# (floats, label elements unmarked, marked, whether pairs are probed).
_FURTHER_PROBES = (('wide', 0, 1, False), ('signed', 1, 2, False), ('binary', 0, 1, True),
                   ('binary', 1, 2, True), ('binary', 0, -1, True), ('binary', 0, -100, True),
                   ('binary', 0, 255, True), ('nan', 0, 1, True))
_FLOATS = {'wide': 'outputs from 0.1 to 4', 'signed': 'outputs of either sign',
           'binary': 'outputs of 0 and 1', 'nan': 'outputs of 0, 1 and NaN'}
_FURTHER_PARTS = 8
# The further probes' batch holds no more than this many numbers (64 MB of float32), or
# num_parts rows: a language model's logits may hold 16M numbers a row.
_FURTHER_NUMBERS = 2**24


def _Marked(shape, batch_dim, sizes, rng):
  """A bool array of `shape` marking, in each part of `sizes` rows along batch_dim, a
  share of its elements: from 0.1 to 0.9, each part its own, rounded (a part of few
  elements may have none or all marked: padding only, say)."""
  moved = [shape[batch_dim]] + shape[:batch_dim] + shape[batch_dim + 1:]
  per_row = int(np.prod(moved[1:]))
  parts = []
  for rows, share in zip(sizes, rng.permutation(np.linspace(0.1, 0.9, len(sizes)))):
    count = rows * per_row
    marks = int(np.floor(share * count + 0.5))
    flat = np.zeros(count, bool)
    flat[rng.permutation(count)[:marks]] = True
    parts.append(flat.reshape([rows] + moved[1:]))
  return np.moveaxis(np.concatenate(parts), 0, batch_dim)


def _FurtherProbeInput(like, sizes, batch_dim, index, probe, widen):
  """Values shaped like micro-batch tensor `like` (the index-th of loss_fn's flattened
  tensors) for _FURTHER_PROBES[probe], for a batch of parts of `sizes` rows. 'wide' and
  'signed' floats: each part has a magnitude of its own, log-spaced from 0.1 to 4 in an
  order of the tensor's own ('signed': half of them negative), and spreads its values over
  a random share of it, so per-row values differ between parts. 'binary': 0 or 1, 1 with a
  probability of each part's own. 'nan': 'binary' but NaN with a probability of each
  part's own, at the same elements in every tensor of the same shape (an output and its
  target). Ints: _Marked elements hold the probe's marked value (within the dtype's range),
  the others its unmarked one; strings as the first probe's."""
  kind, unmarked, marked, _ = _FURTHER_PROBES[probe]
  parts = len(sizes)
  rng = np.random.default_rng([probe, index])
  shape = like.shape.as_list()
  shape[batch_dim] = sum(sizes)
  rows = [-1 if d == batch_dim else 1 for d in range(len(shape))]
  if like.dtype.is_bool:
    return tf.constant(_Marked(shape, batch_dim, sizes, rng))
  if like.dtype.is_integer:
    values = np.clip([unmarked, marked], like.dtype.min, like.dtype.max)
    return tf.cast(np.where(_Marked(shape, batch_dim, sizes, rng), values[1], values[0]),
                   like.dtype)
  if not like.dtype.is_floating:
    return _Repeated(like, shape[batch_dim], batch_dim)

  def PerRow(per_part):
    return np.repeat(per_part, sizes).reshape(rows).astype(np.float32)

  # TensorFlow's random ops, not numpy's: the batch may be large (a language model's
  # logits), and they make no float64 or other full-size temporaries.
  noise = tf.random.stateless_uniform(shape, [probe, index], -1.0, 1.0, tf.float32)
  if kind in ('binary', 'nan'):
    values = tf.cast(noise < PerRow(rng.permutation(np.linspace(-0.6, 0.6, parts))), tf.float32)
  else:
    centers = rng.permutation(0.1 * 40.0**(np.arange(parts) / max(parts - 1, 1)))
    if kind == 'signed':
      centers *= rng.permutation(np.where(np.arange(parts) % 2 == 0, 1.0, -1.0))
    spreads = np.abs(centers) * rng.uniform(0.2, 1.0, parts)
    values = PerRow(centers) + PerRow(spreads) * noise
  if kind == 'nan':
    shares = np.random.default_rng(probe).permutation(np.linspace(0.1, 0.9, parts))
    # Seeded apart from every tensor's noise ([probe, index]).
    missing = tf.random.stateless_uniform(shape, [probe, -1]) < PerRow(shares)
    values = tf.where(missing, np.float32(np.nan), values)
  dtype = like.dtype if like.dtype == tf.float64 or not widen else tf.float32
  return tf.cast(values, dtype)


# Relative tolerance of the probe's comparisons for a loss value of a 16-bit float: a few
# of its roundings (epsilon 2^-7, 2^-10); else 1e-4.
_TOLERANCE = {tf.bfloat16: 4 * 2.0**-7, tf.float16: 4 * 2.0**-10}


def _Tolerance(value):
  return _TOLERANCE.get(tf.convert_to_tensor(value).dtype, 1e-4)


def _Combination(whole, parts, sizes, tolerance):
  """'sum' or 'mean' if the whole batch's value is the sum of the micro-batches' values or
  their mean weighted by their sizes, else None (also for a finite whole of micro-batch
  values that are not: a mean over a mask that leaves a micro-batch nothing); '' if the
  values cannot tell (all zero, the whole not finite, or the sum and the mean alike, as for
  a value near 0)."""
  whole, parts = float(whole), np.asarray(parts, np.float64)
  if not np.isfinite(whole):
    return ''
  if not np.all(np.isfinite(parts)):
    return None
  scale = max(abs(whole), float(np.abs(parts).max()))
  if scale == 0.0:
    return ''
  matches = [rule for rule, value in (('sum', parts.sum()),
                                      ('mean', np.average(parts, weights=sizes)))
             if abs(whole - value) <= tolerance * scale]
  if len(matches) == 2 and len(parts) > 1:
    return ''
  return matches[-1] if matches else None


def _CombinationWhenRun(whole, parts, sizes, tolerance, message):
  """_Combination of values known only when the step runs: (is_sum, told, check), bool
  tensors: True for 'sum' (else 'mean'); whether the probe's values tell (not all zero, all
  finite, not the sum and the mean alike); and whether one of the two holds or they do not
  tell (`message` if not)."""
  whole = tf.cast(whole, tf.float64)
  parts = tf.cast(tf.stack(parts), tf.float64)
  total = tf.reduce_sum(parts)
  mean = tf.reduce_sum(parts * np.asarray(sizes, np.float64) / sum(sizes))
  tolerance = tolerance * tf.maximum(tf.abs(whole), tf.reduce_max(tf.abs(parts)))
  is_sum = tf.abs(whole - total) <= tolerance
  is_mean = tf.abs(whole - mean) <= tolerance
  told = tf.math.is_finite(tolerance) & (tolerance > 0)
  if len(sizes) > 1:
    told &= ~(is_sum & is_mean)
  holds = is_sum | is_mean | ~told
  return is_sum, told, _Check(holds, message, 'whole batch, sum, mean:', whole, total, mean)


def _WeightedMeanWhenRun(value, pairs, tolerance, message):
  """A _Check, when the step runs, that (value, weight) pairs merge to `value`."""
  values = tf.cast(tf.stack([v for v, _ in pairs]), tf.float64)
  weights = tf.cast(tf.stack([w for _, w in pairs]), tf.float64)
  value = tf.cast(value, tf.float64)
  merged = tf.math.divide_no_nan(tf.reduce_sum(values * weights), tf.reduce_sum(weights))
  holds = (tf.equal(tf.reduce_sum(weights), 0.0) |
           (tf.abs(value - merged) <= tolerance * tf.maximum(tf.abs(value), tf.abs(merged))) |
           ~tf.math.is_finite(value - merged))
  return _Check(holds, message, 'whole batch, weighted mean:', value, merged)


def _Check(holds, message, *data):
  """`holds` (a bool tensor) once an assertion of it with `message` and `data` has run."""
  with tf.control_dependencies([tf.debugging.Assert(holds, [message, *data])]):
    return tf.identity(holds)


def _Guarded(pair, checks):
  """A (value, weight) metric whose weight is NaN unless every check holds: XLA compiles
  assertions away, so a loss that failed its check still cannot train silently."""
  value, weight = pair
  value = tf.convert_to_tensor(value)
  if not value.dtype.is_floating:  # A count, say: it cannot be NaN, nor trains anything.
    return pair
  weight = tf.cast(weight, value.dtype)
  holds = tf.reduce_all(tf.stack(checks))
  return value, tf.where(holds, weight, tf.constant(np.nan, value.dtype))


class LossVerdicts:
  """What MicroBatchLoss's probes found, per loss function and call signature: a loss is
  probed once, as tf.function traces a function once per signature, not at every eager
  ForwardBackward call (each probe calls loss_fn dozens of times). A PipeliningLayer keeps
  one. Loss functions (a bound method's owner) are held weakly. A loss that behaves
  otherwise on a later call of the same signature (it reads a Python flag, say) keeps its
  first verdict, as it would keep its first trace."""

  def __init__(self):
    # loss_fn, or a bound method's owner -> {(its function, signature): verdict}.
    self._by_owner = weakref.WeakKeyDictionary()

  @staticmethod
  def _Key(loss_fn):
    if inspect.ismethod(loss_fn):
      return loss_fn.__self__, loss_fn.__func__
    return loss_fn, None

  def Get(self, loss_fn, signature):
    owner, function = self._Key(loss_fn)
    try:
      return self._by_owner.get(owner, {}).get((function, signature))
    except TypeError:  # Not weakly referable, or not hashable: never kept.
      return None

  def Put(self, loss_fn, signature, verdict):
    owner, function = self._Key(loss_fn)
    try:
      self._by_owner.setdefault(owner, {})[(function, signature)] = verdict
    except TypeError:  # As in Get: such a loss is probed at every call.
      pass


class _ProbeFailed(Exception):
  """loss_fn raised on a probe's outputs (its __cause__)."""


class MicroBatchLoss:
  """loss_fn for a schedule that calls it on each of num_parts micro-batches alone.

  Micro-batch (value, weight) metrics merge as sum(value * weight) / sum(weight)
  by their definition. A bare scalar says nothing of how it merges, so the
  first call probes loss_fn on random outputs of a whole batch and of its
  micro-batches: a scalar that is the sum of its micro-batch values becomes
  (value * num_parts, 1 / num_parts), a mean (value, rows / batch_size), its
  micro-batch's share of the batch, which weighs micro-batches of uneven size
  right; anything else (a max, a normalization by batch statistics, a loss
  reading whole-batch tensors other than its arguments) is refused with a
  ValueError. (value, weight) pairs are probed too: one whose whole-batch value
  is not the weighted mean of its micro-batch values (a weight that does not
  count the items value is a mean over, padding say) is refused. So every
  schedule gives the loss and gradients that loss_fn gives on the whole batch.

  The probe runs eagerly, once per trace and signature (kept in `verdicts`), on
  outputs within (0.2, 0.8) and the micro-batch's own labels (zeros in a step
  being traced), then on each of _FURTHER_PROBES (wider, signed and 0/1 outputs;
  labels marking padding or other classes); a probe whose whole-batch value is
  not finite, or that loss_fn fails on, tells nothing (a loss of 1-based labels
  fails on the zeros of a traced step's first probe: the others tell it). A loss
  that reads tensors of the step being traced (a scale computed from the step,
  say) cannot be probed eagerly at all: it is probed in the step's graph instead,
  on the first probe's outputs only, every time the step runs
  (num_parts + 1 more loss_fn calls), and a loss that does not merge fails the
  step with the same message (under XLA, which drops assertions, its weight is
  NaN: the step's loss and gradients are NaN); its pairs are probed there only
  when micro-batches differ in size. A scalar that no probe can tell (0 or not
  finite, or its sum and mean alike) is refused, or in the step's graph accepted
  only for micro-batch values that are 0 or not finite too (a scale of 0).

  Args:
    loss_fn: the caller's loss function.
    num_parts: the micro-batches of all replicas.
    batch_size: the whole batch's rows, an int or (unknown at trace time) a tensor.
    batch_dim: the batch dimension of loss_fn's arguments.
    schedule: the schedule's name, for messages.
    verdicts: a LossVerdicts that keeps the probes' verdicts between calls, or None.
  """

  def __init__(self, loss_fn, num_parts, batch_size, batch_dim, schedule, verdicts=None):
    self._loss_fn = loss_fn
    self._verdicts = verdicts
    self._num_parts = num_parts
    self._batch_size = batch_size
    self._batch_dim = batch_dim
    self._schedule = schedule
    self._static = isinstance(batch_size, int)
    self._uneven = not self._static or batch_size % num_parts != 0
    # Name -> 'sum', 'mean' or, known when the step runs, (is_sum, told, message).
    self._rules = {}
    # Name -> the probe that told its rule ('' the first).
    self._told_by = {}
    # _Checks of a probe in the step's graph, guarding every micro-batch's metrics.
    self._checks = []
    self._probed = False
    # The dtypes of loss_fn's metrics, for zeros on a micro-batch traced without rows.
    self._dtypes = None

  @tf.autograph.experimental.do_not_convert
  def __call__(self, *args):
    if self._num_parts == 1:  # The one micro-batch is the batch: its loss is loss_fn's.
      return self._Call(*args)
    empty = microbatch.StaticBatchSize(args, self._batch_dim) == 0
    if empty and self._dtypes is not None:
      # Zeros, not loss_fn's value: some fail on no rows (Keras's, eagerly).
      value = _MapScalars(lambda dtype: tf.zeros([], dtype), self._dtypes)
    else:
      value = self._Call(*args)
      value = _NoRowsAsZero(value) if empty else value
      metrics.AsMetrics(value)  # A ValueError unless its metrics are scalars or pairs.
      if self._dtypes is None:
        self._dtypes = _MapScalars(lambda x: tf.convert_to_tensor(x).dtype, value)
    if not self._probed:
      self._ProbeOnce(args, value)
      self._probed = True
    checks = list(self._checks)

    def Weighted(name, metric):
      return metric if _IsPair(metric) else self._Weighted(
          _FloatScalar(metric), self._rules[name], args, checks)

    if isinstance(value, dict):
      value = type(value)({k: Weighted(k, v) for k, v in value.items()})
    else:
      value = Weighted('loss', value)
    if not checks:
      return value
    if isinstance(value, dict):
      return type(value)({k: _Guarded(v, checks) for k, v in value.items()})
    return _Guarded(value, checks)

  def _Call(self, *args):
    try:
      return self._loss_fn(*args)
    except (ValueError, TypeError, AssertionError, tf.errors.OpError) as e:
      raise ValueError(f'schedule={self._schedule!r} calls loss_fn on each micro-batch\'s '
                       'outputs alone (a loss must read nothing but them), and it failed on '
                       f'them: {e}') from None

  # -- the probe -----------------------------------------------------------------------

  def _ProbeOnce(self, args, value):
    """_Probe, unless self._verdicts holds its verdict for this loss_fn and signature; a
    verdict that needs checks in the step's graph is not kept."""
    signature = self._Signature(args, value)
    known = None if signature is None else self._verdicts.Get(self._loss_fn, signature)
    if known is not None:
      self._rules = dict(known)
      return
    with failed_op_logs.Dropped():  # The probes' labels make some losses fail: no alarm.
      self._Probe(args, value)
    if signature is not None and not self._checks:
      self._verdicts.Put(self._loss_fn, signature, dict(self._rules))

  def _Signature(self, args, value):
    """What the probes' verdict depends on besides loss_fn: the shapes and dtypes of its
    tensors, its other arguments, the split, whether in a graph, and which of its metrics
    are bare scalars and which pairs; None if it is not to be kept."""
    if self._verdicts is None:
      return None
    leaves = []
    for x in tf.nest.flatten(args):
      if isinstance(x, tf.Tensor):
        leaves.append((str(x.shape), x.dtype.name))
      elif x is None or isinstance(x, (bool, int, float, str)):
        leaves.append(x)
      else:
        return None
    structure = repr(tf.nest.map_structure(lambda _: 0, args))
    return (structure, tuple(leaves), self._num_parts,
            self._batch_size if self._static else None, self._batch_dim,
            tf.executing_eagerly(), tuple(sorted(_Scalars(value))),
            tuple(sorted(_Pairs(value))))

  def _Probe(self, args, value):
    """Sets the rule of each bare scalar; refuses a loss that does not merge."""
    # A batch of unknown size, or of fewer rows than num_parts (whose empty micro-batches
    # hold nothing to tell a sum from a mean), is probed with one num_parts does not divide.
    size, parts = self._batch_size, self._num_parts
    sizes = microbatch.Sizes(size if self._static and size >= parts else 2 * parts + 1, parts)
    failed = None  # What loss_fn raised on the first probe's outputs, eagerly.
    if _Scalars(value) or self._uneven:
      try:
        values = self._ProbeValuesWidened(args, sizes)
      except _ProbeFailed as e:
        failed = e.__cause__
      else:
        # On uneven micro-batches, pairs too: the 0/1 outputs of the further probes leave
        # many losses the same in every part, (mean, 1) say, where weights tell nothing.
        self._ProbeMetrics(values, sizes, False, '', pairs=self._uneven)
    probed_pairs = self._ProbeFurther(args)
    untold = [name for name in _Scalars(value) if self._rules.get(name, '') == '']
    # In the step's graph only what no eager probe told: its labels of 0 may be what failed.
    if failed is not None and (untold or self._uneven and _Pairs(value) and not probed_pairs
                               ) and not tf.executing_eagerly():
      # It reads tensors of the step, or fails on its labels of 0: probed when it runs.
      try:
        values = self._ProbeValuesWidened(args, sizes, in_graph=True)
      except _ProbeFailed as e:
        raise ValueError(self._FailedOnProbes(e.__cause__)) from None
      self._ProbeMetrics(values, sizes, True, '', pairs=self._uneven)
    elif failed is not None and untold:
      raise ValueError(self._FailedOnProbes(failed))
    elif untold:
      raise ValueError(self._Untold(untold[0]))

  def _ProbeFurther(self, args):
    """Probes loss_fn eagerly on each of _FURTHER_PROBES; how many of those that probe
    pairs it ran on."""
    sizes = self._FurtherSizes(args)
    # Bool labels are marked as ints are, whatever the probe's values.
    labels = any(isinstance(x, tf.Tensor) and x.dtype.is_integer for x in tf.nest.flatten(args))
    kinds, probed_pairs = set(), 0
    for probe, (kind, unmarked, marked, pairs) in enumerate(_FURTHER_PROBES if sizes else ()):
      if kind in kinds and not labels:
        continue  # Only its labels set it apart from a probe that ran.
      kinds.add(kind)
      try:
        values = self._ProbeValuesWidened(args, sizes, probe)
      except _ProbeFailed:  # On this probe's outputs or labels: it tells nothing.
        continue
      probed_pairs += pairs
      where = f' on {_FLOATS[kind]}' + (f' and int labels {unmarked} and {marked}' if labels
                                         else '')
      self._ProbeMetrics(values, sizes, False, where, pairs=pairs)
    return probed_pairs

  def _FurtherSizes(self, args):
    """The further probes' parts: 8 or more of 4 rows each (a loss that merges, merges for
    any split, and more parts than micro-batches tell more bends of a batch statistic),
    else num_parts of 4, 3, 2 or 1 rows, one row more in some if micro-batches differ in
    size; within _FURTHER_NUMBERS numbers of loss_fn's arguments, or num_parts rows. None
    if the size of a row is unknown."""
    per_row = 0
    for x in tf.nest.flatten(args):
      if isinstance(x, tf.Tensor):
        shape = x.shape.as_list()
        del shape[self._batch_dim]
        if None in shape:
          return None
        per_row += int(np.prod(shape))
    limit = max(self._num_parts, _FURTHER_NUMBERS // max(per_row, 1))
    extra = int(self._uneven)
    candidates = [(max(self._num_parts, _FURTHER_PARTS), 4)] + [
        (self._num_parts, each) for each in (4, 3, 2, 1)]
    parts, each = next(((p, e) for p, e in candidates if p * e + extra <= limit),
                       candidates[-1])
    return microbatch.Sizes(parts * each + extra, parts)

  def _ProbeValuesWidened(self, args, sizes, probe=None, in_graph=False):
    """_ProbeValues eagerly (or in the step's graph), 16-bit floats as float32 if loss_fn
    takes them; a _ProbeFailed if loss_fn fails on them."""
    half = any(x.dtype in (tf.bfloat16, tf.float16) for x in tf.nest.flatten(args)
               if isinstance(x, tf.Tensor))
    for widen in (True, False) if half else (False,):
      try:
        with contextlib.nullcontext() if in_graph else tf.init_scope():
          return self._ProbeValues(args, sizes, widen, probe)
      except _ProbeFailed:
        if not widen:
          raise

  def _ProbeValues(self, args, sizes, widen, probe):
    """loss_fn's values on random outputs of a whole batch, then of its micro-batches: the
    first probe's (probe None) or those of _FURTHER_PROBES[probe]."""
    index = itertools.count()

    def Input(x):
      if probe is None:
        return _ProbeInput(x, sizes, self._batch_dim, next(index), widen)
      return _FurtherProbeInput(x, sizes, self._batch_dim, next(index), probe, widen)

    whole = tf.nest.map_structure(lambda x: Input(x) if isinstance(x, tf.Tensor) else x, args)
    parts = microbatch.Split(whole, len(sizes), self._batch_dim)
    values = []
    for part in [whole] + parts:
      try:
        values.append(self._loss_fn(*part))
      except Exception as e:  # Any: the probe's outputs are not the user's data.
        raise _ProbeFailed() from e
    return values

  def _ProbeMetrics(self, values, sizes, when_run, where, pairs):
    """Probes each bare scalar of one probe's `values` (whole batch, then micro-batches)
    and, with `pairs`, each (value, weight) pair; `where` names the probe in messages."""
    for name, value in _Scalars(values[0]).items():
      self._ProbeScalar(name, value, [_Scalars(v)[name] for v in values[1:]], sizes, when_run,
                        where)
    for name, pair in (_Pairs(values[0]) if pairs else {}).items():
      self._ProbePair(name, pair, [_Pairs(v)[name] for v in values[1:]], sizes, when_run, where)

  def _Head(self):
    return (f'schedule={self._schedule!r} calls loss_fn on each of {self._num_parts} '
            'micro-batches, but its ')

  _ADVICE = ('return (value, weight) pairs, which merge as sum(value * weight) / sum(weight), '
             "or use schedule='gpipe'.")

  def _FailedOnProbes(self, error):
    return (self._Head() + 'probes, which tell a sum from a mean on random outputs, told '
            f'nothing: it failed on the first ({type(error).__name__}: {error}). If it checks '
            'its outputs, ' + self._ADVICE)

  def _Untold(self, name):
    return (self._Head() + f'{name!r} on the probes\' random outputs (0, not finite, or as much '
            'as the sum of its micro-batch values as their mean) cannot tell which of the two '
            'it is: ' + self._ADVICE)

  def _ProbeScalar(self, name, value, parts, sizes, when_run, where):
    """Sets or checks the scalar's rule: the first informative probe sets it, and every
    other probe must agree with it."""
    message = self._Head() + f'{name!r} on a whole batch{where}' + '{} is neither the sum{} ' \
        'nor the mean{} of its micro-batch values: ' + self._ADVICE
    if when_run:
      is_sum, told, check = _CombinationWhenRun(value, parts, sizes, _Tolerance(value),
                                                message.format('', '', ''))
      self._rules[name] = (is_sum, told, self._Untold(name) + " (A micro-batch's value is not 0.)")
      self._checks.append(check)
      return
    whole, parts = _Floats(value), [_Floats(part) for part in parts]
    rule, known = _Combination(whole, parts, sizes, _Tolerance(value)), self._rules.get(name, '')
    if rule is None:
      raise ValueError(message.format(f' ({whole:.6g})', f' ({np.sum(parts):.6g})',
                                      f' ({np.average(parts, weights=sizes):.6g})'))
    if rule and known and rule != known:
      raise ValueError(self._Head() + f'{name!r} on a whole batch{where} ({whole:.6g}) is the '
                       f'{rule} of its micro-batch values, but the {known}'
                       f'{self._told_by[name] or " on outputs within (0.2, 0.8)"}: ' +
                       self._ADVICE)
    if rule and not known:
      self._rules[name], self._told_by[name] = rule, where
    self._rules.setdefault(name, '')

  def _ProbePair(self, name, pair, parts, sizes, when_run, where):
    value, weight = pair
    message = (self._Head() + f'{name!r} (value, weight) on a whole batch{where}' + '{} is '
               f'not the weighted mean{{}} of its values on parts of {sizes} rows: the weight '
               "must count the items the value is a mean over; or use schedule='gpipe'" +
               (', or a batch that num_micro_batches divides.' if self._uneven else '.'))
    tolerance = _Tolerance(value)
    if when_run:
      self._checks.append(_WeightedMeanWhenRun(value, parts, tolerance, message.format('', '')))
      return
    parts = np.asarray([[_Floats(x) for x in part] for part in parts], np.float64)
    total = np.sum(parts[:, 1])
    if not total:
      return  # No item to weigh in the probe's outputs: the pair's definition stands.
    products = np.where(parts[:, 1] == 0, 0.0, parts[:, 0] * parts[:, 1])
    value, merged = _Floats(value), float(np.sum(products) / total)
    if not np.isfinite(value):
      return  # The whole batch's value tells nothing.
    # Weights of either sign (sample weights on a signed probe) may cancel in the total.
    scale = max(abs(value), abs(merged), float(np.sum(np.abs(products)) / abs(total)))
    if not abs(value - merged) <= tolerance * scale:  # Also where a weighed value is NaN.
      raise ValueError(message.format(f' ({value:.6g}, weight {_Floats(weight):.6g})',
                                      f' ({merged:.6g})'))

  # -- merging -------------------------------------------------------------------------

  def _Weighted(self, value, rule, args, checks):
    """A micro-batch's bare scalar as (value, weight) by its rule; a rule known only when
    the step runs adds its check to `checks`."""
    if rule == 'sum':
      return self._Sum(value, args)
    if rule == 'mean':
      return self._Mean(value, args)
    is_sum, told, untold = rule
    # A probe that cannot tell is fine for a value that is 0 (a scale of 0) or not finite.
    checks.append(_Check(told | tf.equal(value, 0) | ~tf.math.is_finite(value), untold))
    return tuple(tf.where(is_sum, t, m) for t, m in zip(self._Sum(value, args),
                                                          self._Mean(value, args)))

  def _Sum(self, value, args):
    """A sum over the batch: the micro-batch's value times M, weighing 1 / M; 0 for a
    micro-batch without rows, whatever loss_fn made of them (0 times a mean over none)."""
    rows = microbatch.BatchSize(args, self._batch_dim)
    if not (isinstance(rows, int) and rows > 0):
      value = tf.where(rows > 0, value, tf.zeros_like(value))
    return value * self._num_parts, tf.constant(1.0 / self._num_parts, value.dtype)

  def _Mean(self, value, args):
    """A mean over the batch's rows: weighing the micro-batch's share of them."""
    rows = microbatch.BatchSize(args, self._batch_dim)
    return value, tf.cast(rows, value.dtype) / tf.cast(self._batch_size, value.dtype)


def _MapScalars(fn, value):
  """loss_fn's value with fn of each scalar (both of a (value, weight) pair)."""
  def Map(metric):
    return tuple(map(fn, metric)) if _IsPair(metric) else fn(metric)

  if isinstance(value, dict):
    return type(value)({k: Map(v) for k, v in value.items()})
  return Map(value)


def _NoRowsAsZero(value):
  """An empty micro-batch's metrics, those of shape (0,) summed: a Keras loss returns its
  values of no examples unreduced, and their sum, 0, weighs nothing."""
  def Summed(metric):
    if _IsPair(metric) or tf.convert_to_tensor(metric).shape.as_list() != [0]:
      return metric
    return tf.reduce_sum(metric)

  if isinstance(value, dict):
    return type(value)({k: Summed(v) for k, v in value.items()})
  return Summed(value)


def _FloatScalar(value):
  """A bare metric as a float tensor (an int count too: its weight is a fraction)."""
  value = tf.convert_to_tensor(value)
  return value if value.dtype.is_floating else tf.cast(value, tf.float32)


def _Floats(value):
  """An eager probe's scalar as a Python float (via float64: numpy cannot read bfloat16)."""
  with tf.init_scope():
    return float(tf.cast(value, tf.float64))


def _Scalars(value):
  """name -> bare scalar metric of loss_fn's value (pairs left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if not _IsPair(v)}



def _Pairs(value):
  """name -> (value, weight) metric of loss_fn's value (bare scalars left out)."""
  items = value.items() if isinstance(value, dict) else [('loss', value)]
  return {k: v for k, v in items if _IsPair(v)}


def RefuseWeightsRead(layer, read):
  """Refuses a loss_fn that read some of a pipeline `layer`'s weights (a weight penalty): its
  backward starts from the gradients of the outputs, so that gradient would be lost. `read`:
  the variables loss_fn read (usually none, so the layer's own are not listed)."""
  own = {v.ref() for v in layer.trainable_variables} if read else set()
  names = [v.name for v in read if v.ref() in own]
  if names:
    raise ValueError(f'loss_fn reads weights of the pipeline {layer.path} ({names}): their '
                     'gradient through the loss would be lost. Add a weight penalty to the '
                     'gradients ForwardBackward returns, outside it.')
