"""Input generators: synthetic sequence tasks, byte-level text and images.

Sequence batches follow the streams of models/state_layers.py:
  language model: NestedMap(ids, labels, paddings, weights), each [B, seq_len];
  encoder-decoder: NestedMap(src=NestedMap(ids, paddings),
                             tgt=NestedMap(ids, labels, paddings, weights)).
Image batches are NestedMap(image [B, H, W, C] float32, label [B] int32).

The synthetic sequence tasks are learnable by construction: a random source of
symbols and a target that is a fixed function of it (copy, reverse or sort).
"""

import contextlib
import os
import stat

import numpy as np
import tensorflow as tf

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.inputs import base_input_generator

# Ids of the synthetic vocabularies; symbols are the ids from NUM_RESERVED_IDS on.
PAD_ID, BOS_ID, EOS_ID, SEP_ID = 0, 1, 2, 3
NUM_RESERVED_IDS = 4
SYNTHETIC_TASKS = ('copy', 'reverse', 'sort')

# The byte-level text input's vocabulary: one id per byte value.
NUM_BYTES = 256

_FILE_KINDS = {stat.S_IFIFO: 'a named pipe', stat.S_IFDIR: 'a directory',
               stat.S_IFCHR: 'a character device', stat.S_IFBLK: 'a block device',
               stat.S_IFSOCK: 'a socket'}

# lingvo_gpipe/data (package data, pyproject.toml), beside this package.
DEFAULT_TEXT_FILE = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'data',
                                 'pipelines.txt')
TEXT_SPLITS = ('train', 'dev', 'test')


@contextlib.contextmanager
def _ReadingInputFile(p):
  """Turns a missing, unreadable or not regular input_file into a ValueError naming it.

  Reading a named pipe or a device would wait for a writer or never end.
  """
  try:
    kind = stat.S_IFMT(os.stat(p.input_file).st_mode)
    if kind != stat.S_IFREG:
      raise ValueError(f'{p.name}: input_file {p.input_file!r} is not a regular file '
                       f'({_FILE_KINDS.get(kind, "a special file")}); expected a file.')
    yield
  except OSError as e:
    raise ValueError(f'{p.name}: cannot read input_file {p.input_file!r}: '
                     f'{e.strerror or e}.') from None


def _PadTo(x, length, value=0):
  """Pads the 1-D `x` at the end to the static `length`."""
  return tf.ensure_shape(tf.pad(x, [[0, length - tf.size(x)]], constant_values=value), [length])


def _Paddings(length, seq_len):
  """[seq_len] float paddings, 1.0 from position `length` on."""
  return 1.0 - tf.sequence_mask(length, seq_len, dtype=tf.float32)


class _SyntheticSequenceInput(base_input_generator.BaseInputGenerator):
  """Random sources of min_len..max_len symbols, and their task targets."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('task', 'reverse', f'How the target follows from the source: {SYNTHETIC_TASKS}.')
    p.Define('vocab_size', 14,
             f'Ids 0..{NUM_RESERVED_IDS - 1} are pad, bos, eos and sep; the rest are symbols.')
    p.Define('min_len', 1, 'Fewest symbols of a source.')
    p.Define('max_len', 8, 'Most symbols of a source.')
    p.Define('seq_len', 20, 'Padded length of every sequence of a batch.')
    return p

  @classmethod
  def MinSeqLen(cls, p):
    """The shortest seq_len that holds the longest example."""
    raise NotImplementedError(f'{cls.__name__}.MinSeqLen')

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.task not in SYNTHETIC_TASKS:
      raise ValueError(f'{p.name}: unknown task {p.task!r}; expected one of '
                       f'{list(SYNTHETIC_TASKS)}.')
    if not (isinstance(p.vocab_size, int) and p.vocab_size > NUM_RESERVED_IDS):
      raise ValueError(f'{p.name}: vocab_size must exceed the {NUM_RESERVED_IDS} reserved ids, '
                       f'got {p.vocab_size!r}.')
    if not (isinstance(p.min_len, int) and isinstance(p.max_len, int) and
            1 <= p.min_len <= p.max_len):
      raise ValueError(f'{p.name}: expected 1 <= min_len <= max_len, got min_len={p.min_len!r}, '
                       f'max_len={p.max_len!r}.')
    if not isinstance(p.seq_len, int) or p.seq_len < self.MinSeqLen(p):
      raise ValueError(f'{p.name}: seq_len={p.seq_len!r} cannot hold sources of max_len='
                       f'{p.max_len}; expected seq_len >= {self.MinSeqLen(p)}.')

  def SourceAndTarget(self, index):
    """The 1-D int32 source and target symbols of example `index`."""
    p = self.params
    length = tf.random.stateless_uniform([], self.ExampleSeed(index, 0), p.min_len,
                                         p.max_len + 1, dtype=tf.int32)
    symbols = tf.random.stateless_uniform([p.max_len], self.ExampleSeed(index, 1),
                                          NUM_RESERVED_IDS, p.vocab_size, dtype=tf.int32)
    source = symbols[:length]
    if p.task == 'copy':
      return source, source
    if p.task == 'reverse':
      return source, tf.reverse(source, [0])
    return source, tf.sort(source)


class SyntheticLmInput(_SyntheticSequenceInput):
  """Language modelling of `bos source sep target eos`, e.g. `bos 5 9 7 sep 7 9 5 eos`.

  The source symbols are random, so by default only the target and eos (the
  learnable part) carry weight; train_on_source adds the source.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('train_on_source', False,
             'Weigh the (unpredictable, random) source symbols in the loss too.')
    return p

  @classmethod
  def MinSeqLen(cls, p):
    return 2 * p.max_len + 2  # bos, source, sep, target; the labels end with eos.

  def ExampleAt(self, index):
    p = self.params
    source, target = self.SourceAndTarget(index)
    seq = tf.concat([[BOS_ID], source, [SEP_ID], target, [EOS_ID]], axis=0)
    paddings = _Paddings(tf.size(seq) - 1, p.seq_len)
    weights = 1.0 - paddings
    if not p.train_on_source:
      # Labels 0..len(source) are the source symbols and sep.
      weights *= 1.0 - tf.sequence_mask(tf.size(source) + 1, p.seq_len, dtype=tf.float32)
    return py_utils.NestedMap(ids=_PadTo(seq[:-1], p.seq_len), labels=_PadTo(seq[1:], p.seq_len),
                              paddings=paddings, weights=weights)


class SyntheticSeq2SeqInput(_SyntheticSequenceInput):
  """Translation of a source into its target: src `5 9 7`, tgt `bos 7 9 5` -> `7 9 5 eos`."""

  @classmethod
  def MinSeqLen(cls, p):
    return p.max_len + 1  # The target and bos (ids) or eos (labels).

  def ExampleAt(self, index):
    p = self.params
    source, target = self.SourceAndTarget(index)
    src = py_utils.NestedMap(ids=_PadTo(source, p.seq_len),
                             paddings=_Paddings(tf.size(source), p.seq_len))
    tgt_paddings = _Paddings(tf.size(target) + 1, p.seq_len)
    tgt = py_utils.NestedMap(ids=_PadTo(tf.concat([[BOS_ID], target], 0), p.seq_len),
                             labels=_PadTo(tf.concat([target, [EOS_ID]], 0), p.seq_len),
                             paddings=tgt_paddings, weights=1.0 - tgt_paddings)
    return py_utils.NestedMap(src=src, tgt=tgt)


class TextLmInput(base_input_generator.BaseInputGenerator):
  """Byte-level language modelling of a text file: ids are byte values, no tokenizer.

  The file's last `heldout_fraction` is held out, its first half for 'dev' and
  its second for 'test'; 'train' windows start at random offsets of the rest,
  'dev' and 'test' windows follow each other through their part (and repeat).
  The file is read into memory.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_file', DEFAULT_TEXT_FILE, 'The text file (any UTF-8, or any bytes).')
    p.Define('split', 'train', f'Which part of the file: one of {TEXT_SPLITS}.')
    p.Define('heldout_fraction', 0.1, 'Share of the file, at its end, held out for dev and test.')
    p.Define('seq_len', 64, 'Bytes per example.')
    p.Define('vocab_size', NUM_BYTES, f'Number of ids: {NUM_BYTES}, one per byte value.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    if p.split not in TEXT_SPLITS:
      raise ValueError(f'{p.name}: unknown split {p.split!r}; expected one of '
                       f'{list(TEXT_SPLITS)}.')
    if p.vocab_size != NUM_BYTES:
      raise ValueError(f'{p.name}: vocab_size must be {NUM_BYTES} (byte values), got '
                       f'{p.vocab_size!r}.')
    if not 0.0 < p.heldout_fraction < 1.0:
      raise ValueError(f'{p.name}: heldout_fraction must be in (0, 1), got '
                       f'{p.heldout_fraction!r}.')
    if not (isinstance(p.seq_len, int) and p.seq_len > 0):
      raise ValueError(f'{p.name}: seq_len must be a positive int, got {p.seq_len!r}.')
    with _ReadingInputFile(p), open(p.input_file, 'rb') as f:
      data = f.read()
    start, end = self.SplitRange(len(data))
    if end - start < p.seq_len + 1:
      raise ValueError(f'{p.name}: the {p.split} part of {p.input_file} has {end - start} bytes '
                       f'({len(data)} in the file); expected at least seq_len + 1 = '
                       f'{p.seq_len + 1}.')
    self._data = tf.constant(np.frombuffer(data[start:end], dtype=np.uint8))

  def SplitRange(self, size):
    """[start, end) of this split in a file of `size` bytes."""
    p = self.params
    heldout = int(size * p.heldout_fraction)
    dev_start = size - heldout
    test_start = dev_start + heldout // 2
    return {'train': (0, dev_start), 'dev': (dev_start, test_start),
            'test': (test_start, size)}[p.split]

  def ExampleAt(self, index):
    p = self.params
    size = tf.size(self._data, out_type=tf.int64)
    if p.split == 'train':
      start = tf.random.stateless_uniform([], self.ExampleSeed(index), 0, size - p.seq_len,
                                          dtype=tf.int64)
    else:
      num_windows = (size - 1) // p.seq_len
      start = (index % num_windows) * p.seq_len
    window = tf.cast(self._data[start:start + p.seq_len + 1], tf.int32)
    return py_utils.NestedMap(ids=tf.ensure_shape(window[:-1], [p.seq_len]),
                              labels=tf.ensure_shape(window[1:], [p.seq_len]),
                              paddings=tf.zeros([p.seq_len]), weights=tf.ones([p.seq_len]))


class _ImageInput(base_input_generator.BaseInputGenerator):
  """Images and labels; subclasses say where they come from."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('image_shape', (16, 16, 3), '(height, width, channels) of the images.')
    p.Define('num_classes', 10, 'Number of classes; labels lie in [0, num_classes).')
    return p


class SyntheticImageInput(_ImageInput):
  """Noisy copies of one random template per class: learnable, as the class shows.

  The templates depend only on template_seed, so Train, Dev and Test (which
  differ in `seed`) pose the same task.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('template_seed', 1234, 'Seed of the class templates, shared by every split.')
    p.Define('noise', 1.0, 'Standard deviation of the noise added to the templates.')
    return p

  def ExampleAt(self, index):
    p = self.params
    label = tf.random.stateless_uniform([], self.ExampleSeed(index, 0), 0, p.num_classes,
                                        dtype=tf.int32)
    template_seed = tf.random.experimental.stateless_fold_in(
        tf.constant([p.template_seed, 0], tf.int64), label)
    template = tf.random.stateless_normal(p.image_shape, template_seed)
    noise = tf.random.stateless_normal(p.image_shape, self.ExampleSeed(index, 1),
                                       stddev=p.noise)
    return py_utils.NestedMap(image=template + noise, label=label)


class NpzImageInput(_ImageInput):
  """Images and labels of a .npz file, shuffled anew each epoch (by seed and epoch).

  The file holds `images` [N, H, W, C] (uint8 images are scaled to [0, 1]) and
  `labels` [N]; it is read into memory.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define('input_file', '', 'The .npz file.')
    p.Define('images_key', 'images', 'Name of the images array in the file.')
    p.Define('labels_key', 'labels', 'Name of the labels array in the file.')
    return p

  def __init__(self, params):
    super().__init__(params)
    p = self.params
    with _ReadingInputFile(p), np.load(p.input_file) as data:
      images, labels = data[p.images_key], data[p.labels_key]
    if len(labels) < p.batch_size:
      raise ValueError(f'{p.name}: {p.input_file} has {len(labels)} examples; expected at '
                       f'least batch_size={p.batch_size}.')
    if images.shape[1:] != tuple(p.image_shape) or labels.shape != images.shape[:1]:
      raise ValueError(f'{p.name}: {p.input_file} has images {images.shape} and labels '
                       f'{labels.shape}; expected [N, *image_shape={list(p.image_shape)}] '
                       'and [N].')
    if labels.size and not 0 <= labels.min() <= labels.max() < p.num_classes:
      raise ValueError(f'{p.name}: labels of {p.input_file} span [{labels.min()}, '
                       f'{labels.max()}]; expected [0, num_classes={p.num_classes}).')
    if images.dtype == np.uint8:
      images = images / 255.0
    self._images = tf.constant(images, tf.float32)
    self._labels = tf.constant(labels, tf.int32)

  def ExampleAt(self, index):
    num = tf.shape(self._labels, out_type=tf.int64)[0]
    epoch_seed = self.ExampleSeed(index // num)
    order = tf.random.experimental.stateless_shuffle(tf.range(num), epoch_seed)
    i = order[index % num]
    return py_utils.NestedMap(image=self._images[i], label=self._labels[i])
