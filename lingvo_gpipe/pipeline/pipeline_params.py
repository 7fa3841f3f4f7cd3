"""The pipelines of a model's params: find them, read their layers and stages, re-cut them.

One API for every tool that works on params before anything is built (the
trainer, the balance planner, print_model, plan_balance, check_pipeline). How
a pipeline class holds its layers in its params is the class's own business:
PipeliningLayer reads its FeatureExtractionLayer cells, a GPipe stack its
`splits` (their classmethods NumStagesOf, LayersAndEnds, Recut, GluedLayers,
InputSpec, TieLayers); nothing here probes for fields.

Example:
  for path, p in pipeline_params.Find(model_params.task, 'task'):
    layer_params, ends = pipeline_params.LayersAndEnds(p)
    pipeline_params.Recut(p, [2, 5, len(layer_params)])
"""

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import microbatch


def IsPipeline(params):
  """Whether `params` configure a PipeliningLayer (or a subclass, e.g. a GPipe stack)."""
  return (isinstance(params, hyperparams.InstantiableParams) and isinstance(params.cls, type)
          and issubclass(params.cls, gpipe.PipeliningLayer))


def Find(params, path=''):
  """(dotted path, params) of every pipeline in the params tree, outermost first.

  A pipeline's own cells are not searched: a pipeline inside a cell runs
  inside its stage, not as a pipeline of the model.
  """
  if IsPipeline(params):
    yield path, params
    return
  for name, value in params.IterParams():
    children = value if isinstance(value, (list, tuple)) else [value]
    for i, child in enumerate(children):
      if isinstance(child, hyperparams.Params):
        key = f'{path}.{name}' if path else name
        yield from Find(child, f'{key}[{i}]' if isinstance(value, (list, tuple)) else key)


def NumStages(p):
  """K of pipeline params `p`."""
  return p.cls.NumStagesOf(p)


def MaxStages(params):
  """The most stages of any pipeline in the params tree (0 if none)."""
  return max((NumStages(p) for _, p in Find(params)), default=0)


def MaxDevices(params):
  """The most devices any pipeline of the params tree runs on: K x its own replicas."""
  return max((NumStages(p) * p.num_replicas for _, p in Find(params)), default=0)


def LayersAndEnds(p):
  """(layer params in the order they run, ascending end index of each stage) of `p`."""
  return p.cls.LayersAndEnds(p)


def Recut(p, ends):
  """Cuts pipeline params `p` (in place) into stages ending at layer indices `ends`."""
  p.cls.Recut(p, list(ends))


def NumMicroBatches(p, batch_size):
  """M of pipeline params `p` for a whole (training) batch of `batch_size`.

  Raises a ValueError if the configured batch does not give every micro-batch of every
  replica an example; M need not divide the batch (micro-batches then differ by a row).
  """
  return microbatch.NumMicroBatches(batch_size, p.num_micro_batches, p.micro_batch_size,
                                    p.num_replicas)


def CheckBatch(params, batch_size, batch_name, path=''):
  """Raises a ValueError naming both params if a pipeline would split the configured batch
  into empty micro-batches: it must hold an example per micro-batch of each replica."""
  for where, p in Find(params, path):
    try:
      NumMicroBatches(p, batch_size)
    except ValueError as e:
      split = (f'{where}.micro_batch_size={p.micro_batch_size}' if p.micro_batch_size
               else f'{where}.num_micro_batches={p.num_micro_batches}')
      replicas = f' x {where}.num_replicas={p.num_replicas}' if p.num_replicas > 1 else ''
      raise ValueError(f'{batch_name}={batch_size} cannot be split by {split}{replicas}: '
                       f'{e}') from None
