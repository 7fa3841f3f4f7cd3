r"""Elastic training: a worker lost at a random step and brought back, against a run never
interrupted.

  python tools/elastic_benchmark.py                 # 3 sequences of 60 steps
  python tools/elastic_benchmark.py --sequences=20 --steps=60

Each sequence starts three worker processes on loopback (tools/local_cluster.py) and
`--job=trainer_client --elastic` on them (lingvo_gpipe/runners/elastic.py), the tiny LM
with 4 layers on 3 stages, a checkpoint every 3 steps. At a random step it kills a random
worker (kill -9), waits for the client to train again on the two left, starts the worker
again and waits for the client to train on three; the run then ends at --steps. Reported
per sequence: the worker and step of the loss, the seconds from each change (the old
client's exit) to the new client's first training step's start ("Training ... from step"),
the logged steps redone, and the largest relative difference of the final weights and of
the logged losses to one uninterrupted run in one process (key-projection biases left out:
their gradient is 0 but for rounding, elastic_test explains). Prints a table, then the JSON.
"""

import glob
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from absl import app
from absl import flags
import numpy as np

import local_cluster

FLAGS = flags.FLAGS


def _DefineFlags():
  """The tool's flags; not at import, as tests/elastic_test.py imports its driver."""
  flags.DEFINE_integer('sequences', 3, 'Kill-and-return sequences to run.')
  flags.DEFINE_integer('steps', 60, 'Training steps of each run.')
  flags.DEFINE_integer('seed', 0, 'Seed of the random steps and workers.')
  flags.DEFINE_string('json_out', '', 'Also write the results JSON to this file.')

MODEL = 'lm.synthetic.GPipeTransformerLmTiny'
OVERRIDE = ('task.stack.num_decoder_layers : 4; task.stack.splits : 3; '
            'train.save_interval_steps : 3; train.log_interval_steps : 1')
_CHANGE = re.compile(r'Elastic: training again on (\d+) worker\(s\).* from step (\d+): (\d+) '
                     r'logged step\(s\) redone, ([\d.]+) s after the change')


class Lines:
  """A process's stderr lines, read as they come."""

  def __init__(self, proc):
    self._queue, self.seen = queue.Queue(), []
    threading.Thread(target=self._Read, args=(proc,), daemon=True).start()

  def _Read(self, proc):
    for line in proc.stderr:
      self._queue.put(line)

  def WaitFor(self, text, timeout):
    """The first line from now on that holds `text`; RuntimeError after `timeout` s."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      try:
        line = self._queue.get(timeout=1)
      except queue.Empty:
        continue
      self.seen.append(line)
      if text in line:
        return line
    raise RuntimeError(f'No {text!r} within {timeout} s:\n{"".join(self.seen[-60:])}')


def _Env():
  return dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2')


def _Trainer(*flags_):
  return subprocess.Popen([sys.executable, '-m', 'lingvo_gpipe.trainer', f'--model={MODEL}',
                           f'--model_params_override={OVERRIDE}', *flags_], env=_Env(),
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def StartReference(logdir, steps):
  """The uninterrupted run: one process, three logical CPU devices."""
  return _Trainer(f'--logdir={logdir}', f'--max_steps={steps}', '--run_locally=cpu')


def _WriteLines(path, lines):
  with open(path + '.new', 'w') as f:
    f.write('\n'.join(lines) + '\n')
  os.replace(path + '.new', path)  # Whole, as the client reads it every second.


def RunSequence(workers, logdir, steps, kill_after, task, timeout=240, listed=None):
  """Trains on `workers` (a started LocalCluster of 3) with --elastic; kills worker `task`
  once step `kill_after` is logged, starts it again once the client trains on the others,
  and waits for the run's end. With `listed`, an --elastic_workers_file lists only the
  first `listed` workers at the start, and the others once the lost one is back. Returns
  (the changes' (workers, from step, steps redone, seconds) tuples, every line of the
  client's log)."""
  everyone = len(workers.addresses)
  listed = listed or everyone
  workers_file = logdir + '_workers.txt'
  if listed < everyone:
    _WriteLines(workers_file, workers.addresses[:listed])
    where = f'--elastic_workers_file={workers_file}'
  else:
    where = f'--cluster_spec={workers.spec_text}'
  client = _Trainer('--job=trainer_client', '--elastic', where, f'--logdir={logdir}',
                    f'--max_steps={steps}', '--worker_timeout_secs=4')
  try:
    lines = Lines(client)
    lines.WaitFor(f'step {kill_after}/', timeout)
    workers.KillWorker(task, signal.SIGKILL)
    changes = [lines.WaitFor(f'Elastic: training again on {listed - 1} worker(s)', timeout)]
    workers.StartWorker(task)
    workers.WaitUntilReady()
    changes.append(lines.WaitFor(f'Elastic: training again on {listed} worker(s)', timeout))
    if listed < everyone:
      _WriteLines(workers_file, workers.addresses)
      changes.append(lines.WaitFor(f'Elastic: training again on {everyone} worker(s)', timeout))
    lines.WaitFor(f'Trained to step {steps}.', timeout)
    code = client.wait(timeout=60)
    if code:
      raise RuntimeError(f'The client exited {code}:\n{"".join(lines.seen[-60:])}')
  finally:
    if client.poll() is None:
      client.kill()
  parsed = [_CHANGE.search(line) for line in changes]
  return [(int(m[1]), int(m[2]), int(m[3]), float(m[4])) for m in parsed], lines.seen


def Weights(logdir):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(os.path.join(logdir, 'train')))
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith('model/')}


def Losses(logdir):
  """Step -> the last 'loss' scalar the trainer wrote for it."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  losses = {}
  for path in sorted(glob.glob(os.path.join(logdir, 'train', 'events.out.tfevents.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        if value.tag == 'loss':
          losses[event.step] = float(tf.make_ndarray(value.tensor))
  return losses


def WeightError(got, want):
  """The largest relative difference of a tensor, key-projection biases left out."""
  return max(np.max(np.abs(got[k] - v)) / np.max(np.abs(v)) for k, v in want.items()
             if '/key_proj/b/' not in k)


def LossError(got, want):
  return max(abs(got[step] - loss) / abs(loss) for step, loss in want.items())


def main(argv):
  del argv
  rng = random.Random(FLAGS.seed)
  root = tempfile.mkdtemp(prefix='elastic_benchmark_')
  reference = os.path.join(root, 'straight')
  proc = StartReference(reference, FLAGS.steps)
  _, err = proc.communicate()
  if proc.returncode:
    sys.exit(f'The uninterrupted run failed:\n{err[-3000:]}')
  want_weights, want_losses = Weights(reference), Losses(reference)
  results = []
  for i in range(FLAGS.sequences):
    kill_after, task = rng.randint(4, FLAGS.steps // 3), rng.randrange(3)
    logdir = os.path.join(root, f'run{i}')
    os.makedirs(logdir + '_workers')
    with local_cluster.LocalCluster(3, log_dir=logdir + '_workers') as workers:
      changes, lines = RunSequence(workers, logdir, FLAGS.steps, kill_after, task)
    result = dict(sequence=i, lost_task=task, lost_after_step=kill_after,
                  changes=[dict(workers=w, from_step=s, steps_redone=r, seconds=t)
                           for w, s, r, t in changes],
                  weight_rel_error=float(WeightError(Weights(logdir), want_weights)),
                  loss_rel_error=float(LossError(Losses(logdir), want_losses)),
                  tracebacks=sum('Traceback' in line for line in lines))
    results.append(result)
    print(f'[{i + 1}/{FLAGS.sequences}] worker {task} lost after step {kill_after}: '
          f'{[round(c[3], 1) for c in changes]} s to resume', flush=True)
  print('\n| seq | lost worker | after step | to 2 workers: s, redone | back to 3: s, redone '
        '| weights rel. error | losses rel. error | tracebacks |')
  print('|---|---|---|---|---|---|---|---|')
  for r in results:
    lost, back = r['changes']
    print(f"| {r['sequence']} | {r['lost_task']} | {r['lost_after_step']} | "
          f"{lost['seconds']:.1f}, {lost['steps_redone']} | {back['seconds']:.1f}, "
          f"{back['steps_redone']} | {r['weight_rel_error']:.1e} | {r['loss_rel_error']:.1e} | "
          f"{r['tracebacks']} |")
  text = json.dumps(results, indent=1)
  print(text)
  if FLAGS.json_out:
    with open(FLAGS.json_out, 'w') as f:
      f.write(text)


if __name__ == '__main__':
  _DefineFlags()
  app.run(main)
