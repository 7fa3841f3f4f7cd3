"""Stop training cleanly on SIGTERM or SIGINT: finish the step, save, exit with one line.

Clusters preempt jobs with SIGTERM and people stop them with Ctrl-C; either
way the steps since the last checkpoint should not be lost. The first signal
only asks the training loop to stop after its current call; a second one
(after the first was received: the kernel merges a signal sent again while it
is still pending) ends the process at once. Python runs signal handlers in the main thread
between bytecodes, which can be long inside a TensorFlow call, so a watcher
thread reads the signals from Python's wakeup fd instead and can exit while
the main thread still computes.
"""

import os
import signal
import sys
import threading

from absl import logging

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(Exception):
  """Training stopped on a signal after saving; the binary exits with 128 + the signal."""

  def __init__(self, signum, message):
    super().__init__(message)
    self.signum = signum


class StopOnSignals:
  """Context manager (main thread only) that turns SIGTERM and SIGINT into a stop request.

  `received` is the first signal's number, or None; RunTraining polls it.
  """

  def __init__(self):
    self.received = None
    self._previous = {}
    self._wakeup = None

  def __enter__(self):
    reader, writer = os.pipe()
    os.set_blocking(writer, False)
    self._wakeup = (writer, signal.set_wakeup_fd(writer))
    for signum in SIGNALS:
      self._previous[signum] = signal.signal(signum, lambda *_: None)  # The watcher acts.
    threading.Thread(target=self._Watch, args=(reader,), name='stop_on_signals',
                     daemon=True).start()
    return self

  def _Watch(self, reader):
    while True:
      data = os.read(reader, 1)
      if not data:  # __exit__ closed the pipe.
        os.close(reader)
        return
      signum = data[0]
      name = signal.Signals(signum).name
      if self.received is None:
        self.received = signum
        logging.warning('%s: stopping after this step with a checkpoint; a second signal '
                        'exits at once.', name)
        continue
      sys.stderr.write(f'trainer: second signal ({name}): exiting at once; training resumes '
                       'from the last checkpoint.\n')
      sys.stderr.flush()
      os._exit(128 + signum)  # pylint: disable=protected-access

  def __exit__(self, *unused_exc_info):
    writer, previous_fd = self._wakeup
    signal.set_wakeup_fd(previous_fd)
    for signum, handler in self._previous.items():
      signal.signal(signum, handler)
    os.close(writer)

  def Stopped(self):
    """Whether a signal asked training to stop."""
    return self.received is not None

  def Check(self, step, checkpoint):
    """Raises Interrupted if a signal stopped training at `step`, saved as `checkpoint`."""
    if self.Stopped():
      raise Interrupted(self.received, f'{signal.Signals(self.received).name}: stopped at step '
                        f'{step} after saving {checkpoint}; rerun to resume.')
