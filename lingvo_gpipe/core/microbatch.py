"""Splitting a batch into micro-batches and reassembling it.

Every tensor of an input structure (a tensor, tuple or NestedMap) is split along
the batch dimension; non-tensor leaves such as None are shared by all
micro-batches. Sizes are checked up front so a bad batch is a clear error, not a
failure deep inside a pipeline stage.
"""

import tensorflow as tf


def _Tensors(structure):
  return [x for x in tf.nest.flatten(structure) if isinstance(x, (tf.Tensor, tf.Variable))]


def BatchSize(structure, batch_dim):
  """The common static batch size of all tensors in `structure`."""
  sizes = set()
  for x in _Tensors(structure):
    if x.shape.rank is None or x.shape.rank <= batch_dim:
      raise ValueError(f'Input of shape {x.shape} has no batch dimension {batch_dim}.')
    size = x.shape[batch_dim]
    if size is None:
      raise ValueError(f'Input of shape {x.shape} has an unknown batch size at dimension '
                       f'{batch_dim}; the pipeline needs a static batch size.')
    sizes.add(size)
  if not sizes:
    raise ValueError('The pipeline input holds no tensor to split into micro-batches.')
  if len(sizes) > 1:
    raise ValueError(f'Pipeline inputs disagree on the batch size: {sorted(sizes)} at '
                     f'dimension {batch_dim}.')
  return sizes.pop()


def NumMicroBatches(batch_size, num_micro_batches=1, micro_batch_size=None):
  """M from either M or the micro-batch size, checked against the batch size."""
  if micro_batch_size is not None:
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
      raise ValueError(f'micro_batch_size must be a positive int, got {micro_batch_size!r}.')
    if batch_size % micro_batch_size:
      raise ValueError(f'Batch size {batch_size} is not divisible by micro_batch_size '
                       f'{micro_batch_size}.')
    return batch_size // micro_batch_size
  if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
    raise ValueError(f'num_micro_batches must be a positive int, got {num_micro_batches!r}.')
  if num_micro_batches > batch_size:
    raise ValueError(f'num_micro_batches={num_micro_batches} is larger than the batch size '
                     f'{batch_size}: every micro-batch needs at least one example.')
  if batch_size % num_micro_batches:
    raise ValueError(f'Batch size {batch_size} is not divisible by num_micro_batches='
                     f'{num_micro_batches}.')
  return num_micro_batches


def Split(structure, num_micro_batches, batch_dim=0):
  """A list of M structures, micro-batch m holding rows [m*N/M, (m+1)*N/M)."""
  def SplitLeaf(x):
    if isinstance(x, (tf.Tensor, tf.Variable)):
      return tf.split(x, num_micro_batches, axis=batch_dim)
    return [x] * num_micro_batches

  pieces = [SplitLeaf(x) for x in tf.nest.flatten(structure)]
  return [tf.nest.pack_sequence_as(structure, [p[m] for p in pieces])
          for m in range(num_micro_batches)]


def Merge(micro_batches, batch_dim=0):
  """Concatenates M structures back into one batch (inverse of Split)."""
  flats = [tf.nest.flatten(mb) for mb in micro_batches]

  def MergeLeaf(values):
    if isinstance(values[0], (tf.Tensor, tf.Variable)):
      return values[0] if len(values) == 1 else tf.concat(values, axis=batch_dim)
    return values[0]

  return tf.nest.pack_sequence_as(micro_batches[0], [MergeLeaf(v) for v in zip(*flats)])
