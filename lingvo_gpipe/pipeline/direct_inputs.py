"""Inputs that only the last chunk reads, sent to it straight from where the batch is split.

A chunk's input is the chunk before's output, so a field of the first chunk's input that
only the last chunk reads (a language model's labels and weights) rides through every
stage: one copy per hand-over, and on GPUs, where TensorFlow keeps int32 tensors in host
memory, a host-device copy each way per stage. The fields named here leave the first
chunk's input and join the last chunk's, taken from the micro-batch's rows of the batch:
one transfer, whatever K. Numbers do not change: the last chunk reads the same rows.

A path is a '.'-separated key into the first argument, a NestedMap (e.g. 'tgt.labels').
"""

from typing import Optional, Sequence

from lingvo_gpipe.foundation import py_utils


def _Get(structure, keys):
  for key in keys:
    if not isinstance(structure, dict) or key not in structure:
      return None
    structure = structure[key]
  return structure


def _Copied(structure, keys):
  """A copy of `structure` whose dicts along `keys` (all but the last) are new."""
  out = py_utils.NestedMap(structure) if isinstance(structure, py_utils.NestedMap) else dict(
      structure)
  if len(keys) > 1:
    out[keys[0]] = _Copied(out[keys[0]], keys[1:])
  return out


def _Pop(structure, keys):
  """(a copy of `structure` without the value at `keys`, the value)."""
  out = _Copied(structure, keys)
  parent = out
  for key in keys[:-1]:
    parent = parent[key]
  return out, parent.pop(keys[-1])


def _Put(structure, keys, value):
  out = _Copied(structure, keys)
  parent = out
  for key in keys[:-1]:
    parent = parent[key]
  parent[keys[-1]] = value
  return out


def CheckPaths(paths) -> None:
  """Raises a ValueError unless `paths` is None or a list of '.'-separated keys."""
  if paths is not None and not (isinstance(paths, (list, tuple)) and all(
      isinstance(x, str) and x and '' not in x.split('.') for x in paths)):
    raise ValueError(f"last_chunk_inputs={paths!r}; expected None or a list of paths such as "
                     "['tgt.labels'].")


class DirectInputs:
  """The fields of one pass's inputs that go straight to its last chunk.

  Args:
    paths: the params' last_chunk_inputs: the paths to send straight (one missing from
      the inputs is a ValueError), or None for `defaults`.
    defaults: the class's paths, sent straight only where the inputs have them (a
      decoding step's input has no labels).
    first_args: the first chunk's argument tuple of one micro-batch (its structure).
    num_chunks: C; with one chunk nothing is sent apart.
  """

  def __init__(self, paths: Optional[Sequence[str]], defaults: Sequence[str],
               first_args: tuple, num_chunks: int):
    self.paths = []
    paths, optional = ([], list(defaults)) if paths is None else (list(paths), [])
    if num_chunks == 1 or not (paths or optional):
      return
    if len(first_args) != 1 or not isinstance(first_args[0], dict):
      raise ValueError(f'last_chunk_inputs={list(paths) or list(optional)} name fields of a '
                       'NestedMap, but the first cell takes '
                       f'{tuple(type(a).__name__ for a in first_args)}: expected one NestedMap.')
    for path in list(paths) + [p for p in optional if p not in paths]:
      value = _Get(first_args[0], path.split('.'))
      if value is None:
        if path in optional:
          continue
        raise ValueError(f'last_chunk_inputs names {path!r}, which the pipeline input does not '
                         f'have; its fields: {sorted(_Paths(first_args[0]))}.')
      if isinstance(value, dict):
        raise ValueError(f'last_chunk_inputs names {path!r}, a NestedMap: expected the path of '
                         'a tensor.')
      self.paths.append(path)

  def __bool__(self):
    return bool(self.paths)

  def Without(self, args):
    """(args without the paths' fields, those fields in path order)."""
    state, side = args[0], []
    for path in self.paths:
      state, value = _Pop(state, path.split('.'))
      side.append(value)
    return (state,) + tuple(args[1:]), side

  def Joined(self, args, side, chunk: int):
    """`args` of the last chunk with the `side` fields put back; a ValueError if the chunk
    before left one of them in its output (a layer that writes it must run last)."""
    state = args[0]
    for path, value in zip(self.paths, side):
      keys = path.split('.')
      if _Get(state, keys) is not None:
        raise ValueError(f'Chunk {chunk - 1} outputs {path!r}, which last_chunk_inputs sends '
                         f'straight to chunk {chunk}: a field a layer before the last chunk '
                         'writes cannot be sent apart; leave it out of last_chunk_inputs.')
      state = _Put(state, keys, value)
    return (state,) + tuple(args[1:])

  def Explain(self, chunk: int, error: Exception) -> str:
    """Why chunk `chunk` (not the last) failed reading a field it was not given."""
    return (f'Pipeline chunk {chunk} failed on a field it lacks ({error}): last_chunk_inputs '
            f'sends {self.paths} only to the last chunk; a path that an earlier chunk reads '
            'must be left out of it.')


def _Paths(structure, prefix=''):
  for key, value in structure.items():
    path = f'{prefix}{key}'
    if isinstance(value, dict):
      yield from _Paths(value, path + '.')
    else:
      yield path
