"""Splitting a batch into micro-batches and reassembling it.

Every tensor of an input structure (a tensor, tuple or NestedMap) is split along
the batch dimension; non-tensor leaves such as None are shared by all
micro-batches. A batch of N rows splits into M parts as evenly as it can: the
first N % M parts hold one row more (10 rows, M=4: 3, 3, 2, 2). N may be
unknown when the graph is traced (a `[None, d]` signature): the part sizes are
then tensors, computed the same way from the batch at run time. Sizes are
checked up front so a bad batch is a clear error, not a failure deep inside a
pipeline stage.
"""

import tensorflow as tf


def _Tensors(structure):
  return [x for x in tf.nest.flatten(structure) if isinstance(x, (tf.Tensor, tf.Variable))]


def StaticBatchSize(structure, batch_dim: int) -> int | None:
  """The common batch size of all tensors in `structure`, or None if unknown at trace time."""
  sizes = set()
  for x in _Tensors(structure):
    if x.shape.rank is None or x.shape.rank <= batch_dim:
      raise ValueError(f'Input of shape {x.shape} has no batch dimension {batch_dim}.')
    sizes.add(x.shape[batch_dim])
  if not sizes:
    raise ValueError('The pipeline input holds no tensor to split into micro-batches.')
  known = sorted(s for s in sizes if s is not None)
  if len(known) > 1:
    raise ValueError(f'Pipeline inputs disagree on the batch size: {known} at '
                     f'dimension {batch_dim}.')
  return known[0] if known else None


def CheckLabels(labels, rows, batch_dim: int) -> None:
  """A ValueError unless every tensor of `labels` (None, or a structure) has the batch's
  `rows` (an int; a tensor, unknown at trace time, is not checked): labels are split into
  micro-batches as the inputs are, so a loss must not depend on the split by broadcasting."""
  for x in _Tensors(labels):
    if x.shape.rank is not None and x.shape.rank <= batch_dim:
      got = f'no batch dimension {batch_dim}'
    else:
      size = x.shape[batch_dim] if x.shape.rank is not None else None
      if size is None or not isinstance(rows, int) or size == rows:
        continue
      got = f'{size} rows at batch_dim={batch_dim}'
    raise ValueError(f'A labels tensor of shape {x.shape} has {got}; the inputs have {rows} '
                     "rows. Labels are batched like the inputs (each micro-batch's loss gets "
                     'its rows): one row per example.')


def BatchSize(structure, batch_dim: int) -> int | tf.Tensor:
  """The batch size of `structure`: an int if known at trace time, else a scalar int32 tensor."""
  static = StaticBatchSize(structure, batch_dim)
  if static is not None:
    return static
  return tf.shape(_Tensors(structure)[0])[batch_dim]


def Sizes(batch_size: int | tf.Tensor, num_parts: int) -> list:
  """The rows of each of num_parts parts of a batch: ints, or tensors for a tensor batch size."""
  if isinstance(batch_size, int):
    base, rest = divmod(batch_size, num_parts)
    return [base + (m < rest) for m in range(num_parts)]
  base, rest = batch_size // num_parts, batch_size % num_parts
  return [base + tf.cast(m < rest, batch_size.dtype) for m in range(num_parts)]


def Offsets(sizes: list) -> list:
  """Where each part of `sizes` starts in the batch."""
  offsets = [0]
  for size in sizes[:-1]:
    offsets.append(offsets[-1] + size)
  return offsets


def NumMicroBatches(batch_size: int | None, num_micro_batches: int = 1,
                    micro_batch_size: int | None = None, num_replicas: int = 1,
                    allow_empty: bool = False) -> int:
  """M per replica, from either M or the micro-batch size.

  batch_size: the whole batch's rows, or None if unknown at trace time (then
    M must be given as num_micro_batches). micro_batch_size gives M = the
    largest replica part's rows / micro_batch_size, rounded up.
  allow_empty: whether a batch may leave micro-batches without rows (a pipeline
    runs them on no rows, and they add nothing: a last partial batch, one example
    served); a configured batch size may not, as its every step would idle in them.
  """
  if micro_batch_size is not None:
    if not isinstance(micro_batch_size, int) or micro_batch_size < 1:
      raise ValueError(f'micro_batch_size must be a positive int, got {micro_batch_size!r}.')
    if batch_size is None:
      raise ValueError(f'micro_batch_size={micro_batch_size} needs a batch size known at '
                       'trace time; with a batch of unknown size set num_micro_batches.')
    largest_part = -(-batch_size // num_replicas)
    num = -(-largest_part // micro_batch_size)
  else:
    if not isinstance(num_micro_batches, int) or num_micro_batches < 1:
      raise ValueError(f'num_micro_batches must be a positive int, got {num_micro_batches!r}.')
    num = num_micro_batches
  if batch_size is not None and not allow_empty and batch_size < num * num_replicas:
    replicas = f' x num_replicas={num_replicas}' if num_replicas > 1 else ''
    raise ValueError(f'A batch of {batch_size} examples is smaller than num_micro_batches='
                     f'{num}{replicas}: every micro-batch needs at least one example (a '
                     'configured batch that leaves some empty idles the pipeline every step).')
  return num


def Split(structure, num_parts: int, batch_dim: int = 0) -> list:
  """A list of num_parts structures, part m holding its Sizes() rows, in order."""
  sizes = Sizes(BatchSize(structure, batch_dim), num_parts)
  if not isinstance(sizes[0], int):
    sizes = tf.stack(sizes)

  def SplitLeaf(x):
    if isinstance(x, (tf.Tensor, tf.Variable)):
      return tf.split(x, sizes, num=num_parts, axis=batch_dim)
    return [x] * num_parts

  pieces = [SplitLeaf(x) for x in tf.nest.flatten(structure)]
  return [tf.nest.pack_sequence_as(structure, [p[m] for p in pieces])
          for m in range(num_parts)]


def Part(structure, index: int | tf.Tensor, size: int | tf.Tensor, batch_dim: int = 0):
  """Micro-batch `index` (an int or a tensor) of parts of `size` rows: as Split's part when
  they are of one size. Made where each tensor is."""
  def Leaf(x):
    if not isinstance(x, (tf.Tensor, tf.Variable)):
      return x
    begin = [0] * x.shape.rank
    begin[batch_dim] = index * size
    sizes = [-1] * x.shape.rank
    sizes[batch_dim] = size
    with tf.device(None), tf.device(x.device):
      return tf.slice(x, tf.stack(begin), sizes)
  return tf.nest.map_structure(Leaf, structure)


def Merge(micro_batches: list, batch_dim: int = 0):
  """Concatenates M structures back into one batch (inverse of Split)."""
  flats = [tf.nest.flatten(mb) for mb in micro_batches]

  def MergeLeaf(values):
    if isinstance(values[0], (tf.Tensor, tf.Variable)):
      return values[0] if len(values) == 1 else tf.concat(values, axis=batch_dim)
    return values[0]

  return tf.nest.pack_sequence_as(micro_batches[0], [MergeLeaf(v) for v in zip(*flats)])
