"""BaseInputGenerator: batches of NestedMaps from a tf.data pipeline, fixed by a seed.

Example `i` of a generator is a pure function of its params and `i` (random
choices use stateless ops seeded by (seed, i)), so the same params give the same
batches on every run, whatever tf.data's parallelism, and a dataset started at
batch `n` continues a previous run exactly.

How a trainer iterates:

  p = model_registry.GetParams('lm.synthetic.GPipeTransformerLmTiny', 'Train').input
  gen = p.Instantiate()
  for batch in gen.GetDataset(start_batch=global_step):  # Train: repeats forever.
    metrics, grads = task.ForwardBackward(task.theta, batch)
    ...

Inside a tf.function, take batches with `iterator = iter(dataset)` outside and
`next(iterator)` inside. Dev and Test params set `num_batches`, so iterating
their dataset is one finite pass. Batches have a static batch size (the last
partial batch is dropped), as pipelines split them into micro-batches.
"""

import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams


class BaseInputGenerator:
  """Base class of input generators: subclasses define ExampleAt."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define('name', 'input', 'Name of this input in logs.')
    p.Define('batch_size', 8, 'Examples per batch: the global batch a pipeline splits.')
    p.Define('seed', 0, 'Seed of every random choice; the same seed gives the same batches.')
    p.Define('num_batches', None,
             'Batches in one pass over the dataset; None repeats forever, as training does.')
    p.Define('prefetch_batches', 2,
             'Batches prepared ahead of the consumer; tf.data.AUTOTUNE (-1) tunes it.')
    return p

  def __init__(self, params):
    self._params = params.Copy().Freeze()
    p = self._params
    for name in ('batch_size', 'seed', 'prefetch_batches'):
      value = p.Get(name)
      if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f'{p.name}: {name} must be an int, got {value!r}.')
    if p.batch_size < 1:
      raise ValueError(f'{p.name}: batch_size must be positive, got {p.batch_size}.')
    if p.prefetch_batches < 0 and p.prefetch_batches != tf.data.AUTOTUNE:
      raise ValueError(f'{p.name}: prefetch_batches must be >= 0 or tf.data.AUTOTUNE '
                       f'({tf.data.AUTOTUNE}), got {p.prefetch_batches}.')
    if p.num_batches is not None and not (isinstance(p.num_batches, int) and p.num_batches > 0):
      raise ValueError(f'{p.name}: num_batches must be None or a positive int, got '
                       f'{p.num_batches!r}.')

  @property
  def params(self):
    """The frozen params of this generator."""
    return self._params

  def ExampleSeed(self, index, salt=0):
    """A stateless seed for example `index`; `salt` tells apart draws of one example."""
    seed = tf.constant([self.params.seed, 0], tf.int64)
    seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(index, tf.int64))
    return tf.random.experimental.stateless_fold_in(seed, salt)

  def ExampleAt(self, index):
    """Example `index` (a scalar int64 tensor) as a NestedMap of tensors of static shape."""
    raise NotImplementedError(f'{type(self).__name__}.ExampleAt')

  def GetDataset(self, start_batch=0):
    """The tf.data.Dataset of NestedMap batches, from batch `start_batch` on."""
    p = self.params
    examples = tf.data.Dataset.counter(start_batch * p.batch_size).map(
        self.ExampleAt, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
    batches = examples.batch(p.batch_size, drop_remainder=True)
    if p.num_batches is not None:
      batches = batches.take(max(p.num_batches - start_batch, 0))
    return batches.prefetch(p.prefetch_batches)
