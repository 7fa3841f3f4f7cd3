"""The checkpoints of a directory as they are on disk: found, verified, tidied.

A save can be cut anywhere by kill -9 and files can be damaged afterwards, so
the `checkpoint` state file is only written here, never trusted: checkpoints
are found by listing ckpt-<step> files, and one is intact when every tensor
reads back (TensorFlow checks each tensor's checksum) and every float is
finite: a checkpoint with a NaN weight counts as damaged.

tf.train.Checkpoint.write(ckpt-<step>) writes into a ckpt-<step>_temp folder,
then moves the data files to ckpt-<step>.data-*, writes ckpt-<step>.index and
removes the folder; while the folder exists the save is in progress, or was
interrupted.
"""

import os
import re

import numpy as np
import tensorflow as tf

STATE_FILE = 'checkpoint'
DAMAGED_DIR = 'damaged'
_TEMP = '_temp'
_FILE = re.compile(r'ckpt-(\d+)(\.index|\.data-\d+-of-\d+|_temp)$')
# What reading a damaged checkpoint raises: OpError (bad checksum, not an
# sstable, missing file), IndexError (a truncated data file), ValueError.
READ_ERRORS = (tf.errors.OpError, IndexError, ValueError)


def CheckDirectoryName(directory, what='The checkpoint directory'):
  """ValueError if `directory` holds a glob character (* ? [): TensorFlow reads a
  checkpoint's path as a glob pattern, so no save there would read back."""
  found = sorted(set(_GLOB_CHARACTERS) & set(directory))
  if found:
    raise ValueError(f'{what} {directory!r} holds the glob character(s) {" ".join(found)}, '
                     'which TensorFlow reads checkpoint paths as patterns with: no save there '
                     'would read back; use a name without them.')


_GLOB_CHARACTERS = '*?['


def CheckpointPath(directory, step):
  return os.path.join(directory, f'ckpt-{step}')


def Step(path):
  """The global step that names checkpoint `path`."""
  return int(path.rsplit('-', 1)[1])


def _Names(directory):
  """{step: [names of its files and folders]} of the ckpt-<step> entries in directory."""
  names = {}
  for name in tf.io.gfile.listdir(directory) if tf.io.gfile.isdir(directory) else []:
    match = _FILE.match(name.rstrip('/'))
    if match:
      names.setdefault(int(match.group(1)), []).append(name.rstrip('/'))
  return names


def Steps(directory):
  """The steps of the checkpoints in directory (complete or not), newest first."""
  return sorted(_Names(directory), reverse=True)


def InProgress(path):
  """Whether the save of `path` has not finished (or was interrupted)."""
  return tf.io.gfile.exists(path + _TEMP)


def Exists(path):
  return tf.io.gfile.exists(path + '.index')


def Problem(path, check_finite=True):
  """None if checkpoint `path` reads back in full, every float tensor finite (no run resumes
  from NaN weights), else why not, in one line."""
  if not Exists(path):
    return 'no index file'
  try:
    reader = tf.train.load_checkpoint(path)
    for name in sorted(reader.get_variable_to_shape_map()):
      value = reader.get_tensor(name)
      if check_finite and not _Finite(value):
        return f'{name.replace(_VALUE_SUFFIX, "")} holds NaN or Inf'
  except READ_ERRORS as e:
    return ReadErrorLine(e)
  return None


_VALUE_SUFFIX = '/.ATTRIBUTES/VARIABLE_VALUE'


def _Finite(value):
  """Whether a tensor read from a checkpoint holds no NaN or Inf (True for non-floats)."""
  value = np.asarray(value)
  if 'float' not in value.dtype.name and 'complex' not in value.dtype.name:
    return True
  return bool(np.isfinite(value.astype(np.complex128 if 'complex' in value.dtype.name
                                       else np.float64)).all())


def ReadErrorLine(error):
  """The first line of a READ_ERRORS exception's message, to report it in one line."""
  return (str(error).strip().splitlines() or [type(error).__name__])[0]


def Newest(directory, after=-1, on_damaged=None):
  """The newest intact checkpoint of directory with a step > `after`, or None.

  Reads only: saves in progress are passed over, and so is a checkpoint
  removed while it was read. Damaged ones are passed over after
  on_damaged(path, problem).
  """
  for step in Steps(directory):
    path = CheckpointPath(directory, step)
    if step <= after:
      break
    if InProgress(path):
      continue
    problem = Problem(path)
    if problem is None:
      return path
    if on_damaged and Exists(path):
      on_damaged(path, problem)
  return None


def RemoveDebris(directory):
  """Removes what interrupted saves left; returns the names removed.

  Each ckpt-<step>_temp folder goes, and with it ckpt-<step> if that did not
  get complete. Only for the one process that writes the directory.
  """
  removed = []
  for step, names in _Names(directory).items():
    path = CheckpointPath(directory, step)
    if not InProgress(path):
      continue
    complete = Problem(path, check_finite=False) is None  # Complete, if not finite.
    for name in sorted(names):
      if name.endswith(_TEMP):
        tf.io.gfile.rmtree(os.path.join(directory, name))
      elif complete:
        continue
      else:
        tf.io.gfile.remove(os.path.join(directory, name))
      removed.append(name)
  return removed


def MoveAside(directory, step):
  """Moves the files of ckpt-<step> to a new folder in <directory>/damaged; returns it."""
  base = os.path.join(directory, DAMAGED_DIR, f'ckpt-{step}')
  target, n = base, 1
  while tf.io.gfile.exists(target):
    n += 1
    target = f'{base}.{n}'
  tf.io.gfile.makedirs(target)
  for name in _Names(directory)[step]:
    tf.io.gfile.rename(os.path.join(directory, name), os.path.join(target, name))
  return target


def Remove(directory, step):
  """Deletes the files of ckpt-<step> (rotation); the index first, so it stops counting."""
  for name in sorted(_Names(directory).get(step, []), key=lambda n: not n.endswith('.index')):
    tf.io.gfile.remove(os.path.join(directory, name))


def WriteState(directory, steps):
  """Atomically makes the state file list `steps` (oldest first; the last is the latest).

  It is what tf.train.latest_checkpoint and TensorBoard read. Returns whether
  its text changed.
  """
  lines = [f'model_checkpoint_path: "ckpt-{steps[-1]}"'] if steps else []
  lines += [f'all_model_checkpoint_paths: "ckpt-{s}"' for s in steps]
  text = ''.join(line + '\n' for line in lines)
  path = os.path.join(directory, STATE_FILE)
  try:
    with tf.io.gfile.GFile(path, 'rb') as f:
      if f.read() == text.encode():
        return False
  except tf.errors.NotFoundError:
    if not steps:
      return False
  temp = f'{path}.{os.getpid()}.tmp'
  with tf.io.gfile.GFile(temp, 'w') as f:
    f.write(text)
  tf.io.gfile.rename(temp, path, overwrite=True)
  return True
