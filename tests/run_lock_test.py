"""Tests of run_lock: one holder at a time, stale locks taken over, unknown ones refused."""

import json
import os
import socket
import subprocess
import sys

import pytest

from lingvo_gpipe.foundation import errors
from lingvo_gpipe.training import run_lock


def _LockFile(directory):
  return os.path.join(directory, run_lock.LOCK_FILE)


def _WriteHolder(directory, host, pid):
  with open(_LockFile(directory), 'w') as f:
    json.dump({'host': host, 'pid': pid, 'start': '2020-01-01T00:00:00'}, f)


def _DeadPid():
  proc = subprocess.run([sys.executable, '-c', 'import os; print(os.getpid())'],
                        capture_output=True, text=True, check=True)
  return int(proc.stdout)


def testTheHolderIsWrittenAndASecondLockRefusedInOneLine(tmp_path):
  with run_lock.RunLock(str(tmp_path)):
    holder = json.load(open(_LockFile(tmp_path)))
    assert holder['host'] == socket.gethostname() and holder['pid'] == os.getpid()
    with pytest.raises(errors.UserError) as e:
      run_lock.RunLock(str(tmp_path)).__enter__()
    assert str(e.value) == (
        f'{tmp_path} is in use by another trainer (pid {os.getpid()} on host '
        f'{socket.gethostname()} since {holder["start"]}): one trainer per directory; stop it '
        'or train into another one.')
  assert not os.path.exists(_LockFile(tmp_path))


def testReleaseHeldFreesTheLocksAnExitWouldLeave(tmp_path):
  """What the trainer calls before os._exit, which skips the lock's __exit__."""
  first, second = tmp_path / 'a', tmp_path / 'b'
  first.mkdir()
  second.mkdir()
  with run_lock.RunLock(str(first)), run_lock.RunLock(str(second)):
    run_lock.ReleaseHeld()
    assert not os.path.exists(_LockFile(first)) and not os.path.exists(_LockFile(second))
    with run_lock.RunLock(str(first)):  # Free again, at once and without a take-over.
      assert json.load(open(_LockFile(first)))['pid'] == os.getpid()
  run_lock.ReleaseHeld()  # Nothing held: nothing to do.


def testALockHeldByAnotherProcessIsRefused(tmp_path):
  script = ('import sys, time; from lingvo_gpipe.training import run_lock\n'
            f'with run_lock.RunLock({str(tmp_path)!r}):\n'
            '  print("held", flush=True); sys.stdin.read()\n')
  holder = subprocess.Popen([sys.executable, '-c', script], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == 'held\n'
    with pytest.raises(errors.UserError, match=f'in use by another trainer '
                                                    f'\\(pid {holder.pid} '):
      run_lock.RunLock(str(tmp_path)).__enter__()
  finally:
    holder.communicate('')
  with run_lock.RunLock(str(tmp_path)):  # Released at its exit.
    pass


@pytest.mark.parametrize('pid_now', ['dead', 'reused', 'mine'])
def testAStaleLockOfThisHostIsTakenOverWithAMessage(tmp_path, caplog, pid_now):
  """Its flock is free, so its holder died, whatever process its pid names now (a restarted
  container's trainer may have the same pid, 1, as the one that died)."""
  pid = {'dead': _DeadPid, 'reused': os.getppid, 'mine': os.getpid}[pid_now]()
  _WriteHolder(tmp_path, socket.gethostname(), pid)
  with run_lock.RunLock(str(tmp_path)):
    assert json.load(open(_LockFile(tmp_path)))['pid'] == os.getpid()
  messages = [r.getMessage() for r in caplog.records if 'stale lock' in r.getMessage()]
  assert len(messages) == 1 and f'pid {pid} on host {socket.gethostname()}' in messages[0]


@pytest.mark.parametrize('pid_now', ['dead', 'alive'])
def testALockOfAnotherHostIsRefusedAndKept(tmp_path, pid_now):
  host = 'elsewhere'
  pid = os.getppid() if pid_now == 'alive' else _DeadPid()
  _WriteHolder(tmp_path, host, pid)
  before = open(_LockFile(tmp_path)).read()
  with pytest.raises(errors.UserError, match=f'names pid {pid} on host {host} since .*, '
                                                  'which may still be running'):
    run_lock.RunLock(str(tmp_path)).__enter__()
  assert open(_LockFile(tmp_path)).read() == before


def testADirectoryOfAnotherFileSystemIsNotLockedWithAWarning(tmp_path, monkeypatch, caplog):
  """gs://... has no flock: nothing is written locally (no 'gs:' folder), a warning says so."""
  monkeypatch.chdir(tmp_path)
  with run_lock.RunLock('gs://bucket/run/train'):
    with run_lock.RunLock('gs://bucket/run/train'):
      pass
  assert not os.listdir(tmp_path)
  assert [r.getMessage() for r in caplog.records] == [
      'gs://bucket/run/train is not on a local file system, so it cannot be locked: make sure '
      'no other trainer writes there.'] * 2
