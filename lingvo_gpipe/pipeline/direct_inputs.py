"""Inputs that only later chunks read, sent to them straight from where the batch is split.

A chunk's input is the chunk before's output, so a field of the first chunk's input that
only the last chunk reads (a language model's labels and weights) rides through every
stage: one copy per hand-over, and on GPUs, where TensorFlow keeps int32 tensors in host
memory, a host-device copy each way per stage. The fields named here leave the first
chunk's input and join the last chunk's (or, by a class's defaults, the chunk that first
reads them: a translation model's target stream skips the encoder's), taken from the
micro-batch's rows of the batch: one transfer, whatever K. Numbers do not change: the
chunk reads the same rows.

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
  """The fields of one pass's inputs that skip chunks: each joins the input of one chunk
  (the last, for last_chunk_inputs), taken from the micro-batch's rows of the batch.

  Args:
    paths: the params' last_chunk_inputs: the paths sent straight to the last chunk (one
      missing from the inputs is a ValueError), or None for `defaults`.
    defaults: the class's {path: the chunk it joins, -1 for the last}, each sent so only
      where the inputs have it (a decoding step's input has no labels).
    first_args: the first chunk's argument tuple of one micro-batch (its structure).
    num_chunks: C; with one chunk nothing is sent apart.
  """

  def __init__(self, paths: Optional[Sequence[str]], defaults: dict, first_args: tuple,
               num_chunks: int):
    self.joins = {}  # path -> the chunk whose input it joins
    wanted = dict(defaults) if paths is None else {path: -1 for path in paths}
    if num_chunks == 1 or not wanted:
      return
    if len(first_args) != 1 or not isinstance(first_args[0], dict):
      raise ValueError(f'last_chunk_inputs={list(wanted)} name fields of a NestedMap, but the '
                       f'first cell takes {tuple(type(a).__name__ for a in first_args)}: '
                       'expected one NestedMap.')
    for path, chunk in wanted.items():
      value = _Get(first_args[0], path.split('.'))
      if value is None:
        if paths is None:
          continue
        raise ValueError(f'last_chunk_inputs names {path!r}, which the pipeline input does not '
                         f'have; its fields: {sorted(_Paths(first_args[0]))}.')
      if isinstance(value, dict):
        raise ValueError(f'last_chunk_inputs names {path!r}, a NestedMap: expected the path of '
                         'a tensor.')
      if chunk % num_chunks:  # One that the first chunk reads rides with its input.
        self.joins[path] = chunk % num_chunks

  def __bool__(self):
    return bool(self.joins)

  def _At(self, chunk):
    return [path for path, c in self.joins.items() if c == chunk]

  def Without(self, args, paths=None):
    """(args without the fields of `paths` (None: all that skip chunks), those fields)."""
    state, side = args[0], []
    for path in self.joins if paths is None else paths:
      state, value = _Pop(state, path.split('.'))
      side.append(value)
    return (state,) + tuple(args[1:]), side

  def Joined(self, args, first_args, chunk: int):
    """Chunk `chunk`'s `args` with the fields that join it put back from `first_args` (the
    micro-batch's first-chunk arguments)."""
    state = args[0]
    for path in self._At(chunk):
      keys = path.split('.')
      state = _Put(state, keys, _Get(first_args[0], keys))
    return (state,) + tuple(args[1:])

  def CheckOutput(self, out, chunk: int) -> None:
    """A ValueError if chunk `chunk`'s output holds a field that skips the next chunk: a
    layer of this chunk wrote it, and a field a layer writes cannot be sent apart."""
    state = out[0] if isinstance(out, tuple) and out else out
    for path, c in self.Skipping(chunk).items():
      if isinstance(state, dict) and _Get(state, path.split('.')) is not None:
        raise ValueError(f'A layer of chunk {chunk} writes {path!r}, which is sent straight '
                         f'from the batch to chunk {c} (last_chunk_inputs): a field that a '
                         'layer before that chunk writes cannot be sent apart; leave it out of '
                         'last_chunk_inputs.')

  def ArgGrads(self, d_args, chunk: int):
    """Chunk `chunk`'s input gradients as the chunk before takes them: without those of the
    fields that joined here; at the first chunk, None for every field that skipped it."""
    d_args = self.Without(d_args, self._At(chunk))[0]
    if chunk:
      return d_args
    state = d_args[0]
    for path in self.joins:
      state = _Put(state, path.split('.'), None)
    return (state,) + tuple(d_args[1:])

  def Skipping(self, chunk: int) -> dict:
    """{path: the chunk it joins} of the fields that skip chunk `chunk`."""
    return {path: c for path, c in self.joins.items() if c > chunk}

  def Explain(self, chunk: int, error: Exception) -> str:
    """Why chunk `chunk` failed reading a field it was not given."""
    sent = ', '.join(f'{path!r} to chunk {c}' for path, c in self.Skipping(chunk).items())
    return (f'Pipeline chunk {chunk} failed on a field it lacks ({str(error).rstrip(".")}). '
            f'last_chunk_inputs sends these from the batch straight to later chunks: {sent}; '
            'a field that an earlier chunk reads must be left out of last_chunk_inputs.')


def _Paths(structure, prefix=''):
  for key, value in structure.items():
    path = f'{prefix}{key}'
    if isinstance(value, dict):
      yield from _Paths(value, path + '.')
    else:
      yield path
