"""The error of a mistake the user can fix, which every layer of the library may raise, the
context that turns a failed write into one, and the one that explains a cancelled step.

Importing it does not import TensorFlow: a binary imports it before binaries.QuietTensorFlow,
which must run before TensorFlow loads.
"""

import contextlib
import re


class UserError(Exception):
  """A mistake the user can fix; binaries print its message as one line and exit non-zero."""


@contextlib.contextmanager
def Writing(what):
  """Turns an I/O error (a full disk, a lost permission) while writing `what` (a path, or
  what is written where) into one UserError line naming it; what was written before stays."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  runtime_errors = (tf.errors.UnavailableError, tf.errors.CancelledError,
                    tf.errors.AbortedError, tf.errors.DeadlineExceededError)
  try:
    yield
  except (OSError, tf.errors.OpError) as e:
    if isinstance(e, runtime_errors):
      raise  # Not the file's: a lost worker (cluster.HealthMonitor names it), a cancelled op.
    reason = str(getattr(e, 'strerror', None) or getattr(e, 'message', None) or e)
    reason = re.sub(r'\{\{function_node [^}]*\}\}|\[Op:\w+\]', '', reason)  # TensorFlow's.
    raise UserError(f'Cannot write {what}: {" ".join(reason.split())}') from None


CANCELLED_STEP_HINT = (
    'A pipelined step was cancelled on some device: where an op failed inside a chunk, '
    "TensorFlow may report only this. To see that op's own error, rerun with the pipeline's "
    "inline_cell_functions=True (the trainer: --model_params_override='task.stack."
    "inline_cell_functions : True'; Keras: PipelineModel(..., inline_cell_functions=True)), "
    "or TF_CPP_MIN_LOG_LEVEL=1 (TensorFlow's log shows it as 'Local rendezvous is aborting "
    "with status: ...'). TensorFlow said: ")


@contextlib.contextmanager
def ExplainingCancelledSteps():
  """Re-raises a step's CancelledError with CANCELLED_STEP_HINT: TensorFlow reports an op
  failing in a chunk's out-of-line function as the other devices' cancelled receives."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  try:
    yield
  except tf.errors.CancelledError as e:
    raise tf.errors.CancelledError(e.node_def, e.op, CANCELLED_STEP_HINT + e.message) from e
