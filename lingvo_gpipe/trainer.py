"""The trainer binary: trains and evaluates a registered experiment.

  python -m lingvo_gpipe.trainer --model=lm.synthetic.GPipeTransformerLmTiny \
      --logdir=/tmp/lm --run_locally=cpu

Jobs (--job):
  controller,trainer  trains in this process: checkpoints <logdir>/train/ckpt-<step>,
                      TensorBoard summaries in <logdir>/train; a rerun resumes.
  evaler_dev, evaler_test
                      evaluate each new checkpoint of <logdir>/train on the Dev or
                      Test data, summaries in <logdir>/eval_dev or eval_test;
                      --eval_once evaluates the latest checkpoint and exits.
  trainer_client, worker
                      multi-process pipelines (cells on remote workers): not
                      implemented yet; --cluster_spec, --task and
                      --worker_split_size are validated for them already.

--mode=inspect_params prints the model params (after overrides) and exits.
Mistakes a user can make are one line on stderr and exit code 1.
"""

import dataclasses
import os
import sys

from absl import app
from absl import flags
from absl import logging
import tensorflow as tf

from lingvo_gpipe import base_runner
from lingvo_gpipe import checkpointer as checkpointer_lib
from lingvo_gpipe import learner as learner_lib
from lingvo_gpipe.core import gpipe
from lingvo_gpipe.core import hyperparams
from lingvo_gpipe.core import py_utils

_LOCAL_JOBS = ('controller,trainer', 'evaler_dev', 'evaler_test')
_CLUSTER_JOBS = ('trainer_client', 'worker')

FLAGS = flags.FLAGS
flags.DEFINE_string('model', None, 'Registry key of the experiment, <domain>.<file>.<Class>. '
                    'Params directories outside the package: env LINGVO_GPIPE_PARAMS.')
flags.DEFINE_string('logdir', None, 'Checkpoints and summaries go to <logdir>/train, '
                    '<logdir>/eval_dev and <logdir>/eval_test.')
flags.DEFINE_enum('run_locally', 'cpu', ['cpu', 'gpu'],
                  'Local devices: cpu hides GPUs and runs the stages on logical CPU devices; '
                  'gpu places the stages on the GPUs.')
flags.DEFINE_enum('mode', 'sync', ['sync', 'inspect_params'],
                  'sync: run the job; inspect_params: print the model params and exit.')
flags.DEFINE_enum('job', 'controller,trainer', list(_LOCAL_JOBS + _CLUSTER_JOBS), 'What to run.')
flags.DEFINE_integer('task', 0, 'Index of this process within its job of --cluster_spec.')
flags.DEFINE_string('cluster_spec', '',
                    "Lingvo's cluster spec: job=host:port,host:port@job2=host:port.")
flags.DEFINE_integer('worker_split_size', None,
                     'Devices per pipeline; locally also the default of --num_cpu_devices.')
flags.DEFINE_integer('num_cpu_devices', None,
                     'Logical CPU devices of a local run; default: one per pipeline stage of '
                     'the model (4 if the params name no stages).')
flags.DEFINE_string('model_params_override', '',
                    "Params text applied to the model params: 'a.b : value' lines separated "
                    "by ';' or newlines, e.g. 'train.max_steps : 100; task.train.learning_rate "
                    ": 0.01'.")
flags.DEFINE_integer('max_steps', None, 'Shortcut for the override train.max_steps.')
flags.DEFINE_integer('steps_per_loop', 1,
                     'Training steps per tf.function call (a device-side loop).')
flags.DEFINE_integer('checkpoint_max_to_keep', 5, 'Recent checkpoints kept.')
flags.DEFINE_boolean('eval_once', False, 'Evalers: evaluate the latest checkpoint and exit.')
flags.DEFINE_integer('eval_batches', None, 'Evalers: at most this many batches per evaluation; '
                     'default the whole (finite) Dev/Test dataset.')

# -- flags -> configuration ------------------------------------------------------------


def ParseClusterSpec(text):
  """Lingvo's 'job=host:port,host:port@job2=host:port' as {job: [address, ...]}."""
  spec = {}
  for part in filter(None, text.split('@')):
    job, sep, hosts = part.partition('=')
    if not sep or not job or not hosts:
      raise base_runner.UserError(f'--cluster_spec: {part!r} is not job=host:port[,host:port].')
    if job in spec:
      raise base_runner.UserError(f'--cluster_spec: job {job!r} appears twice.')
    for address in hosts.split(','):
      host, colon, port = address.rpartition(':')
      if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
        raise base_runner.UserError(f'--cluster_spec: address {address!r} of job {job!r} is '
                                    'not host:port.')
    spec[job] = hosts.split(',')
  return spec


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """Which job and task this process is, in which cluster: what multi-process jobs need."""
  job: str
  task: int
  spec: dict
  worker_split_size: int

  @classmethod
  def FromFlags(cls):
    spec = ParseClusterSpec(FLAGS.cluster_spec)
    if FLAGS.task < 0:
      raise base_runner.UserError(f'--task must be >= 0, got {FLAGS.task}.')
    job_name = FLAGS.job.split(',')[-1]
    if job_name in spec and FLAGS.task >= len(spec[job_name]):
      raise base_runner.UserError(f'--task={FLAGS.task} but --cluster_spec lists '
                                  f'{len(spec[job_name])} {job_name} task(s).')
    for name in ('worker_split_size', 'num_cpu_devices'):
      if FLAGS[name].value is not None and FLAGS[name].value < 1:
        raise base_runner.UserError(f'--{name} must be >= 1, got {FLAGS[name].value}.')
    return cls(FLAGS.job, FLAGS.task, spec, FLAGS.worker_split_size)


def NumStages(params):
  """The largest number of pipeline stages that PipeliningLayer params within `params` name."""
  stages = 0
  if (isinstance(params, hyperparams.InstantiableParams) and isinstance(params.cls, type) and
      issubclass(params.cls, gpipe.PipeliningLayer)):
    if params.cell_tpl:
      stages = len(params.cell_tpl)
    elif 'splits' in params:
      stages = params.splits if isinstance(params.splits, int) else len(params.splits)
  for _, value in params.IterParams():
    for child in value if isinstance(value, (list, tuple)) else [value]:
      if isinstance(child, hyperparams.Params):
        stages = max(stages, NumStages(child))
  return stages


def ConfigureLocalDevices(run_locally, num_cpu_devices):
  """Hides GPUs for cpu runs and makes num_cpu_devices logical CPU devices.

  Must run before TensorFlow initialises its devices (its first op).
  """
  if run_locally == 'cpu':
    tf.config.set_visible_devices([], 'GPU')
  cpu = tf.config.list_physical_devices('CPU')[0]
  try:
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * num_cpu_devices)
  except RuntimeError:  # Devices are initialised already: keep them if they suffice.
    have = len(tf.config.list_logical_devices('CPU'))
    if have < num_cpu_devices:
      raise base_runner.UserError(
          f'TensorFlow initialised {have} CPU device(s) before {num_cpu_devices} could be '
          'configured (the params ran TensorFlow ops when built).') from None


def _MakeWritableDir(path):
  """Creates `path` if needed and checks that files can be written there."""
  probe = os.path.join(path, '.write_probe')
  try:
    tf.io.gfile.makedirs(path)
    with tf.io.gfile.GFile(probe, 'w') as f:
      f.write('')
    tf.io.gfile.remove(probe)
  except (tf.errors.OpError, OSError) as e:
    reason = getattr(e, 'message', None) or getattr(e, 'strerror', None) or str(e)
    raise base_runner.UserError(f'Cannot write to {path}: {reason}') from None


# -- jobs --------------------------------------------------------------------------------


def _Instantiate(model_params, train_dir, with_learner=False):
  """(task, global step, Learner or None, Checkpointer of train_dir)."""
  try:
    task = model_params.task.Instantiate()
  except ValueError as e:  # A bad config, e.g. from an override.
    raise base_runner.UserError(f'Cannot build the task: {e}') from None
  global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
  learner = None
  if with_learner:
    learner = learner_lib.Learner(task.params.train, task.trainable_variables, global_step)
  checkpointer = checkpointer_lib.Checkpointer(
      train_dir, task, global_step, learner and learner.optimizer,
      max_to_keep=FLAGS.checkpoint_max_to_keep)
  return task, global_step, learner, checkpointer


def RunTrainer(model_params, logdir):
  """Trains to train.max_steps, resuming from the latest checkpoint of <logdir>/train."""
  train_dir = os.path.join(logdir, 'train')
  _MakeWritableDir(train_dir)
  task, global_step, learner, checkpointer = _Instantiate(model_params, train_dir,
                                                          with_learner=True)
  checkpointer.Restore()
  step = int(global_step.numpy())
  t = model_params.train
  if step >= t.max_steps:
    logging.info('Global step %d is at train.max_steps=%d already: nothing to train.', step,
                 t.max_steps)
    return
  dataset = base_runner.InputDataset(model_params.input, start_batch=step)

  def ForwardBackward(batch):
    theta = task.theta
    metrics, grads = task.ForwardBackward(theta, batch)
    return metrics, learner_lib.GradientsAndVariables(theta, grads)

  loop_fn = learner.BuildLoop(dataset.element_spec, ForwardBackward)
  with tf.io.gfile.GFile(os.path.join(train_dir, 'params.txt'), 'w') as f:
    f.write(model_params.ToText())
  writer = tf.summary.create_file_writer(train_dir)
  logging.info('Training %s from step %d to %d. Checkpoints: %s; TensorBoard: '
               'tensorboard --logdir=%s', model_params.name, step, t.max_steps, train_dir, logdir)
  settings = base_runner.LoopSettings(
      max_steps=t.max_steps, steps_per_loop=FLAGS.steps_per_loop,
      save_interval_steps=t.save_interval_steps, summary_interval_steps=t.summary_interval_steps,
      log_interval_steps=t.log_interval_steps)
  step = base_runner.RunTraining(loop_fn, iter(dataset), global_step, checkpointer, writer,
                                 settings, base_runner.BatchSize(dataset.element_spec))
  logging.info('Trained to step %d. Latest checkpoint: %s; TensorBoard: tensorboard --logdir=%s',
               step, checkpointer.latest, logdir)


def RunEvaler(model_params, logdir, dataset_name):
  """Evaluates checkpoints of <logdir>/train, summaries in <logdir>/eval_<dataset>."""
  train_dir = os.path.join(logdir, 'train')
  eval_dir = os.path.join(logdir, f'eval_{dataset_name.lower()}')
  _MakeWritableDir(eval_dir)
  task, global_step, _, checkpointer = _Instantiate(model_params, train_dir)
  dataset = base_runner.InputDataset(model_params.input)
  if FLAGS.eval_batches is None and dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
    raise base_runner.UserError(f'The {dataset_name} input repeats forever: set its num_batches '
                                'or --eval_batches.')

  @tf.function(autograph=False)
  def EvalStep(batch):
    with py_utils.EvalMode():
      return task.FPropTower(task.theta, batch)

  writer = tf.summary.create_file_writer(eval_dir)

  def EvaluateCheckpoint(path):
    checkpointer.Restore(path)
    step = int(global_step.numpy())
    metrics, num_batches = base_runner.Evaluate(EvalStep, dataset, FLAGS.eval_batches)
    base_runner.WriteScalars(writer, step, metrics)
    logging.info('eval_%s step %d (%d batches): %s', dataset_name.lower(), step, num_batches,
                 '  '.join(f'{k} {v:.5g}' for k, v in sorted(metrics.items())))
    return step

  if FLAGS.eval_once:
    if not checkpointer.latest:
      raise base_runner.UserError(f'No checkpoint in {train_dir} to evaluate.')
    EvaluateCheckpoint(checkpointer.latest)
    return
  logging.info('Waiting for checkpoints in %s; evaluating until train.max_steps=%d.', train_dir,
               model_params.train.max_steps)
  for path in tf.train.checkpoints_iterator(train_dir):
    try:
      step = EvaluateCheckpoint(path)
    except tf.errors.NotFoundError:
      logging.info('Checkpoint %s was deleted before it could be evaluated.', path)
      continue
    if step >= model_params.train.max_steps:
      return


def RunClusterJob(cluster):
  """Multi-process jobs: the flags are validated, the jobs themselves are not built yet."""
  raise base_runner.UserError(
      f'--job={cluster.job} is not implemented yet: pipelines across processes (cells on '
      'remote workers) come with the cluster work; run locally with --job=controller,trainer.')


def _Run():
  cluster = ClusterConfig.FromFlags()
  if not FLAGS.model:
    raise base_runner.UserError('--model is required (a registry key such as '
                                'lm.synthetic.GPipeTransformerLmTiny).')
  dataset_name = {'evaler_dev': 'Dev', 'evaler_test': 'Test'}.get(FLAGS.job, 'Train')
  model_params = base_runner.LoadModelParams(FLAGS.model, dataset_name,
                                             FLAGS.model_params_override, FLAGS.max_steps)
  if FLAGS.mode == 'inspect_params':
    sys.stdout.write(model_params.ToText())
    return
  if FLAGS.job in _CLUSTER_JOBS:
    RunClusterJob(cluster)
  if cluster.spec:
    raise base_runner.UserError(
        f'--cluster_spec is for --job=trainer_client/worker (not implemented yet); '
        f'--job={FLAGS.job} runs locally: drop --cluster_spec.')
  if not FLAGS.logdir:
    raise base_runner.UserError('--logdir is required.')
  ConfigureLocalDevices(FLAGS.run_locally,
                        FLAGS.num_cpu_devices or cluster.worker_split_size or
                        NumStages(model_params.task) or 4)
  if FLAGS.job == 'controller,trainer':
    RunTrainer(model_params, FLAGS.logdir)
  else:
    RunEvaler(model_params, FLAGS.logdir, dataset_name)


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'Unexpected arguments: {" ".join(argv[1:])}')
  try:
    _Run()
  except base_runner.UserError as e:
    sys.stderr.write(f'trainer: error: {" ".join(str(e).split())}\n')
    sys.exit(1)


def Main():
  """Console-script entry point."""
  app.run(main)


if __name__ == '__main__':
  Main()
