"""A traced forward that hands its backward the tensors it needs, instead of a tape.

Without remat, a chunk's backward needs what its forward computed. A GradientTape
kept from F to BW holds it, but a tape cannot go round a tf.while_loop, so such a
pass could not loop its steady state and traced every action on its own
(docs/benchmarks/2026-12-08-call-sites.md). TensorFlow already splits a traced
function, for a tape, into a forward that also returns the tensors its gradient
uses and a backward function that takes them: the tape's gradient of a call is
that backward's call. Here F calls that forward and BW that backward, with the
saved tensors as ordinary values in flight between them, so a loop carries them
like any other, and the gradients are the ones the tape would have taken.

The pair comes from the concrete function's own gradient functions (TensorFlow
has no public API for them; tested against the tape in saved_forward_test.py).
"""

import dataclasses
from typing import Any

import tensorflow as tf
from tensorflow.python.eager import backprop_util  # pylint: disable=g-direct-tensorflow-import


@dataclasses.dataclass(frozen=True)
class Pair:
  """The forward (with saved outputs) and backward of one concrete function."""
  concrete: Any
  forward: Any
  backward: Any
  num_outputs: int  # The function's own flat outputs, before the saved ones.


def _PairOf(function, args):
  concrete = function.get_concrete_function(*args)
  forward, backward = concrete._delayed_rewrite_functions.forward_backward()  # pylint: disable=protected-access
  return Pair(concrete, forward, backward, len(concrete.function_type.flat_outputs))


def Forward(function, *args):
  """(function(*args), a Pair, the tensors its backward takes): calls the tf.function
  `function` as a tape would, keeping what its backward needs."""
  pair = _PairOf(function, args)
  concrete = pair.concrete
  flat = [x for x in tf.nest.flatten(args) if isinstance(x, (tf.Tensor, tf.Variable))]
  if len(flat) + len(concrete.captured_inputs) != len(concrete.inputs):
    raise ValueError(
        f'{concrete.name} takes {len(concrete.inputs)} inputs, but its arguments hold '
        f'{len(flat)} tensors and it captures {len(concrete.captured_inputs)}: an argument '
        'is a composite tensor (e.g. ragged), which a saved forward does not take.')
  outputs = pair.forward.call_flat(*flat, *concrete.captured_inputs)
  produced = {id(t): value for t, value in zip(concrete.graph.outputs, outputs)}
  saved = [produced.get(id(t), t) for t in pair.backward.captured_inputs]
  return concrete.function_type.pack_output(outputs[:pair.num_outputs]), pair, saved


def Backward(pair, saved, output_grads):
  """The gradients, structured like the forward's arguments (None where no gradient flows
  and at their other leaves), of its outputs weighted by `output_grads`: a prefix of its
  outputs in tf.nest order (the leaves after it, and None, weigh zero). `saved`: what
  Forward returned with `pair`."""
  leaves = tf.nest.flatten(pair.concrete.structured_outputs)
  given = tf.nest.flatten(output_grads)
  given += [None] * (len(leaves) - len(given))
  d_outputs = [tf.zeros(t.shape, t.dtype) if g is None else tf.cast(g, t.dtype)
               for t, g in zip(leaves, given)
               if isinstance(t, tf.Tensor) and backprop_util.IsTrainable(t)]
  grads = iter(pair.backward._call_flat(d_outputs, saved))  # pylint: disable=protected-access
  specs = pair.concrete.structured_input_signature[0]
  return tf.nest.pack_sequence_as(specs, [next(grads) if isinstance(x, tf.TypeSpec) else None
                                          for x in tf.nest.flatten(specs)])
