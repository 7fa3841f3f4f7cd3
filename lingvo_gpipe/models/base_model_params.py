"""SingleTaskModelParams: one experiment's complete configuration, as a class.

An experiment is a subclass living in a params file, `params/<domain>/<file>.py`
(or a user's own params directory), registered with
`@model_registry.RegisterSingleTaskModel` so that trainers find it by the key
`<domain>.<file>.<ClassName>`. Keeping the input of each dataset, the task and
the training settings in one class makes a run reproducible from its key alone.

Example (in a params file the class would also carry the registry decorator):

  >>> from lingvo_gpipe import base_model_params
  >>> from lingvo_gpipe.core import hyperparams
  >>> class TinyLm(base_model_params.SingleTaskModelParams):
  ...   def Train(self):
  ...     p = hyperparams.Params()
  ...     p.Define('batch_size', 32, 'Examples per batch.')
  ...     return p
  ...   def Task(self):
  ...     p = hyperparams.Params()
  ...     p.Define('name', 'lm', 'Task name.')
  ...     return p
  >>> p = TinyLm().Model()
  >>> p.name, p.task.name, p.input
  ('TinyLm', 'lm', None)
  >>> p.train.max_steps = 1000
  >>> TinyLm().Test().batch_size  # Dev and Test default to Train.
  32
"""

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.models import base_model

# The datasets an experiment describes; each is a method of SingleTaskModelParams.
DATASETS = ('Train', 'Dev', 'Test')


class SingleTaskModelParams:
  """Base class of experiments: input params per dataset plus the task params.

  Subclasses must define Train() and Task(); Dev(), Test() and Model() have
  defaults. Methods build fresh params on each call, so callers may mutate them.
  """

  def Train(self):
    """Input-generator params of the training data."""
    raise NotImplementedError(f'{type(self).__name__} must define Train().')

  def Dev(self):
    """Input-generator params of the development data; Train()'s by default."""
    return self.Train()

  def Test(self):
    """Input-generator params of the test data; Train()'s by default."""
    return self.Train()

  @classmethod
  def Defines(cls, dataset):
    """Whether the experiment defines `dataset`'s method itself: Dev() and Test() fall
    back to Train() unless it does."""
    return getattr(cls, dataset) is not getattr(SingleTaskModelParams, dataset)

  def Task(self):
    """Params of the task, i.e. the model layer that is trained."""
    raise NotImplementedError(f'{type(self).__name__} must define Task().')

  def Model(self):
    """The task wrapped with what a trainer needs to run it (SingleTaskModel params).

    `input` is left None here: model_registry.GetParams fills it with the
    params of the dataset being run.
    """
    task = self.Task()
    if not isinstance(task, hyperparams.Params):
      raise TypeError(f'{type(self).__name__}.Task() must return a hyperparams.Params; '
                      f'got {task!r}.')
    train = hyperparams.Params()
    train.Define('max_steps', 100_000, 'Training stops at this global step.')
    train.Define('save_interval_steps', 1000, 'Steps between checkpoints.')
    train.Define('summary_interval_steps', 100, 'Steps between summaries.')
    train.Define('log_interval_steps', 100, 'Steps between log lines.')
    return base_model.SingleTaskModel.Params().Set(name=type(self).__name__, task=task,
                                                    train=train)
