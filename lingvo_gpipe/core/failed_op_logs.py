"""Drops the lines TensorFlow's C++ runtime logs for an eager op that failed, in a block
that expects such failures: the loss probe (metrics.MicroBatchLoss) tries labels that a
loss may reject (-1, 255), takes the failure as an exception, and goes on; the lines
(`OP_REQUIRES failed ... label value of -1`) would tell the user their labels were bad.

Every other line written to stderr meanwhile, by any thread, is passed on when the block
ends. TF_CPP_MIN_LOG_LEVEL is read once, when TensorFlow loads: it cannot do this.
"""

import contextlib
import os
import re
import sys
import tempfile
import threading

# The warnings of a failed op: its kernel's, and its executor's that it stops.
_FAILED_OP = re.compile(
    rb'W\d{4} [^\n]*(OP_REQUIRES failed at |Local rendezvous is aborting with status: )')
# One block redirects stderr at a time: another thread's block would restore it early.
_LOCK = threading.Lock()


@contextlib.contextmanager
def Dropped():
  """Within the block, failed ops' log lines are dropped; other stderr lines are delayed."""
  with _LOCK, tempfile.TemporaryFile() as caught:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(caught.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      caught.seek(0)
      kept = b''.join(line for line in caught if not _FAILED_OP.match(line))
      while kept:
        kept = kept[os.write(2, kept):]
