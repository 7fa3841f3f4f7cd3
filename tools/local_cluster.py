r"""Starts N TensorFlow worker processes on free loopback ports and prints the cluster spec.

  python tools/local_cluster.py --num_workers=2
  # prints e.g. worker=localhost:41231,localhost:39555 and serves until Ctrl-C; then:
  python -m lingvo_gpipe.trainer --job=trainer_client --cluster_spec=worker=localhost:41231,\
      localhost:39555 --model=lm.synthetic.GPipeTransformerLmTiny --logdir=/tmp/lm

A script runs it in the background with --spec_file=/tmp/spec.txt and waits for
that file, which appears once every worker answers (docs/cluster.md: A cluster).

TensorFlow's workers listen on every interface, unauthenticated (docs/cluster.md:
Security). --private_network closes that door: the workers and a command given
after `--` run in a network namespace of their own that has only loopback
(`unshare --user --net`, no root needed), the command gets --cluster_spec, and
the tool exits with its exit code once the workers are stopped:

  python tools/local_cluster.py --num_workers=2 --private_network -- \
      python -m lingvo_gpipe.trainer --job=trainer_client \
      --model=lm.synthetic.GPipeTransformerLmTiny --logdir=/tmp/lm

Each worker is `python -m lingvo_gpipe.trainer --job=worker` in its own process
group, optionally pinned to a core (--cpus, with taskset) and given a number of
threads; on a machine with GPUs, worker i uses GPU i mod their count (--gpus).
Ctrl-C, SIGTERM, SIGHUP or a worker that exits stops them all. Tests and tools
use LocalCluster, a context manager that stops its workers however the block
ends.
"""

import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags

from lingvo_gpipe.runners import binaries

binaries.QuietTensorFlow()  # Before lingvo_gpipe.distribution.cluster imports TensorFlow.

# pylint: disable-next=g-import-not-at-top,wrong-import-position
from lingvo_gpipe.distribution import cluster as cluster_lib
# pylint: disable-next=g-import-not-at-top,wrong-import-position,g-bad-import-order
import tensorflow as tf

_HOST = 'localhost'


def FreePorts(count):
  """`count` distinct ports that were free on the loopback interface a moment ago."""
  sockets = []
  try:
    for _ in range(count):
      s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
      s.bind(('127.0.0.1', 0))
      sockets.append(s)
    return [s.getsockname()[1] for s in sockets]
  finally:
    for s in sockets:
      s.close()


def _Signal(proc, sig):
  """Sends `sig` to the process group of `proc`, unless it is gone already."""
  try:
    os.killpg(proc.pid, sig)
  except ProcessLookupError:
    pass


class LocalCluster:
  """Worker processes of one cluster on this machine's loopback interface.

  Args:
    num_workers: N worker tasks.
    cpus: optional core per task (taskset -c), e.g. [0, 1].
    intra_op_threads, inter_op_threads: each worker's thread pools (0: default).
    log_dir: where worker i writes worker<i>.log; default a new temporary directory.
    ready_timeout_secs: how long Start waits for the workers to answer.
    worker_args: more trainer flags for every worker (e.g. --worker_memory_log_secs=0.1).
    num_gpus: the GPUs worker i may use is GPU i mod num_gpus (--gpus), so that
      workers on one host do not each take every GPU; default: those TensorFlow
      sees here (0 on a machine without: the workers run on their CPUs).
  """

  def __init__(self, num_workers, cpus=None, intra_op_threads=0, inter_op_threads=0,
               log_dir=None, ready_timeout_secs=120, worker_args=(), num_gpus=None):
    if num_workers < 1:
      raise ValueError(f'num_workers must be >= 1, got {num_workers}.')
    if cpus is not None and len(cpus) != num_workers:
      raise ValueError(f'cpus {cpus} must give one core per worker ({num_workers}).')
    self._cpus = cpus
    self._threads = (intra_op_threads, inter_op_threads)
    self._worker_args = list(worker_args)
    self._log_dir = log_dir or tempfile.mkdtemp(prefix='local_cluster_')
    self._ready_timeout = ready_timeout_secs
    self.addresses = [f'{_HOST}:{port}' for port in FreePorts(num_workers)]
    self.spec = {cluster_lib.WORKER_JOB: self.addresses}
    self.spec_text = f'{cluster_lib.WORKER_JOB}=' + ','.join(self.addresses)
    self._procs = [None] * num_workers
    self._num_gpus = len(tf.config.list_physical_devices('GPU')) if (
        num_gpus is None) else num_gpus

  def __enter__(self):
    try:
      self.Start()
    except BaseException:
      self.Stop()
      raise
    return self

  def __exit__(self, *unused_exc_info):
    self.Stop()

  def LogPath(self, task):
    return os.path.join(self._log_dir, f'worker{task}.log')

  def Log(self, task):
    """What worker `task` wrote so far."""
    with open(self.LogPath(task), errors='replace') as f:
      return f.read()

  def Pid(self, task):
    return self._procs[task].pid

  def Command(self, task):
    """The command line of worker `task`."""
    command = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', '--job=worker',
               f'--task={task}', f'--cluster_spec={self.spec_text}',
               f'--worker_intra_op_threads={self._threads[0]}',
               f'--worker_inter_op_threads={self._threads[1]}', *self._worker_args]
    if self._num_gpus:
      command.append(f'--gpus={task % self._num_gpus}')
    if self._cpus is not None:
      command = ['taskset', '-c', str(self._cpus[task])] + command
    return command

  def StartWorker(self, task):
    """Starts worker `task` (again, after KillWorker), without waiting for it."""
    command = self.Command(task)
    with open(self.LogPath(task), 'a') as log:
      self._procs[task] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)

  def WaitUntilReady(self):
    """Returns once every worker answers; raises RuntimeError if one exits or the time is up."""
    deadline = time.time() + self._ready_timeout
    while True:
      for task, proc in enumerate(self._procs):
        if proc.poll() is not None:
          raise RuntimeError(f'Worker task {task} ({self.addresses[task]}) exited with code '
                             f'{proc.returncode}:\n{self.Log(task)[-3000:]}')
      failures = cluster_lib.UnansweredWorkers(self.addresses, 1.0)
      if not failures:
        return
      if time.time() > deadline:
        raise RuntimeError(f'Workers not ready after {self._ready_timeout} s: {failures}')
      time.sleep(0.2)

  def Start(self):
    for task in range(len(self.addresses)):
      self.StartWorker(task)
    self.WaitUntilReady()

  def KillWorker(self, task, sig=signal.SIGKILL):
    """Sends `sig` to worker `task`'s process group; waits for it to end unless it is SIGSTOP."""
    proc = self._procs[task]
    if proc is None or proc.poll() is not None:
      return
    _Signal(proc, sig)
    if sig != signal.SIGSTOP:
      proc.wait()

  def Stop(self):
    """Ends every worker: SIGTERM, then SIGKILL after 5 s."""
    for proc in self._procs:
      if proc is not None and proc.poll() is None:
        _Signal(proc, signal.SIGCONT)
        _Signal(proc, signal.SIGTERM)
    for task, proc in enumerate(self._procs):
      if proc is None:
        continue
      try:
        proc.wait(timeout=5)
      except subprocess.TimeoutExpired:
        self.KillWorker(task)

  def Exited(self):
    """{task: exit code} of the workers that ended."""
    return {t: p.returncode for t, p in enumerate(self._procs) if p and p.poll() is not None}


FLAGS = flags.FLAGS


def _DefineFlags():
  """The script's flags, defined only when it runs: tools that import LocalCluster keep
  their own flags of the same names."""
  flags.DEFINE_integer('num_workers', 2, 'Worker processes.')
  flags.DEFINE_list('cpus', None, 'Optional core per worker, e.g. 0,1 (taskset -c).')
  flags.DEFINE_integer('intra_op_threads', 0, "Each worker's intra-op threads (0: default).")
  flags.DEFINE_integer('inter_op_threads', 0, "Each worker's inter-op threads (0: default).")
  flags.DEFINE_string('worker_log_dir', None,
                      'Where worker<i>.log go; default a temporary directory.')
  flags.DEFINE_string('spec_file', None,
                      'Also write the spec to this file once every worker answers (whole, by '
                      'a rename), and remove it when the workers stop: a script waits for the '
                      'file.')
  flags.DEFINE_boolean('private_network', False,
                       'Run the workers and the command after `--` in a network namespace of '
                       'their own with only loopback: nothing outside reaches the workers.')


def _Stop(signum, unused_frame):
  raise SystemExit(128 + signum)


def _WriteWhole(path, text):
  """Writes `path` so that a reader sees either no file or all of `text`."""
  partial = f'{path}.partial'
  with open(partial, 'w') as f:
    f.write(text)
  os.replace(partial, path)


def _EnterPrivateNetwork():
  """Re-runs this tool in a new user and network namespace, unless it runs in one that has
  only loopback already (then brings loopback up)."""
  if [name for _, name in socket.if_nameindex()] == ['lo']:
    _BringUpLoopback()
    return
  probe = subprocess.run(['unshare', '--user', '--map-root-user', '--net', 'true'],
                         capture_output=True, text=True, check=False)
  if probe.returncode:
    sys.exit('local_cluster: --private_network needs unprivileged user and network '
             f'namespaces (unshare --user --net): {probe.stderr.strip()}')
  os.execvp('unshare', ['unshare', '--user', '--map-root-user', '--net', sys.executable,
                        *sys.argv])


def _BringUpLoopback():
  """Sets the loopback interface up (a new network namespace starts with it down)."""
  siocgifflags, siocsifflags, iff_up = 0x8913, 0x8914, 0x1
  with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    request = struct.pack('16sh22x', b'lo', 0)
    current = struct.unpack('16sh22x', fcntl.ioctl(s, siocgifflags, request))[1]
    fcntl.ioctl(s, siocsifflags, struct.pack('16sh22x', b'lo', current | iff_up))


def _Serve(cluster):
  """Serves until a signal or a worker exits."""
  print(cluster.spec_text, flush=True)
  print(f'Worker logs: {cluster.LogPath(0)} ...; Ctrl-C stops the workers.', file=sys.stderr,
        flush=True)
  while not cluster.Exited():
    time.sleep(0.5)
  sys.exit(f'Worker(s) exited: {cluster.Exited()}; stopping the others.')


def main(argv):
  command = argv[1:]
  if FLAGS.private_network and not command:
    raise app.UsageError('--private_network: give the command that uses the workers after '
                         '`--`; nothing outside the private network reaches them.')
  if FLAGS.private_network:
    _EnterPrivateNetwork()
  for signum in (signal.SIGTERM, signal.SIGHUP):
    signal.signal(signum, _Stop)
  cpus = [int(c) for c in FLAGS.cpus] if FLAGS.cpus else None
  with LocalCluster(FLAGS.num_workers, cpus, FLAGS.intra_op_threads, FLAGS.inter_op_threads,
                    FLAGS.worker_log_dir) as cluster:
    if FLAGS.spec_file:
      _WriteWhole(FLAGS.spec_file, cluster.spec_text + '\n')
    try:
      if not command:
        _Serve(cluster)
      code = subprocess.call(command + [f'--cluster_spec={cluster.spec_text}'])
    finally:
      if FLAGS.spec_file:
        os.remove(FLAGS.spec_file)
  sys.exit(code)


if __name__ == '__main__':
  _DefineFlags()
  binaries.Run(main)
