"""The error of a mistake the user can fix, which every layer of the library may raise, the
context that turns a failed write into one, and the one that finds the op behind a cancelled
step.

Importing it does not import TensorFlow: a binary imports it before binaries.QuietTensorFlow,
which must run before TensorFlow loads.
"""

import contextlib
import re
import warnings
from typing import Any, Callable

from absl import logging


class UserError(Exception):
  """A mistake the user can fix; binaries print its message as one line and exit non-zero."""


@contextlib.contextmanager
def Writing(what):
  """Turns an I/O error (a full disk, a lost permission) while writing `what` (a path, or
  what is written where) into one UserError line naming it; what was written before stays."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  try:
    yield
  except (OSError, tf.errors.OpError) as e:
    if isinstance(e, _RuntimeErrors()):
      raise  # Not the file's: a lost worker (cluster.HealthMonitor names it), a cancelled op.
    reason = str(getattr(e, 'strerror', None) or getattr(e, 'message', None) or e)
    reason = re.sub(r'\{\{function_node [^}]*\}\}|\[Op:\w+\]', '', reason)  # TensorFlow's.
    raise UserError(f'Cannot write {what}: {" ".join(reason.split())}') from None


def _RuntimeErrors() -> tuple:
  """TensorFlow's errors of the run, not of what it ran: a lost worker, a cancelled op."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  return (tf.errors.UnavailableError, tf.errors.CancelledError, tf.errors.AbortedError,
          tf.errors.DeadlineExceededError)


CANCELLED_STEP_HINT = (
    'A pipelined step was cancelled on some device: where an op failed inside a chunk, '
    "TensorFlow may report only this. To see that op's own error, rerun with the pipeline's "
    "inline_cell_functions=True (the trainer: --model_params_override='task.stack."
    "inline_cell_functions : True'; Keras: PipelineModel(..., inline_cell_functions=True)), "
    "or TF_CPP_MIN_LOG_LEVEL=1 (TensorFlow's log shows it as 'Local rendezvous is aborting "
    "with status: ...'). TensorFlow said: ")

RERUN_PASSED = ('Run again eagerly on the same input, the step did not fail (an op that '
                'fails only in a traced step, or a step that cannot be rerun alike). ')

RERUN_NOTE = ('This is the error of the op that failed: TensorFlow reported the traced step '
              'only as CancelledError, so the step was run again eagerly, op by op, on the '
              'same input, without updating any variable.')


@contextlib.contextmanager
def ExplainingCancelledSteps(rerun: Callable[[], Any] | None = None):
  """Finds the op behind a step's CancelledError: TensorFlow reports an op failing in a
  chunk's out-of-line function as the other devices' cancelled receives.

  Args:
    rerun: runs the failed step again, without updating variables (its forward and
      backward of the same input). It runs eagerly (tf.config.run_functions_eagerly), where
      the failing op raises its own error: that error is raised, with RERUN_NOTE. None, or
      a rerun that passes or fails in the run itself (a lost worker), re-raises the
      CancelledError with CANCELLED_STEP_HINT.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  try:
    yield
  except tf.errors.CancelledError as e:
    if CANCELLED_STEP_HINT in e.message:  # Explained by a context inside this one.
      raise
    hint = CANCELLED_STEP_HINT
    if rerun is not None and _RerunEagerly(rerun):
      hint = RERUN_PASSED + hint
    raise tf.errors.CancelledError(e.node_def, e.op, hint + e.message) from e


def _RerunEagerly(rerun: Callable[[], Any]) -> bool:
  """Whether rerun(), with tf.functions run eagerly, passed; raises its error (RERUN_NOTE
  added) unless it is one of the run's own (_RuntimeErrors), which tells nothing of the op."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  logging.warning('A pipelined step was cancelled; running it again eagerly to find the op '
                  'that failed (op by op: slower than the traced step) ...')
  eager_before = tf.config.functions_run_eagerly()
  tf.config.run_functions_eagerly(True)
  try:
    with warnings.catch_warnings():  # tf.data's functions stay traced, as the rerun needs.
      warnings.filterwarnings('ignore', 'Even though the `tf.config.experimental_run_functions')
      rerun()
    return True
  except _RuntimeErrors() as error:
    logging.warning('The eager rerun failed in the run itself, which tells nothing of the '
                    'op: %s', error)
    return False
  except Exception as error:  # pylint: disable=broad-except  # The op's own, or a layer's.
    error.add_note(RERUN_NOTE)
    raise
  finally:
    tf.config.run_functions_eagerly(eager_before)
