"""Tests of input generators: deterministic with a seed, and holding what they claim."""

import os
import re

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.inputs import input_generators as ig

_TASKS = {'copy': lambda s: s, 'reverse': lambda s: s[::-1], 'sort': sorted}


def _Batches(p, count, start_batch=0):
  dataset = p.Instantiate().GetDataset(start_batch=start_batch)
  return [b.Transform(lambda x: x.numpy()) for b in dataset.take(count)]


def _AssertSameBatches(a, b):
  assert len(a) == len(b)
  for x, y in zip(a, b):
    for u, v in zip(x.Flatten(), y.Flatten()):
      np.testing.assert_array_equal(u, v)


def _Differ(a, b):
  return any(not np.array_equal(u, v) for u, v in zip(a.Flatten(), b.Flatten()))


def _LmParams(**kwargs):
  return ig.SyntheticLmInput.Params().Set(vocab_size=12, min_len=2, max_len=5, seq_len=12,
                                          batch_size=16, seed=3).Set(**kwargs)


def _Seq2SeqParams(**kwargs):
  return ig.SyntheticSeq2SeqInput.Params().Set(vocab_size=12, min_len=1, max_len=5, seq_len=7,
                                               batch_size=16, seed=3).Set(**kwargs)


def _TextFile(tmp_path, text):
  path = tmp_path / 'text.txt'
  path.write_bytes(text.encode('utf-8'))
  return str(path)


_GENERATORS = {
    'lm': _LmParams,
    'seq2seq': _Seq2SeqParams,
    'text': lambda **kw: ig.TextLmInput.Params().Set(seq_len=16, batch_size=4, **kw),
    'image': lambda **kw: ig.SyntheticImageInput.Params().Set(image_shape=(4, 4, 1),
                                                              batch_size=4, **kw),
}


@pytest.mark.parametrize('kind', sorted(_GENERATORS))
def testSameSeedSameBatchesOtherSeedOtherBatches(kind):
  make = _GENERATORS[kind]
  first = _Batches(make(seed=5), 3)
  _AssertSameBatches(_Batches(make(seed=5), 3), first)
  _AssertSameBatches(_Batches(make(seed=5), 1, start_batch=2), first[2:])  # Resuming.
  assert _Differ(_Batches(make(seed=6), 1)[0], first[0])
  assert _Differ(first[0], first[1])


def testNumBatchesMakesAFinitePass():
  dataset = _LmParams(num_batches=3).Instantiate().GetDataset()
  assert len(list(dataset)) == 3
  assert len(list(_LmParams(num_batches=3).Instantiate().GetDataset(start_batch=1))) == 2
  assert dataset.element_spec.ids.shape.as_list() == [16, 12]  # A static batch size.


@pytest.mark.parametrize('task', sorted(_TASKS))
@pytest.mark.parametrize('train_on_source', [False, True])
def testLmExamplesAreBosSourceSepTargetEos(task, train_on_source):
  batch = _Batches(_LmParams(task=task, train_on_source=train_on_source), 1)[0]
  lengths = []
  for ids, labels, paddings, weights in zip(batch.ids, batch.labels, batch.paddings,
                                            batch.weights):
    n = int((1.0 - paddings).sum())
    seq = list(ids[:n]) + [labels[n - 1]]
    np.testing.assert_array_equal(labels[:n], seq[1:])  # Next-token labels.
    assert not ids[n:].any() and not labels[n:].any() and paddings[:n].sum() == 0
    assert seq[0] == ig.BOS_ID and seq[-1] == ig.EOS_ID
    sep = seq.index(ig.SEP_ID)
    source, target = seq[1:sep], seq[sep + 1:-1]
    assert list(target) == list(_TASKS[task](source))
    assert all(ig.NUM_RESERVED_IDS <= s < 12 for s in source)
    lengths.append(len(source))
    expected = np.ones(n) if train_on_source else (np.arange(n) >= len(source) + 1)
    np.testing.assert_array_equal(weights[:n], expected)
    assert not weights[n:].any()
  assert min(lengths) >= 2 and max(lengths) <= 5 and len(set(lengths)) > 1


@pytest.mark.parametrize('task', sorted(_TASKS))
def testSeq2SeqTargetIsTheTaskOfTheSource(task):
  batch = _Batches(_Seq2SeqParams(task=task), 1)[0]
  src, tgt = batch.src, batch.tgt
  for i in range(16):
    s = int((1.0 - src.paddings[i]).sum())
    t = int((1.0 - tgt.paddings[i]).sum())
    source = list(src.ids[i, :s])
    assert not src.ids[i, s:].any() and t == s + 1
    assert list(tgt.labels[i, :t]) == list(_TASKS[task](source)) + [ig.EOS_ID]
    assert list(tgt.ids[i, :t]) == [ig.BOS_ID] + list(tgt.labels[i, :t - 1])
    np.testing.assert_array_equal(tgt.weights[i], 1.0 - tgt.paddings[i])


@pytest.mark.parametrize('make,message', [
    (lambda: _LmParams(seq_len=11), r'seq_len=11 cannot hold sources of max_len=5; expected '
                                    r'seq_len >= 12'),
    (lambda: _Seq2SeqParams(seq_len=5), r'expected seq_len >= 6'),
    (lambda: _LmParams(task='add'), r"unknown task 'add'"),
    (lambda: _LmParams(vocab_size=4), 'vocab_size must exceed the 4 reserved ids'),
    (lambda: _LmParams(min_len=6), 'expected 1 <= min_len <= max_len'),
    (lambda: _LmParams(batch_size=0), 'batch_size must be positive'),
    (lambda: ig.TextLmInput.Params().Set(split='valid'), "unknown split 'valid'"),
    (lambda: ig.TextLmInput.Params().Set(vocab_size=300), 'vocab_size must be 256'),
])
def testBadParamsAreClearErrors(make, message):
  with pytest.raises(ValueError, match=message):
    make().Instantiate()


# -- text ---------------------------------------------------------------------------


def testTextWindowsAreSlicesOfTheirSplit(tmp_path):
  text = ''.join(f'Ligne {i}: déjà vu, naïve café — π≈3.14. ' for i in range(60))
  data = text.encode('utf-8')
  path = _TextFile(tmp_path, text)
  heldout = int(len(data) * 0.2)
  regions = {'train': data[:len(data) - heldout],
             'dev': data[len(data) - heldout:len(data) - heldout + heldout // 2],
             'test': data[len(data) - heldout + heldout // 2:]}
  for split, region in regions.items():
    p = ig.TextLmInput.Params().Set(input_file=path, split=split, heldout_fraction=0.2,
                                    seq_len=24, batch_size=4)
    batches = _Batches(p, 3)
    windows = [bytes(list(ids) + [labels[-1]]) for b in batches
               for ids, labels in zip(b.ids, b.labels)]
    for b in batches:
      np.testing.assert_array_equal(b.ids[:, 1:], b.labels[:, :-1])
      assert not b.paddings.any() and b.weights.all()
    assert all(w in region for w in windows)
    if split != 'train':  # Consecutive windows through the part, from its start.
      num_windows = (len(region) - 1) // 24
      starts = [(i % num_windows) * 24 for i in range(12)]
      assert windows == [region[s:s + 25] for s in starts]
    else:
      assert len(set(windows)) == len(windows)


def testDefaultTextIsShippedAndReadable():
  batch = _Batches(ig.TextLmInput.Params().Set(seq_len=32, batch_size=2), 1)[0]
  assert batch.ids.shape == (2, 32) and batch.ids.max() < 256
  with open(ig.DEFAULT_TEXT_FILE, 'rb') as f:
    assert bytes(list(batch.ids[0])) in f.read()


def testTooShortTextIsAClearError(tmp_path):
  p = ig.TextLmInput.Params().Set(input_file=_TextFile(tmp_path, 'x' * 200), seq_len=16,
                                  split='dev')
  with pytest.raises(ValueError, match=r'the dev part of .* has 10 bytes \(200 in the file\); '
                                       r'expected at least seq_len \+ 1 = 17'):
    p.Instantiate()


@pytest.mark.parametrize('params', [ig.TextLmInput.Params(), ig.NpzImageInput.Params()])
def testMissingInputFileIsAClearError(tmp_path, params):
  missing = str(tmp_path / 'nowhere.bin')
  with pytest.raises(ValueError, match=rf"cannot read input_file '{re.escape(missing)}': "
                                       r'No such file or directory'):
    params.Set(input_file=missing).Instantiate()


@pytest.mark.parametrize('params', [ig.TextLmInput.Params(), ig.NpzImageInput.Params()])
@pytest.mark.parametrize('kind', ['a named pipe', 'a directory'])
def testAnInputFileThatIsNotARegularFileIsAClearError(tmp_path, params, kind):
  path = str(tmp_path / 'special')
  if kind == 'a named pipe':
    os.mkfifo(path)  # Opening it would wait for a writer: the test would hang.
  else:
    os.mkdir(path)
  with pytest.raises(ValueError, match=rf"input_file '{re.escape(path)}' is not a regular file "
                                       rf'\({kind}\); expected a file.'):
    params.Set(input_file=path).Instantiate()


# -- images -------------------------------------------------------------------------


def testSyntheticImagesShareClassTemplatesAcrossSeeds():
  def Batch(seed, noise):
    return _Batches(ig.SyntheticImageInput.Params().Set(
        image_shape=(4, 4, 2), num_classes=3, noise=noise, batch_size=32, seed=seed), 1)[0]

  templates = {}
  for seed in (1, 2):
    b = Batch(seed, noise=0.0)
    assert b.image.shape == (32, 4, 4, 2) and b.label.dtype == np.int32
    assert set(b.label) == {0, 1, 2}
    for image, label in zip(b.image, b.label):
      np.testing.assert_array_equal(templates.setdefault(label, image), image)
  noisy = Batch(1, noise=1.0)
  residual = noisy.image - np.stack([templates[label] for label in noisy.label])
  assert 0.8 < residual.std() < 1.2


def _NpzFile(tmp_path, num=10, num_classes=4, **overrides):
  arrays = dict(images=np.arange(num, dtype=np.uint8)[:, None, None, None] *
                np.ones([num, 2, 3, 1], np.uint8),
                labels=np.arange(num) % num_classes)
  arrays.update(overrides)
  path = tmp_path / 'images.npz'
  np.savez(path, **arrays)
  return str(path)


def testNpzImagesKeepTheirLabelsAndVisitEveryExampleEachEpoch(tmp_path):
  p = ig.NpzImageInput.Params().Set(input_file=_NpzFile(tmp_path), image_shape=(2, 3, 1),
                                    num_classes=4, batch_size=5)
  batches = _Batches(p, 4)
  images = np.concatenate([b.image for b in batches])
  labels = np.concatenate([b.label for b in batches])
  index = np.rint(images[:, 0, 0, 0] * 255.0).astype(int)  # uint8 scaled to [0, 1].
  np.testing.assert_allclose(images, index[:, None, None, None] / 255.0 * np.ones([1, 2, 3, 1]),
                             rtol=1e-6)
  np.testing.assert_array_equal(labels, index % 4)
  assert sorted(index[:10]) == list(range(10)) and sorted(index[10:]) == list(range(10))
  assert list(index[:10]) != list(index[10:])  # A new order each epoch.
  assert list(index[:10]) != list(range(10))


@pytest.mark.parametrize('overrides,message', [
    (dict(images=np.zeros([10, 3, 3, 1], np.uint8)), r'expected \[N, \*image_shape=\[2, 3, 1\]\]'),
    (dict(labels=np.arange(10)), r'labels of .* span \[0, 9\]; expected \[0, num_classes=4\)'),
])
def testBadNpzIsAClearError(tmp_path, overrides, message):
  p = ig.NpzImageInput.Params().Set(input_file=_NpzFile(tmp_path, **overrides),
                                    image_shape=(2, 3, 1), num_classes=4, batch_size=5)
  with pytest.raises(ValueError, match=message):
    p.Instantiate()
