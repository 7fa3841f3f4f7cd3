"""One trainer per logdir: a lock file naming its holder's host, pid and start time.

Two trainers writing one directory would interleave their checkpoints, so a
second one refuses to start. The lock is an flock on <dir>/trainer.lock, which
the kernel releases when its process dies, even by kill -9; the file's text
says who holds it. A file whose flock is free, left by a process on this host,
is stale and taken over, even if its pid now names another process (a restarted
container's trainer is often pid 1 again); one from another host is refused,
since whether its process lives cannot be told from here (a network file system
may not carry the flock). A directory of another file system (a URL such as
gs://bucket/run) has no flock: it is not locked, with a warning.
"""

import datetime
import fcntl
import json
import os
import socket

from absl import logging

from lingvo_gpipe.foundation import errors

LOCK_FILE = 'trainer.lock'
# The locks this process holds, for an exit that skips their __exit__ (ReleaseHeld).
_HELD = set()


def _Describe(holder):
  if not holder:  # Locked, its holder not yet written.
    return 'starting up'
  return f'pid {holder["pid"]} on host {holder["host"]} since {holder.get("start")}'


def _Holder(fd):
  """The holder written in the open lock file: {host, pid, start}, or {} if none readable."""
  os.lseek(fd, 0, os.SEEK_SET)
  try:
    holder = json.loads(os.read(fd, 4096).decode())
  except (UnicodeDecodeError, ValueError):
    return {}
  valid = (isinstance(holder, dict) and isinstance(holder.get('host'), str) and
           isinstance(holder.get('pid'), int) and holder['pid'] > 0)
  return holder if valid else {}


class RunLock:
  """Context manager that holds <directory>/trainer.lock, or raises UserError naming its holder."""

  def __init__(self, directory):
    self._path = os.path.join(directory, LOCK_FILE)
    self._fd = None
    self._local = '://' not in directory

  def __enter__(self):
    if not self._local:
      logging.warning('%s is not on a local file system, so it cannot be locked: make sure no '
                      'other trainer writes there.', os.path.dirname(self._path))
      return self
    while self._fd is None:
      fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = _Holder(fd)
        os.close(fd)
        raise errors.UserError(
            f'{os.path.dirname(self._path)} is in use by another trainer ({_Describe(holder)}): '
            'one trainer per directory; stop it or train into another one.') from None
      if os.path.exists(self._path) and os.stat(self._path).st_ino == os.fstat(fd).st_ino:
        self._fd = fd
      else:  # The holder removed the file as we opened it: lock the new one.
        os.close(fd)
    self._TakeOver(_Holder(self._fd))
    try:
      with errors.Writing(self._path):
        os.ftruncate(self._fd, 0)
        os.lseek(self._fd, 0, os.SEEK_SET)
        os.write(self._fd, json.dumps({
            'host': socket.gethostname(), 'pid': os.getpid(),
            'start': datetime.datetime.now().isoformat(timespec='seconds')}).encode())
        os.fsync(self._fd)
    except errors.UserError:
      self._Release()
      raise
    _HELD.add(self)
    return self

  def _TakeOver(self, holder):
    """Accepts a holder left in the file by a process of this host (a message), else refuses.

    The flock is ours, so no process of this host holds the lock: the holder died.
    """
    if not holder:
      return
    if holder['host'] != socket.gethostname():
      os.close(self._fd)
      self._fd = None
      raise errors.UserError(
          f'{self._path} names {_Describe(holder)}, which may still be running: if no trainer '
          'uses this directory, delete the file.')
    logging.warning('Taking over the stale lock %s of %s: that process is gone.', self._path,
                    _Describe(holder))

  def __exit__(self, *unused_exc_info):
    if not self._local or self._fd is None:
      return
    _HELD.discard(self)
    self._Release()

  def _Release(self):
    os.remove(self._path)
    os.close(self._fd)
    self._fd = None


def ReleaseHeld():
  """Releases the locks this process holds, before an os._exit (a client whose job thread
  still waits on a lost worker): the file left behind would name a dead holder, which
  another host refuses."""
  for lock in list(_HELD):
    try:
      lock.__exit__(None, None, None)
    except OSError:  # Its own thread released it meanwhile.
      pass
