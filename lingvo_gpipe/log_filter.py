"""Passes on the lines of stdin that a C++ log level lets through (binaries.QuietTensorFlow),
or all but the warnings of failed ops (core/failed_op_logs: the loss probe's).

TensorFlow's libraries log while they load, before they read TF_CPP_MIN_LOG_LEVEL.
A binary's TensorFlow import writes its stderr into this script, run as a process
of its own: each line is forwarded (or dropped) as it comes, and what was read is
out even if the import kills the binary (an illegal instruction, an abort).

  python log_filter.py <level>    # 0: every line; 3: none of INFO, WARNING, ERROR.
  python log_filter.py <level> --drop_failed_ops

It imports nothing of the project, so it runs by path wherever the package lies.
"""

import re
import sys

# A C++ log line's severity letter (absl / glog format: 'I1127 07:52:30.5 ...').
_SEVERITY = re.compile(r'([IWEF])\d{4} ')
_LEVELS = {'I': 0, 'W': 1, 'E': 2, 'F': 3}
_BEFORE_INIT = 'WARNING: All log messages before absl::InitializeLog() is called'
# The warnings of a failed op: its kernel's, and its executor's that it stops (absl's
# format, as TensorFlow 2.21 writes; earlier versions' own: '2024-10-14 21:27:37.4: W ...').
_FAILED_OP = re.compile(r'(W\d{4} |\d{4}-\d\d-\d\d [\d:.]+: W ).*'
                        r'(OP_REQUIRES failed at |Local rendezvous is aborting with status: )')


def Shown(line, level, drop_failed_ops=False):
  """Whether a line passes C++ log level `level` (and, with drop_failed_ops, is not a failed
  op's warning); lines not in the log's format always do."""
  if line.startswith(_BEFORE_INIT):
    return level == 0
  if drop_failed_ops and _FAILED_OP.match(line):
    return False
  severity = _SEVERITY.match(line)
  return not severity or _LEVELS[severity.group(1)] >= level


def main(level, drop_failed_ops):
  for raw in sys.stdin.buffer:
    if Shown(raw.decode(errors='replace'), level, drop_failed_ops):
      sys.stderr.buffer.write(raw)  # As written: bytes of any encoding.
      sys.stderr.flush()


if __name__ == '__main__':
  main(int(sys.argv[1]), sys.argv[2:] == ['--drop_failed_ops'])
