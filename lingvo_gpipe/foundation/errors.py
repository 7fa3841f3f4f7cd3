"""The error of a mistake the user can fix, which every layer of the library may raise, and
the context that turns a failed write into one.

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
