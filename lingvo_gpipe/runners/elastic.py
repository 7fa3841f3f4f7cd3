"""--elastic for --job=trainer_client: a lost worker costs a restart of the client, not the run.

The client trains in a child process: the same binary and flags, with a cluster spec of
the workers that answer and its pipelines cut into as many stages (`--elastic_stages`,
Replan below): by the planner when a --balance_file gives the layers' profiles and the
memory cap (K, cut, M, schedule and remat, as tools/plan_balance.py would choose them),
else evenly by layer count. This process only watches: it never connects to the
cluster, so nothing of a lost worker lingers in it.

- A worker is lost: the child stops with WORKER_LOST (the HealthMonitor's one-line
  error) and is started again on the workers left; it restores the last checkpoint into
  the new cut, so only the steps since that checkpoint are redone.
- A worker it lacks answers (one that was lost, or one listed later in the
  --elastic_workers_file): the child is asked to stop (SIGTERM: it saves a checkpoint
  after its step) and starts again on every worker that answers.
- Fewer than `min_workers` answer, or the model does not fit the workers under the plan's
  memory cap (NO_FIT): it waits up to `wait_secs` for more, saying so, then stops.

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
from typing import Any, Sequence

from absl import logging

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.insight import planner
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.pipeline import pipeline_params

WORKER_LOST = 75  # The client's exit status when a worker was lost (EX_TEMPFAIL).
NO_FIT = 76  # ... when the model does not fit the workers it has (NoFitError).
_POLL_SECS = 1.0
_STARTED = re.compile(r'Training \S+ from step (\d+) ')
_PROGRESS = re.compile(r'step (\d+)/')


def _OneChunkPipelines(params: hyperparams.Params,
                       path: str = '') -> list[tuple[str, hyperparams.Params]]:
  """(where, p) of every pipeline of `params`; ValueError if there is none, or one runs
  several chunks per device (what the re-cut does not cut)."""
  pipelines = list(pipeline_params.Find(params, path))
  if not pipelines:
    raise ValueError('--elastic re-cuts PipeliningLayer params, and the task holds none.')
  for where, p in pipelines:
    if p.Get('virtual_stages') not in (None, 1):
      raise ValueError(f'--elastic re-cuts pipelines of one chunk per device; {where or p.name} '
                       f'has virtual_stages={p.virtual_stages}.')
  return pipelines


def Recut(params: hyperparams.Params, num_stages: int) -> list[str]:
  """Cuts every pipeline of `params` into `num_stages` stages of as even a number of layers
  as divides; returns a line per pipeline. ValueError where it cannot."""
  lines = []
  for where, p in _OneChunkPipelines(params):
    layers, _ = pipeline_params.LayersAndEnds(p)
    if num_stages > len(layers):
      raise ValueError(f'{where or p.name} has {len(layers)} layers: too few for '
                       f'{num_stages} stages.')
    ends = [round(len(layers) * (k + 1) / num_stages) for k in range(num_stages)]
    pipeline_params.Recut(p, ends)
    lines.append(f'{where or p.name}: K={num_stages}, layers cut at {ends}')
  return lines


class NoFitError(errors.UserError):
  """The balance plan's model does not fit this many workers under its memory cap."""


def _Candidates(pipelines: list[tuple[str, hyperparams.Params]], batch_size: int,
                plan: balance_plan.Plan, fixed: Sequence[str]) -> dict[str, Any]:
  """ChoosePlan's candidate lists: each of M, schedule, remat and remat policy, unless the
  user set it (a dotted key in `fixed`), when only their value."""
  choices = dict(micro_batches=None, schedules=planner.PLANNABLE_SCHEDULES,
                 remats=gpipe.REMAT_MODES, remat_policies=(plan.remat_policy,))
  own = dict(num_micro_batches='micro_batches', micro_batch_size='micro_batches',
             schedule='schedules', remat='remats', cell_remat_policy='remat_policies')
  for where, p in pipelines:
    for key, choice in own.items():
      if f'{where}.{key}' in fixed:
        choices[choice] = ([pipeline_params.NumMicroBatches(p, batch_size)]
                           if choice == 'micro_batches' else (p.Get(key),))
  return choices


def PlanFor(params: hyperparams.Params, plan: balance_plan.Plan, num_stages: int,
            batch_size: int, fixed: Sequence[str] = ()) -> balance_plan.Plan:
  """The planner's best plan for `num_stages` devices, from `plan`'s layer profiles, memory
  cap, optimizer slots and per-action overhead: K, cut, M, schedule and remat, as
  tools/plan_balance.py chooses them (keeping what `fixed`, dotted keys under 'task', set).
  NoFitError if nothing fits the cap."""
  pipelines = _OneChunkPipelines(params.task, 'task')
  if plan.num_stages == num_stages:
    return plan
  _, p = pipelines[0]
  try:
    best, _ = planner.ChoosePlan(
        plan.layers, num_stages, batch_size, batch_size / plan.num_micro_batches,
        plan.memory_cap_bytes, optimizer_slots=plan.optimizer_slots,
        glued=p.cls.GluedLayers(p), source=plan.source,
        action_overhead_s=plan.action_overhead_s,
        **_Candidates(pipelines, batch_size, plan, fixed))
  except planner.NoFitError as e:
    raise NoFitError(f'--elastic on {num_stages} worker(s): {e}') from None
  return best


def Replan(model_params: hyperparams.Params, num_stages: int, plan: balance_plan.Plan | None,
           batch_size: int | None, fixed: Sequence[str] = ()) -> list[str]:
  """Cuts the task's pipelines onto `num_stages` workers: by the planner from `plan` (the
  --balance_file), else evenly (Recut). Returns what it did, a line per change."""
  if plan is None:
    return Recut(model_params.task, num_stages)
  if batch_size is None:
    raise ValueError('the planner needs the batch size, and the input params set no '
                     'batch_size: cut evenly (no --balance_file) or give the input a batch_size')
  plan = PlanFor(model_params, plan, num_stages, batch_size, fixed)
  changes = balance_plan.ApplyPlan(model_params.task, plan, 'task', fixed, batch_size)
  predicted = plan.Predict()
  return [f'planned K={num_stages}, layers cut at {plan.ends}, M={plan.num_micro_batches}, '
          f'schedule {plan.schedule}, remat {plan.remat} (predicted step '
          f'{predicted.step_time:.3g} s, bubble {predicted.bubble_fraction:.0%})', *changes]


_OWN_FLAGS = ('elastic', 'noelastic', 'elastic_min_workers', 'elastic_wait_secs',
              'elastic_stages', 'elastic_workers_file', 'cluster_spec')


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


def ReadWorkersFile(path: str) -> list[str]:
  """The worker addresses a --elastic_workers_file lists: one host:port a line; blank lines
  and lines from '#' on are left out. ClusterError if it cannot be read or a line is no
  address."""
  try:
    with open(path, encoding='utf-8') as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise cluster_lib.ClusterError(f'--elastic_workers_file: cannot read {path}: {e}') from None
  addresses = [line.split('#', 1)[0].strip() for line in lines]
  spec = cluster_lib.ParseClusterSpec(
      f'{cluster_lib.WORKER_JOB}={",".join(filter(None, addresses))}' if any(addresses) else '',
      f'--elastic_workers_file {path}')
  return spec.get(cluster_lib.WORKER_JOB, [])


@dataclasses.dataclass
class _Child:
  """One client process, and what its log said.

  workers: the addresses of the workers it runs on.
  after: (the previous child's last logged step, when it ended), or None for the first.
  """
  proc: subprocess.Popen
  workers: list[str]
  after: tuple[int | None, float] | None
  last_step: int | None = None
  started: bool = False
  asked_to_stop: bool = False


class Supervisor:
  """Runs the client in child processes over the workers that answer (the module's doc).

  Args:
    args: the client's flags, without --cluster_spec and the --elastic ones.
    spec: the cluster spec ({job: [address, ...]}); its worker job lists the workers,
      unless `workers_file` does.
    min_workers: fewest workers to train on.
    wait_secs: how long to wait for min_workers.
    timeout_secs: how long a worker may take to answer a status request.
    logdir: where the scalar goes (<logdir>/elastic).
    workers_file: a file of worker addresses (ReadWorkersFile), read again at every look at
      the workers: a worker listed later joins at the next checkpoint.
  """

  def __init__(self, args: Sequence[str], spec: dict[str, list[str]], min_workers: int,
               wait_secs: float, timeout_secs: float, logdir: str, workers_file: str = ''):
    self._args = list(args)
    self._spec = {job: a for job, a in spec.items() if job != cluster_lib.WORKER_JOB}
    self._workers_file = workers_file
    self._listed = (ReadWorkersFile(workers_file) if workers_file else
                    cluster_lib.WorkerAddresses(spec))
    if min_workers < 1 or (not workers_file and min_workers > len(self._listed)):
      raise errors.UserError(f'--elastic_min_workers must be from 1 to the {len(self._listed)} '
                             f'listed workers, got {min_workers}.')
    self._min = min_workers
    self._wait_secs = wait_secs
    self._timeout = timeout_secs
    self._logdir = logdir
    self._child = None
    self._stopping = False

  def _Listed(self) -> list[str]:
    """The workers listed now; a workers file that cannot be read keeps the last list."""
    if self._workers_file:
      try:
        listed = ReadWorkersFile(self._workers_file)
      except cluster_lib.ClusterError as e:
        logging.warning('Elastic: %s; keeping the %d workers it listed before.', e,
                        len(self._listed))
        listed = self._listed
      if listed != self._listed:
        logging.info('Elastic: --elastic_workers_file now lists %s.', listed)
      self._listed = listed
    return self._listed

  def _Answering(self) -> list[str]:
    listed = self._Listed()
    failures = cluster_lib.UnansweredWorkers(listed, min(self._timeout, 2.0)) if listed else {}
    return [a for t, a in enumerate(listed) if t not in failures]

  def _WaitFor(self, fewest: int, why: str) -> list[str]:
    """The answering workers, once at least `fewest` do; WorkerUnavailableError after
    wait_secs."""
    deadline = time.time() + self._wait_secs
    last_said = 0.0
    while True:
      live = self._Answering()
      if len(live) >= fewest:
        return live
      if time.time() >= deadline:
        raise cluster_lib.WorkerUnavailableError(
            f'--elastic: {len(live)} of {len(self._listed)} listed workers answer after '
            f'waiting {self._wait_secs:g} s; {why}.')
      if time.time() - last_said >= 10:
        logging.warning('Elastic: %d of %d listed workers answer (%s); waiting up to %.0f s more '
                        'for %d: %s.', len(live), len(self._listed), ', '.join(live) or 'none',
                        deadline - time.time(), fewest, why)
        last_said = time.time()
      time.sleep(_POLL_SECS)

  def _Start(self, live: list[str],
             after: tuple[int | None, float] | None) -> tuple[_Child, threading.Thread]:
    spec = dict(self._spec, **{cluster_lib.WORKER_JOB: live})
    text = '@'.join(f'{job}={",".join(addresses)}' for job, addresses in spec.items())
    command = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer', *self._args,
               f'--cluster_spec={text}', f'--elastic_stages={len(live)}']
    child = _Child(subprocess.Popen(command, stderr=subprocess.PIPE, text=True, bufsize=1), live,
                   after)
    relay = threading.Thread(target=self._Relay, args=(child,), daemon=True)
    relay.start()
    return child, relay

  def _Relay(self, child: _Child) -> None:
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

  def _Report(self, child: _Child, step: int) -> None:
    """The log line and scalar of a change, as the new child starts training at `step`."""
    last_step, ended = child.after
    redone = max(0, (step if last_step is None else last_step) - step)
    seconds = time.time() - ended
    logging.info('Elastic: training again on %d worker(s) (%s) from step %d: %d logged '
                 'step(s) redone, %.1f s after the change.', len(child.workers),
                 ', '.join(child.workers), step, redone, seconds)
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    with tf.summary.create_file_writer(os.path.join(self._logdir, 'elastic')).as_default():
      tf.summary.scalar('elastic/workers', len(child.workers), step=step)

  def _Wait(self, child: _Child) -> int:
    """The child's exit status; asks it to stop once a worker it lacks answers."""
    while child.proc.poll() is None:
      time.sleep(_POLL_SECS)
      if child.asked_to_stop or self._stopping:
        continue
      joining = [a for a in self._Answering() if a not in child.workers]
      if joining:
        logging.info('Elastic: %s answers; the client stops at a checkpoint to re-plan onto '
                     'it.', ', '.join(joining))
        child.asked_to_stop = True
        child.proc.send_signal(signal.SIGTERM)
    return child.proc.wait()

  def _OnSignal(self, signum: int, unused_frame) -> None:
    """SIGTERM or SIGINT: the child stops at a checkpoint, and no other starts."""
    self._stopping = True
    if self._child is not None and self._child.proc.poll() is None:
      self._child.proc.send_signal(signum)

  def Run(self) -> int:
    """Trains until the client finishes (or fails otherwise than by a lost worker or too few
    to fit); returns its exit status."""
    for signum in (signal.SIGTERM, signal.SIGINT):
      signal.signal(signum, self._OnSignal)
    after, fewest, why = None, self._min, f'--elastic_min_workers={self._min}'
    while True:
      live = self._WaitFor(fewest, why)
      self._child, relay = self._Start(live, after)
      code = self._Wait(self._child)
      relay.join()
      replan = code in (WORKER_LOST, NO_FIT) or (code == 128 + signal.SIGTERM and
                                                 self._child.asked_to_stop)
      if self._stopping or not replan:
        return code
      if code == WORKER_LOST:
        logging.warning('Elastic: lost a worker of %s after step %s; re-planning onto the '
                        'workers left.', ', '.join(live), self._child.last_step)
      if code == NO_FIT:
        fewest, why = len(live) + 1, f'the model does not fit {len(live)}'
      else:
        fewest, why = self._min, f'--elastic_min_workers={self._min}'
      if self._child.started or after is None:
        after = (self._child.last_step, time.time())
