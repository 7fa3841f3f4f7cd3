"""Checkpoints named by global step that survive kill -9 and refuse other models.

`<dir>/ckpt-<global step>` checkpoints are found by what is on disk
(checkpoint_files): the newest one that reads back in full is restored,
whatever the `checkpoint` state file says. A save is read back before the
state file names it and before older checkpoints are rotated away, so a run
killed anywhere, even inside a save, resumes from an intact checkpoint. Each
checkpoint also stores the model's signature (every variable's name, shape
and dtype), so restoring one from a different model stops with a message
naming the first difference, before anything is loaded or written.

The model's variables are saved by name ('model/lm/stack/dec3/ff/fc1/w'), not
by the Python objects that hold them, so the trainer and the Estimator write
the same checkpoints, and a run resumes under any pipeline cut, schedule or
placement (variable names do not depend on them: base_layer).
"""

from absl import logging
import tensorflow as tf

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.training import checkpoint_files as files

_SIGNATURE = 'model_signature'
_SIGNATURE_KEY = f'{_SIGNATURE}/.ATTRIBUTES/VARIABLE_VALUE'


def _VariableName(var):
  return var.name[:-2] if var.name.endswith(':0') else var.name


def ModelSignature(variables):
  """'name shape dtype' lines of the variables, sorted; what a checkpoint must match."""
  unique = {v.ref(): v for v in variables}.values()
  return '\n'.join(sorted(f'{_VariableName(v)} {v.shape.as_list()} {v.dtype.name}'
                          for v in unique))


def _Entries(signature):
  return dict(line.split(' ', 1) for line in signature.splitlines() if line)


def _SignatureDifference(theirs, ours):
  """The first difference between two signatures as text, or None."""
  there, here = _Entries(theirs), _Entries(ours)
  differences = []
  for name in sorted(set(there) | set(here)):
    if name not in here:
      differences.append(f'variable {name} ({there[name]}) is not in this model')
    elif name not in there:
      differences.append(f'variable {name} ({here[name]}) is not in the checkpoint')
    elif there[name] != here[name]:
      differences.append(f'variable {name} is {there[name]} there, {here[name]} here')
  if not differences:
    return None
  more = f' (and {len(differences) - 1} more differences)' if len(differences) > 1 else ''
  return differences[0] + more


class _NameTree(tf.Module):
  """Variables as a tree of their names' components, for tf.train.Checkpoint."""

  def __init__(self, items):
    super().__init__()
    self._items = items

  @classmethod
  def FromVariables(cls, variables):
    root = {}
    for var in {v.ref(): v for v in variables}.values():
      *parents, leaf = _VariableName(var).split('/')
      node = root
      for i, part in enumerate(parents):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
          raise ValueError(f'Variable {_VariableName(var)} lies below variable '
                           f'{"/".join(parents[:i + 1])}: names must form a tree.')
      if leaf in node:
        raise ValueError(f'Two variables are named {_VariableName(var)} (or one names a '
                         'scope of others).')
      node[leaf] = var
    return cls._Build(root)

  @classmethod
  def _Build(cls, node):
    return cls({k: cls._Build(v) if isinstance(v, dict) else v for k, v in node.items()})

  def _trackable_children(self, save_type='checkpoint', **kwargs):
    del save_type, kwargs  # Checkpoints only.
    return dict(self._items)


def _NotSaveRetracing(record):
  """False for TensorFlow's warning that its saver's tf.function retraced: with variables
  in several processes (a cluster) the saver makes a new function at every save, and warns of
  it every fifth, a message of its own making that tells the user nothing."""
  message = record.getMessage()
  return not ('tf_function_save' in message and 'retracing' in message)


class Checkpointer:
  """Saves and restores a model, its Learner's state (optimizer, loss scale) and the global step.

  The input position is the global step: a resumed trainer asks the input
  generator for its batches from batch <global step> on.

  Args:
    directory: where ckpt-<step> files go.
    variables: the model's variables (saved by name).
    global_step: the int64 global step variable; it numbers the checkpoints.
    learner_state: optional dict name -> tf.Module (Learner.state: the optimizer's
      slots and counters, the loss scale), restored where a checkpoint has them.
    max_to_keep: how many recent checkpoints to keep (at least 1).
  """

  def __init__(self, directory, variables, global_step, learner_state=None, max_to_keep=5):
    try:
      files.CheckDirectoryName(directory)
    except ValueError as e:
      raise errors.UserError(str(e)) from None
    self._directory = directory
    self._model = _NameTree.FromVariables(variables)
    self._global_step = global_step
    self._learner_state = dict(learner_state or {})
    self._signature = ModelSignature(variables)
    objects = {'model': self._model, 'global_step': global_step,
               _SIGNATURE: tf.Variable(self._signature, trainable=False, name=_SIGNATURE)}
    objects.update(self._learner_state)
    self._checkpoint = tf.train.Checkpoint(**objects)
    self._max_to_keep = max_to_keep
    self._saved_step = None
    self._latest = None
    self._reported = set()

  @property
  def directory(self):
    return self._directory

  @property
  def latest(self):
    """Path of the checkpoint this Checkpointer last restored or saved, or None."""
    return self._latest

  def Newest(self, after=-1):
    """The newest intact checkpoint with a step > `after`, or None (checkpoint_files.Newest).

    Each damaged checkpoint passed over is logged once.
    """
    return files.Newest(self._directory, after, self._ReportDamaged)

  def _ReportDamaged(self, path, problem):
    if path not in self._reported:
      self._reported.add(path)
      logging.warning('Checkpoint %s is damaged (%s); passing over it.', path, problem)

  def Recover(self):
    """Restores the newest intact checkpoint, tidying the directory first; returns it or None.

    Only for the one process that writes the directory (the trainer, which
    holds its lock): debris of interrupted saves is removed, damaged
    checkpoints newer than the intact one are moved to <directory>/damaged
    (never deleted), and the state file is rewritten to what is on disk.
    """
    for name in files.RemoveDebris(self._directory):
      logging.info('Removed %s, left by an interrupted save.', name)
    path = None
    for step in files.Steps(self._directory):
      candidate = files.CheckpointPath(self._directory, step)
      problem = files.Problem(candidate)
      if problem is None:
        path = candidate
        break
      logging.warning('Checkpoint %s is damaged (%s): moved to %s.',
                      candidate, problem, files.MoveAside(self._directory, step))
    steps = sorted(files.Steps(self._directory))
    if files.WriteState(self._directory, steps) and steps:
      logging.info('Rewrote %s/%s from the checkpoints on disk (latest: ckpt-%d).',
                   self._directory, files.STATE_FILE, steps[-1])
    return self.Restore(path) if path else None

  def CheckModel(self, path):
    """Raises UserError if checkpoint `path` is not of this model."""
    reader = tf.train.load_checkpoint(path)
    if not reader.has_tensor(_SIGNATURE_KEY):
      raise errors.UserError(f'Checkpoint {path} has no model signature; it was not '
                                  'written by lingvo_gpipe.')
    theirs = reader.get_tensor(_SIGNATURE_KEY).decode()
    difference = _SignatureDifference(theirs, self._signature)
    if difference:
      raise errors.UserError(f'Checkpoint {path} is from a different model: {difference}. '
                                  'Use another logdir, or the model and params it was written by.')

  def Restore(self, path=None):
    """Restores `path` (default: the newest intact checkpoint); returns its path or None if none.

    Model and global step must match exactly; the Learner's state is restored where
    the checkpoint has it (an optimizer changed between runs starts afresh, and so
    does a loss scale switched on).
    """
    path = path or self.Newest()
    if not path:
      return None
    self.CheckModel(path)
    try:
      tf.train.Checkpoint(model=self._model, global_step=self._global_step).read(
          path).assert_existing_objects_matched().expect_partial()
    except AssertionError as e:
      raise errors.UserError(f'Checkpoint {path} does not hold this model\'s variables '
                                  f'in the expected layout: {str(e).splitlines()[0]}') from None
    if self._learner_state:
      tf.train.Checkpoint(**self._learner_state).read(path).expect_partial()
    self._saved_step = int(self._global_step.numpy())
    self._latest = path
    logging.info('Restored %s (global step %d).', path, self._saved_step)
    return path

  def Save(self):
    """Writes ckpt-<global step> unless this step is saved already; returns the latest path.

    The new checkpoint is read back before the state file names it and before
    checkpoints beyond max_to_keep are deleted (oldest first).
    """
    step = int(self._global_step.numpy())
    if step == self._saved_step:
      return self._latest
    path = files.CheckpointPath(self._directory, step)
    logger = tf.get_logger()
    logger.addFilter(_NotSaveRetracing)
    try:
      with errors.Writing(f'checkpoint {path} (the older checkpoints are kept)'):
        self._checkpoint.write(path)
    finally:
      logger.removeFilter(_NotSaveRetracing)
    problem = files.Problem(path)
    if problem:
      raise errors.UserError(f'Checkpoint {path} does not read back after saving '
                                  f'({problem}); the older checkpoints are kept.')
    older = [s for s in files.Steps(self._directory) if s < step]
    for old in older[self._max_to_keep - 1:]:
      files.Remove(self._directory, old)
    files.WriteState(self._directory, sorted(older[:self._max_to_keep - 1]) + [step])
    self._saved_step = step
    self._latest = path
    logging.info('Saved checkpoint %s.', path)
    return path
