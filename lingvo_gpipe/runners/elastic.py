"""--elastic for --job=trainer_client: a lost worker costs a restart of the client, not the run.

The client trains in a child process: the same binary and flags, with a cluster spec of
the workers that answer and its pipelines re-cut into as many stages (`--elastic_stages`,
Recut below). This process only watches: it never connects to the cluster, so nothing of
a lost worker lingers in it.

- A worker is lost: the child stops with WORKER_LOST (the HealthMonitor's one-line
  error) and is started again on the workers left; it restores the last checkpoint into
  the new cut, so only the steps since that checkpoint are redone.
- A listed worker answers again: the child is asked to stop (SIGTERM: it saves a
  checkpoint after its step) and starts again on every worker that answers.
- Fewer than `min_workers` answer: it waits up to `wait_secs`, saying so, then stops.

A model's checkpoints do not depend on its cut, and its data on the step, so the run
trains the same model whatever the losses (tests/elastic_test.py). Each change is one log
line and a TensorBoard scalar (`elastic/workers` under <logdir>/elastic).
"""

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time

from absl import logging

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.pipeline import pipeline_params

WORKER_LOST = 75  # The client's exit status when a worker was lost (EX_TEMPFAIL).
_POLL_SECS = 1.0
_STARTED = re.compile(r'Training \S+ from step (\d+) ')
_PROGRESS = re.compile(r'step (\d+)/')


def Recut(params, num_stages: int) -> list[str]:
  """Cuts every pipeline of `params` into `num_stages` stages of as even a number of layers
  as divides; returns a line per pipeline. ValueError where it cannot."""
  lines = []
  for where, p in pipeline_params.Find(params):
    if p.Get('virtual_stages') not in (None, 1):
      raise ValueError(f'--elastic re-cuts pipelines of one chunk per device; {where or p.name} '
                       f'has virtual_stages={p.virtual_stages}.')
    layers, _ = pipeline_params.LayersAndEnds(p)
    if num_stages > len(layers):
      raise ValueError(f'{where or p.name} has {len(layers)} layers: too few for '
                       f'{num_stages} stages.')
    ends = [round(len(layers) * (k + 1) / num_stages) for k in range(num_stages)]
    pipeline_params.Recut(p, ends)
    lines.append(f'{where or p.name}: K={num_stages}, layers cut at {ends}')
  if not lines:
    raise ValueError('--elastic re-cuts PipeliningLayer params, and the task holds none.')
  return lines


_OWN_FLAGS = ('elastic', 'noelastic', 'elastic_min_workers', 'elastic_wait_secs',
              'elastic_stages', 'cluster_spec')


def ChildArgs(argv: list[str]) -> list[str]:
  """The client's flags of `argv` (the binary's, without its name) for a child: without
  --cluster_spec and the --elastic flags, which the supervisor sets."""
  out, skip = [], False
  for arg in argv:
    if skip:
      skip = False
      continue
    name = arg.lstrip('-').split('=', 1)[0]
    if arg.startswith('-') and name in _OWN_FLAGS:
      skip = '=' not in arg and name not in ('elastic', 'noelastic')  # Its value follows.
      continue
    out.append(arg)
  return out


@dataclasses.dataclass
class _Child:
  """One client process, and what its log said.

  workers: the tasks it runs on.
  after: (the previous child's last logged step, when it ended), or None for the first.
  """
  proc: subprocess.Popen
  workers: list[int]
  after: tuple[int | None, float] | None
  last_step: int | None = None
  started: bool = False
  asked_to_stop: bool = False


class Supervisor:
  """Runs the client in child processes over the workers that answer (the module's doc).

  Args:
    args: the client's flags, without --cluster_spec and the --elastic ones.
    spec: the cluster spec ({job: [address, ...]}).
    min_workers: fewest workers to train on.
    wait_secs: how long to wait for min_workers.
    timeout_secs: how long a worker may take to answer a status request.
    logdir: where the scalar goes (<logdir>/elastic).
  """

  def __init__(self, args, spec, min_workers, wait_secs, timeout_secs, logdir):
    self._args = list(args)
    self._spec = spec
    self._addresses = cluster_lib.WorkerAddresses(spec)
    if not 1 <= min_workers <= len(self._addresses):
      raise errors.UserError(f'--elastic_min_workers must be from 1 to the {len(self._addresses)} '
                             f'listed workers, got {min_workers}.')
    self._min = min_workers
    self._wait_secs = wait_secs
    self._timeout = timeout_secs
    self._logdir = logdir
    self._child = None
    self._stopping = False

  def _Answering(self):
    failures = cluster_lib.UnansweredWorkers(self._addresses, min(self._timeout, 2.0))
    return [t for t in range(len(self._addresses)) if t not in failures]

  def _WaitForMinimum(self):
    deadline = time.time() + self._wait_secs
    last_said = 0.0
    while True:
      live = self._Answering()
      if len(live) >= self._min:
        return live
      if time.time() >= deadline:
        raise cluster_lib.WorkerUnavailableError(
            f'--elastic: {len(live)} of {len(self._addresses)} workers answer after waiting '
            f'{self._wait_secs:g} s; --elastic_min_workers={self._min}.')
      if time.time() - last_said >= 10:
        logging.warning('Elastic: %d of %d workers answer (tasks %s); waiting up to %.0f s more '
                        'for --elastic_min_workers=%d.', len(live), len(self._addresses), live,
                        deadline - time.time(), self._min)
        last_said = time.time()
      time.sleep(_POLL_SECS)

  def _Start(self, live, after):
    spec = dict(self._spec, **{cluster_lib.WORKER_JOB: [self._addresses[t] for t in live]})
    text = '@'.join(f'{job}={",".join(addresses)}' for job, addresses in spec.items())
    command = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', *self._args,
               f'--cluster_spec={text}', f'--elastic_stages={len(live)}']
    child = _Child(subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1), live,
                   after)
    relay = threading.Thread(target=self._Relay, args=(child,), daemon=True)
    relay.start()
    return child, relay

  def _Relay(self, child):
    """Passes the child's log on, noting where it starts training and how far it got."""
    for line in child.proc.stderr:
      sys.stderr.write(line)
      started = _STARTED.search(line)
      if started and not child.started:
        child.started = True
        if child.after is not None:
          self._Report(child, int(started.group(1)))
      progress = _PROGRESS.search(line)
      if progress:
        child.last_step = int(progress.group(1))

  def _Report(self, child, step):
    """The log line and scalar of a change, as the new child starts training at `step`."""
    last_step, ended = child.after
    redone = max(0, (step if last_step is None else last_step) - step)
    seconds = time.time() - ended
    logging.info('Elastic: training again on %d worker(s) (tasks %s) from step %d: %d logged '
                 'step(s) redone, %.1f s after the change.', len(child.workers), child.workers,
                 step, redone, seconds)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    with tf.summary.create_file_writer(os.path.join(self._logdir, 'elastic')).as_default():
      tf.summary.scalar('elastic/workers', len(child.workers), step=step)

  def _Wait(self, child):
    """The child's exit status; asks it to stop once a worker it lacks answers again."""
    while child.proc.poll() is None:
      time.sleep(_POLL_SECS)
      if (not child.asked_to_stop and not self._stopping and
          len(child.workers) < len(self._addresses) and
          len(self._Answering()) > len(child.workers)):
        logging.info('Elastic: a worker answers again; the client stops at a checkpoint to '
                     're-plan onto it.')
        child.asked_to_stop = True
        child.proc.send_signal(signal.SIGTERM)
    return child.proc.wait()

  def _OnSignal(self, signum, unused_frame):
    """SIGTERM or SIGINT: the child stops at a checkpoint, and no other starts."""
    self._stopping = True
    if self._child is not None and self._child.proc.poll() is None:
      self._child.proc.send_signal(signum)

  def Run(self) -> int:
    """Trains until the client finishes (or fails otherwise than by a lost worker); returns
    its exit status."""
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, self._OnSignal)
    after = None
    while True:
      live = self._WaitForMinimum()
      self._child, relay = self._Start(live, after)
      code = self._Wait(self._child)
      relay.join()
      replan = code == WORKER_LOST or (code == 128 + signal.SIGTERM and
                                       self._child.asked_to_stop)
      if self._stopping or not replan:
        return code
      if code == WORKER_LOST:
        logging.warning('Elastic: lost a worker of tasks %s after step %s; re-planning onto the '
                        'workers left.', live, self._child.last_step)
      after = (self._child.last_step, time.time())
