"""Many tensors as one input per dtype of a call: a chunk's weights, what B hands W.

Every action is one call of its chunk's function (cell_functions.py). A call that
took each weight, and each of the activations and gradients that a split
backward's B hands its W, as an input of its own took them all through every
iteration of a steady-state loop (steady_state.py), whose function carries every
value it captures or keeps in flight: at K=8, M=64 (32 small layers) the loop's
step was 2x the unrolled one for 1F1B and 8x for ZB-H1. Put into one TensorList
per float dtype (the weights once a pass, B's hand-over by B), they are one value
each, which the function takes apart again by index; a list holds the tensors
themselves, nothing is copied (the loop's steps then 1.3x and 1.5x, and ZB-H1's
first call 10 s where it was 15 s: docs/benchmarks/2026-12-07-startup.md).
Other leaves (a Keras layer's integer seed, an embedding's ids) pass as they are.
"""

from typing import Any, NamedTuple

import tensorflow as tf

from lingvo_gpipe.foundation import py_utils


class Packed(NamedTuple):
  """Tensors as a call takes them: a TensorList per float dtype, and the other leaves."""
  lists: tuple
  others: tuple


class Packing:
  """How a structure of tensors (a chunk's theta, B's hand-over) goes into Packed and comes
  out again: its structure, and where each float leaf sits in which list."""

  def __init__(self, structure: Any):
    self._structure = tf.nest.map_structure(lambda _: 0, structure)
    leaves = tf.nest.flatten(structure)
    self._dtypes = sorted({x.dtype for x in leaves if py_utils.IsFloatTensor(x)},
                          key=lambda d: d.name)
    self._places = []  # Per leaf: (list, index in it, shape), or None for the other leaves.
    counts = [0] * len(self._dtypes)
    for x in leaves:
      if py_utils.IsFloatTensor(x):
        k = self._dtypes.index(x.dtype)
        self._places.append((k, counts[k], x.shape))
        counts[k] += 1
      else:
        self._places.append(None)

  def Pack(self, structure: Any) -> Packed:
    """`structure` (shaped as the one this packing was made from) as Packed; ops where
    called."""
    leaves = tf.nest.flatten(structure)
    lists = []
    for dtype in self._dtypes:
      handle = tf.raw_ops.EmptyTensorList(element_shape=tf.constant(-1), max_num_elements=-1,
                                          element_dtype=dtype)
      for x in leaves:
        if py_utils.IsFloatTensor(x) and x.dtype == dtype:
          handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=x)
      lists.append(handle)
    return Packed(tuple(lists), tuple(x for x, at in zip(leaves, self._places) if at is None))

  def Unpack(self, packed: Packed) -> Any:
    """The structure that `packed` holds, its shapes known.

    The items' indices come from one unstack of a range, and items of one shape share its
    constant: a node per item where there were three. TensorFlow reads a called function's
    body again at each of its call sites while it prepares a step's graph, so a function's
    nodes cost start-up at every action (docs/benchmarks/2026-12-08-call-sites.md)."""
    counts = [at[1] + 1 for at in self._places if at is not None]
    indices = tf.unstack(tf.range(max(counts))) if counts else []
    shapes = {}
    others = iter(packed.others)
    leaves = []
    for at in self._places:
      if at is None:
        leaves.append(next(others))
      else:
        k, index, shape = at
        key = None if shape.rank is None else tuple(shape.as_list())
        if key not in shapes:
          shapes[key] = _ShapeTensor(shape)
        leaves.append(tf.raw_ops.TensorListGetItem(
            input_handle=packed.lists[k], index=indices[index], element_shape=shapes[key],
            element_dtype=self._dtypes[k]))
    return tf.nest.pack_sequence_as(self._structure, leaves)


def _ShapeTensor(shape):
  """A TensorList's element_shape for `shape` (-1: an unknown dimension or rank)."""
  if shape.rank is None:
    return tf.constant(-1)
  return tf.constant([-1 if d is None else d for d in shape.as_list()], tf.int32)
