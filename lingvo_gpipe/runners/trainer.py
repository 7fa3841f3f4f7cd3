r"""The trainer binary: trains and evaluates a registered experiment.

  python -m lingvo_gpipe.trainer --model=lm.synthetic.GPipeTransformerLmTiny \
      --logdir=/tmp/lm --run_locally=cpu

Jobs (--job):
  controller,trainer  trains in this process: checkpoints <logdir>/train/ckpt-<step>,
                      TensorBoard summaries in <logdir>/train; a rerun resumes from
                      the newest intact checkpoint. One trainer per logdir (a lock
                      file); SIGTERM or Ctrl-C saves after the current step and exits.
  evaler_dev, evaler_test
                      evaluate each new checkpoint of <logdir>/train on the Dev or
                      Test data, summaries in <logdir>/eval_dev or eval_test;
                      --eval_once evaluates the latest checkpoint and exits;
                      --eval_timeout_secs stops a follower whose trainer died.
  worker              serves this process's devices to a cluster (a TensorFlow
                      server) until killed: --task=N of --cluster_spec's worker job.
  trainer_client      trains with the pipelines' stages on the workers' devices,
                      --worker_split_size devices per pipeline, --worker_replicas
                      pipelines; checkpoints and summaries as controller,trainer.
  decoder_dev, decoder_test
                      decode each new checkpoint's Dev or Test data (sequence
                      tasks; the task's `decoder` params: greedy, sample or
                      beam): exact_match and bleu in <logdir>/decoder_dev or
                      decoder_test, the decodes in decodes-<step>.txt there.
  evaler_*, decoder_* with --cluster_spec
                      evaluate or decode on the workers' devices in the same way.

A cluster is --cluster_spec=worker=host:port,host:port (Lingvo's format, more
jobs after '@'), or the TF_CONFIG environment variable. A cluster client that
loses a worker (it exits, hangs or cannot be reached) stops within about
--worker_timeout_secs with an error naming the worker; restart the worker and
the client, and training resumes from the last checkpoint.

--mode=inspect_params prints the model params (after overrides) and exits;
--mode=list_models prints the registered models with one-line descriptions.
Mistakes a user can make are one line on stderr and exit code 1.
"""

import contextlib
import dataclasses
import math
import os
import signal
import sys

from lingvo_gpipe.runners import binaries

binaries.QuietTensorFlow()  # Before TensorFlow is imported.

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import flags
from absl import logging

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import memory_stats
from lingvo_gpipe.insight import balance_plan
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.runners import elastic
from lingvo_gpipe.runners import evaler
from lingvo_gpipe.runners import local_devices
from lingvo_gpipe.runners import pipeline_check
from lingvo_gpipe.runners import train_job
from lingvo_gpipe.training import checkpoint_files
from lingvo_gpipe.training import preemption
from lingvo_gpipe.training import run_lock
# pylint: enable=g-import-not-at-top,wrong-import-position

_EVAL_JOBS = ('evaler_dev', 'evaler_test', 'decoder_dev', 'decoder_test')
_LOCAL_JOBS = ('controller,trainer',) + _EVAL_JOBS
_CLUSTER_JOBS = ('trainer_client', 'worker')
# Jobs that run against a cluster when given one (--cluster_spec or TF_CONFIG).
_CLIENT_JOBS = ('trainer_client',) + _EVAL_JOBS

FLAGS = flags.FLAGS
flags.DEFINE_string('model', None, 'Registry key of the experiment, <domain>.<file>.<Class>. '
                    'Params directories outside the package: env LINGVO_GPIPE_PARAMS.')
flags.DEFINE_string('logdir', None, 'Checkpoints and summaries go to <logdir>/train, '
                    '<logdir>/eval_dev and <logdir>/eval_test.')
flags.DEFINE_enum('run_locally', 'auto', list(devices_lib.LOCAL_KINDS),
                  'Local devices: auto is gpu when TensorFlow sees a GPU, else cpu; cpu hides '
                  'GPUs and runs the stages on logical CPU devices; gpu places the stages on '
                  'the GPUs (docs/gpus.md).')
flags.DEFINE_bool('gpu_memory_growth', True,
                  'GPUs allocate memory as needed; off, TensorFlow takes nearly all of every '
                  'GPU this process sees at its first op (no second process fits beside it).')
flags.DEFINE_integer('gpu_split_mb', None,
                     'Split GPU 0 into one logical GPU of this many MB per stage: K stages on '
                     'one GPU, for testing (memory growth does not apply).')
flags.DEFINE_list('gpus', None,
                  'Indices of the GPUs this process uses (a --job=worker given its own, as '
                  'tools/local_cluster.py does); default: all.')
flags.DEFINE_enum('mode', 'sync',
                  ['sync', 'inspect_params', 'list_models', 'check_pipeline', 'export_decoder'],
                  'sync: run the job; inspect_params: print the model params and exit; '
                  'list_models: print the registry keys with one-line descriptions and exit; '
                  'check_pipeline: train --check_steps steps pipelined as configured and '
                  'unpipelined from the same weights (the latest checkpoint of --logdir, if '
                  'any) and data, print the largest relative differences, exit 1 above '
                  '--check_tolerance; export_decoder: write a SavedModel that decodes '
                  '(lingvo_gpipe.models.decoder.Export) from the latest checkpoint of --logdir to '
                  '--export_dir.')
flags.DEFINE_string('export_dir', None, '--mode=export_decoder: where the SavedModel goes '
                    '(default <logdir>/export/decoder-<step>).')
flags.DEFINE_enum('job', 'controller,trainer', list(_LOCAL_JOBS + _CLUSTER_JOBS), 'What to run.')
flags.DEFINE_integer('task', 0, 'Index of this process within its job of --cluster_spec.')
flags.DEFINE_string('cluster_spec', '',
                    "Lingvo's cluster spec: job=host:port,host:port@job2=host:port. Empty: "
                    'worker, trainer_client and the evalers read TF_CONFIG if it is set.')
flags.DEFINE_integer('worker_split_size', None,
                     'Devices per pipeline replica (default: the number of stages of the '
                     "model); replica r runs on split r of the cluster's (or local) devices.")
flags.DEFINE_integer('worker_replicas', 1,
                     'R data-parallel replicas of each pipeline, each on its own split of '
                     'devices and 1/R of the batch; their gradients are summed, so training '
                     'equals one device on the whole batch.')
flags.DEFINE_float('worker_timeout_secs', 60.0,
                   'Cluster clients: how long workers may take to answer at start-up and each '
                   'status request (one a second); a worker that does not stops the job with '
                   'an error naming it.')
flags.DEFINE_bool('elastic', False,
                  '--job=trainer_client: train on the workers that answer, re-cutting the '
                  'pipelines onto them from the last checkpoint when one is lost or comes back '
                  '(docs/cluster.md#elastic-training).')
flags.DEFINE_integer('elastic_min_workers', 1,
                     '--elastic: the fewest workers to train on; below it the client waits up to '
                     '--elastic_wait_secs.')
flags.DEFINE_float('elastic_wait_secs', 600.0,
                   '--elastic: how long to wait for --elastic_min_workers workers.')
flags.DEFINE_integer('elastic_stages', None,
                     'Set by --elastic for its client: cut every pipeline into this many '
                     'stages (one per worker), by the planner from --balance_file if given.')
flags.DEFINE_string('elastic_workers_file', '',
                    '--elastic: a file of worker addresses (host:port a line, # comments) that '
                    'replaces the worker job of --cluster_spec and is read again every second: a '
                    'worker listed later joins at the next checkpoint.')
flags.DEFINE_integer('worker_intra_op_threads', 0,
                     "--job=worker: the server's intra-op threads (0: TensorFlow's default).")
flags.DEFINE_integer('worker_inter_op_threads', 0,
                     "--job=worker: the server's inter-op threads (0: TensorFlow's default).")
flags.DEFINE_float('worker_memory_log_secs', 0.0,
                   "--job=worker: if > 0, log the allocator's current bytes and its peak since "
                   'the last check this often (when they changed): a worker is one device with '
                   'its own allocator (tools/memory_curves.py --per_device reads it).')
flags.DEFINE_integer('num_cpu_devices', None,
                     'Logical CPU devices of a local run; default: worker_replicas x one per '
                     'pipeline stage of the model (4 if the params name no stages), or more '
                     "if a pipeline's own num_replicas needs more.")
flags.DEFINE_string('model_params_override', '',
                    "Params text applied to the model params: 'a.b : value' lines separated "
                    "by ';' or newlines, e.g. 'train.max_steps : 100; task.train.learning_rate "
                    ": 0.01'.")
flags.DEFINE_integer('max_steps', None,
                     'Shortcut for the override train.max_steps. An evaler without it stops '
                     "at its train.max_steps or the trainer's, whichever comes first.")
flags.DEFINE_integer('steps_per_loop', 1,
                     'Training steps per tf.function call (a device-side loop); summaries '
                     'and log lines come from the last step of a call.')
flags.DEFINE_integer('checkpoint_max_to_keep', 5, 'Recent checkpoints kept (at least 1).')
flags.DEFINE_integer('check_steps', 3, '--mode=check_pipeline: training steps to compare.')
flags.DEFINE_float('check_tolerance', 1e-4,
                   '--mode=check_pipeline: the largest relative difference that passes.')
flags.DEFINE_boolean('eval_once', False, 'Evalers: evaluate the latest checkpoint and exit.')
flags.DEFINE_float('eval_timeout_secs', None,
                   'Evalers: fail when no new checkpoint arrives for this many seconds before '
                   'train.max_steps is evaluated (the trainer died); default: wait forever.')
flags.DEFINE_integer('eval_batches', None, 'Evalers: at most this many batches per evaluation; '
                     'default the whole (finite) Dev/Test dataset.')
flags.DEFINE_string('balance_file', '',
                    'A balance plan (tools/plan_balance.py) that cuts the pipelines of the model '
                    'into its stages, replacing their splits, with the M, schedule and remat '
                    'it was made for (an override that sets another one, or another cut, is '
                    'an error).')
flags.DEFINE_integer('pipeline_stats_every', 0,
                     'Every N steps, time the pipeline schedule steps of one training step and '
                     'write pipeline/bubble_fraction (measured, simulated, theory) and per-stage '
                     'busy and idle seconds to TensorBoard, and a Chrome trace '
                     '<logdir>/train/pipeline_trace_<step>.json. 0: off (no timing ops).')

# -- flags -> configuration ------------------------------------------------------------


def _CheckNumberFlags() -> None:
  """Raises UserError naming a number flag the command line set to NaN, an infinity or an
  integer beyond 64 bits: no timeout, tolerance or count means that."""
  for name in FLAGS:
    flag = FLAGS[name]
    if not flag.present or flag.value is None or flag.flag_type() not in ('int', 'float'):
      continue
    if flag.flag_type() == 'float' and not math.isfinite(flag.value):
      raise errors.UserError(f'--{name} must be a finite number, got {flag.value}.')
    if flag.flag_type() == 'int' and not -2**63 <= flag.value < 2**63:
      raise errors.UserError(f'--{name}={flag.value} is beyond the 64-bit integer range.')


def _CheckFlagsAtLeast(minimum: int, *names: str) -> None:
  """Raises UserError naming the first of the integer flags `names` below `minimum`."""
  for name in names:
    value = FLAGS[name].value
    if value is not None and value < minimum:
      raise errors.UserError(f'--{name} must be >= {minimum}, got {value}.')


@dataclasses.dataclass(frozen=True)
class ClusterConfig:
  """Which job and task this process is, in which cluster, and how pipelines use its devices."""
  job: str
  task: int
  spec: dict[str, list[str]]
  worker_split_size: int | None
  worker_replicas: int
  timeout_secs: float

  @classmethod
  def FromFlags(cls) -> 'ClusterConfig':
    """From the flags; with no --cluster_spec, cluster jobs take TF_CONFIG's cluster and task."""
    spec, task, source = cluster_lib.ParseClusterSpec(FLAGS.cluster_spec), FLAGS.task, (
        '--cluster_spec')
    uses_cluster = FLAGS.job in _CLUSTER_JOBS + _CLIENT_JOBS
    if not spec and uses_cluster and os.environ.get('TF_CONFIG'):
      spec, tf_config_task = cluster_lib.ParseTfConfig(os.environ['TF_CONFIG'])
      source = 'TF_CONFIG'
      if tf_config_task is not None and not FLAGS['task'].present:
        task = tf_config_task
    if task < 0:
      raise errors.UserError(f'--task must be >= 0, got {task}.')
    job_name = FLAGS.job.split(',')[-1]
    if job_name in spec and task >= len(spec[job_name]):
      raise errors.UserError(f'--task={task} but {source} lists {len(spec[job_name])} '
                                  f'{job_name} task(s).')
    if FLAGS['task'].present and task and job_name not in spec:
      raise errors.UserError(
          f'--task={task} picks a process of its job in the cluster spec, and --job={FLAGS.job} '
          f'is not a job of {"it: " + ", ".join(spec) if spec else "any (none given)"}; drop '
          '--task.')
    if spec and not uses_cluster:
      raise errors.UserError(
          f'--cluster_spec is for --job=trainer_client, worker and the evalers; --job={FLAGS.job} '
          'trains in this process: drop --cluster_spec, or use --job=trainer_client.')
    if (FLAGS.job in _CLUSTER_JOBS and cluster_lib.WORKER_JOB not in spec and
        not (FLAGS.elastic and FLAGS.elastic_workers_file)):
      raise errors.UserError(
          f'--job={FLAGS.job} needs a cluster with a {cluster_lib.WORKER_JOB} job: '
          f'--cluster_spec={cluster_lib.WORKER_JOB}=host:port,host:port or TF_CONFIG; got '
          f'{spec or "none"}.')
    _CheckFlagsAtLeast(1, 'worker_split_size', 'num_cpu_devices', 'worker_replicas',
                       'gpu_split_mb')
    _CheckFlagsAtLeast(0, 'worker_intra_op_threads', 'worker_inter_op_threads')
    if FLAGS.worker_timeout_secs <= 0:
      raise errors.UserError(
          f'--worker_timeout_secs must be > 0, got {FLAGS.worker_timeout_secs:g}.')
    return cls(FLAGS.job, task, spec, FLAGS.worker_split_size, FLAGS.worker_replicas,
               FLAGS.worker_timeout_secs)


# -- jobs --------------------------------------------------------------------------------


def RunWorker(cluster: ClusterConfig) -> None:
  """Serves this process's devices as task cluster.task of the worker job, until killed."""
  if FLAGS.worker_memory_log_secs > 0:
    memory_stats.EnableStats()
  local_devices.ConfigureDevices(_DeviceSettings(), 1)
  config = cluster_lib.ServerConfig(FLAGS.worker_intra_op_threads, FLAGS.worker_inter_op_threads)
  server = cluster_lib.StartServer(cluster.spec, cluster_lib.WORKER_JOB, cluster.task, config)
  if FLAGS.worker_memory_log_secs > 0:
    memory_stats.LogForever(FLAGS.worker_memory_log_secs)
  server.join()


def RunClusterClient(model_params: hyperparams.Params, cluster: ClusterConfig,
                     dataset_name: str) -> None:
  """trainer_client or an evaler whose pipelines run on the cluster's workers.

  The job runs under a HealthMonitor: a worker that stops answering ends it
  with a WorkerUnavailableError naming the worker, instead of a hang.
  """
  addresses = cluster_lib.WorkerAddresses(cluster.spec)
  cluster_lib.WaitForWorkers(addresses, cluster.timeout_secs)

  def Job():
    cluster_lib.Connect(cluster.spec, cluster.timeout_secs)
    local_devices.PlacePipelines(model_params.task, cluster.worker_split_size,
                                 cluster.worker_replicas)
    if cluster.job == 'trainer_client':
      train_job.RunTrainer(model_params, FLAGS.logdir, _TrainSettings(),
                           cluster_lib.InputDevice(), stop)
    else:
      evaler.Run(model_params, FLAGS.logdir, dataset_name, _EvalSettings(), on_cluster=True,
                 decode=_Decodes())

  # Signal handlers can only be set here, in the main thread.
  with (preemption.StopOnSignals() if cluster.job == 'trainer_client' else
        contextlib.nullcontext()) as stop:
    cluster_lib.HealthMonitor(addresses, cluster.timeout_secs).Run(Job)


def _RunElastic(cluster: ClusterConfig) -> None:
  """--elastic: the client in child processes on the workers that answer (elastic.py)."""
  if FLAGS.job != 'trainer_client' or FLAGS.mode != 'sync':
    raise errors.UserError(f'--elastic is for --job=trainer_client; got --job={FLAGS.job} '
                           f'--mode={FLAGS.mode}.')
  if FLAGS.elastic_wait_secs < 0 or not math.isfinite(FLAGS.elastic_wait_secs):
    raise errors.UserError(f'--elastic_wait_secs must be a finite number >= 0, got '
                           f'{FLAGS.elastic_wait_secs:g}.')
  if not FLAGS.logdir:
    raise errors.UserError('--elastic restarts the client from its checkpoints: give --logdir.')
  if cluster.worker_replicas > 1 or cluster.worker_split_size:
    raise errors.UserError('--elastic cuts each pipeline into one stage per worker: drop '
                           '--worker_replicas and --worker_split_size.')
  supervisor = elastic.Supervisor(elastic.ChildArgs(sys.argv[1:]), cluster.spec,
                                  FLAGS.elastic_min_workers, FLAGS.elastic_wait_secs,
                                  cluster.timeout_secs, FLAGS.logdir, FLAGS.elastic_workers_file)
  code = supervisor.Run()
  if code:
    sys.exit(code)


def _ElasticCut(model_params: hyperparams.Params) -> None:
  """--elastic's child: the pipelines cut onto --elastic_stages workers (elastic.Replan)."""
  try:
    plan = balance_plan.LoadPlan(FLAGS.balance_file) if FLAGS.balance_file else None
    cuts = elastic.Replan(model_params, FLAGS.elastic_stages, plan,
                          base_runner.InputBatchSize(model_params),
                          base_runner.OverrideKeys(FLAGS.model_params_override))
  except ValueError as e:
    raise errors.UserError(f'--elastic: {e}') from None
  logging.info('Elastic: the pipelines cut onto %d worker(s): %s.', FLAGS.elastic_stages,
               '; '.join(cuts))


def _CheckPipeline(model_params: hyperparams.Params, cluster: ClusterConfig) -> None:
  """--mode=check_pipeline: the report on stdout; UserError (exit 1) if it fails."""
  if cluster.spec:
    raise errors.UserError('--mode=check_pipeline runs in this process: drop '
                                '--cluster_spec.')
  _SetUpLocalDevices(model_params, cluster)
  checkpoint_dir = os.path.join(FLAGS.logdir, 'train') if FLAGS.logdir else None
  report = pipeline_check.CheckPipeline(model_params, FLAGS.check_steps, FLAGS.check_tolerance,
                                        checkpoint_dir)
  sys.stdout.write(report.Text() + '\n')
  if not report.ok:
    raise errors.UserError(f'check_pipeline: {FLAGS.model} trains differently pipelined '
                                f'than unpipelined (tolerance {FLAGS.check_tolerance:g}).')


def _ListModels() -> None:
  """Prints every registry key with the first line of its params class's docstring."""
  try:
    keys = model_registry.GetAllRegisteredKeys()
  except (ImportError, ValueError) as e:
    raise errors.UserError(str(e)) from None
  width = max(map(len, keys), default=0)
  for key in keys:
    sys.stdout.write(f'{key:<{width}}  {model_registry.GetDescription(key)}\n')


def _Run() -> None:
  _CheckNumberFlags()
  if FLAGS.pipeline_stats_every and (FLAGS.mode != 'sync' or
                                     FLAGS.job not in ('controller,trainer', 'trainer_client')):
    raise errors.UserError(
        f'--pipeline_stats_every times training steps, and --mode={FLAGS.mode} '
        f'--job={FLAGS.job} trains none: drop it.')
  if FLAGS.mode == 'list_models':
    _ListModels()
    return
  cluster = ClusterConfig.FromFlags()
  if FLAGS.job == 'worker':
    RunWorker(cluster)
    return
  if FLAGS.elastic:
    _RunElastic(cluster)
    return
  if FLAGS.elastic_workers_file:
    raise errors.UserError('--elastic_workers_file lists the workers of --elastic: add --elastic '
                           '--job=trainer_client, or drop it.')
  if not FLAGS.model:
    raise errors.UserError('--model is required (a registry key such as '
                                'lm.synthetic.GPipeTransformerLmTiny).')
  _CheckFlagsAtLeast(0, 'max_steps', 'pipeline_stats_every')
  _CheckFlagsAtLeast(1, 'checkpoint_max_to_keep', 'eval_batches')
  dataset_name = {'dev': 'Dev', 'test': 'Test'}.get(FLAGS.job.split('_')[-1], 'Train')
  override = FLAGS.model_params_override
  if dataset_name != 'Train' and FLAGS.mode == 'sync' and FLAGS.logdir:
    override = evaler.WithTrainersSettings(FLAGS.logdir, FLAGS.model, override, dataset_name)
  elif FLAGS.mode == 'export_decoder' and FLAGS.logdir:  # The model as it was trained.
    override = evaler.WithTrainersSettings(FLAGS.logdir, FLAGS.model, override, 'Train',
                                           doing='Exporting')
  model_params = base_runner.LoadModelParams(FLAGS.model, dataset_name, override,
                                             FLAGS.max_steps)
  if not model_registry.GetClass(FLAGS.model).Defines(dataset_name):
    logging.warning('%s defines no %s(): evaluating its Train() data instead.', FLAGS.model,
                    dataset_name)
  if FLAGS.elastic_stages:
    _ElasticCut(model_params)
  elif FLAGS.balance_file:
    # The plan's M is the training batch's, also for an evaler (whose input is another).
    train_params = model_params if dataset_name == 'Train' else base_runner.LoadModelParams(
        FLAGS.model, 'Train', override)
    changes = base_runner.ApplyBalanceFile(model_params, FLAGS.balance_file,
                                           FLAGS.model_params_override,
                                           base_runner.InputBatchSize(train_params))
    if changes:
      logging.warning('--balance_file %s was planned for other settings; using its %s.',
                      FLAGS.balance_file, ', '.join(changes))
  if FLAGS.mode == 'inspect_params':
    sys.stdout.write(model_params.ToText())
    return
  if FLAGS.mode == 'check_pipeline':
    _CheckPipeline(model_params, cluster)
    return
  if not FLAGS.logdir:
    raise errors.UserError('--logdir is required.')
  try:
    checkpoint_files.CheckDirectoryName(FLAGS.logdir, '--logdir')
  except ValueError as e:
    raise errors.UserError(str(e)) from None
  if cluster.spec and FLAGS.mode == 'export_decoder':
    raise errors.UserError('--mode=export_decoder exports from this process\'s devices: '
                                'drop --cluster_spec.')
  if cluster.spec:
    RunClusterClient(model_params, cluster, dataset_name)
    return
  _SetUpLocalDevices(model_params, cluster)
  if FLAGS.mode == 'export_decoder':
    evaler.ExportDecoder(model_params, FLAGS.logdir, FLAGS.export_dir, FLAGS.model)
  elif FLAGS.job == 'controller,trainer':
    with preemption.StopOnSignals() as stop:
      train_job.RunTrainer(model_params, FLAGS.logdir, _TrainSettings(), stop=stop)
  else:
    evaler.Run(model_params, FLAGS.logdir, dataset_name, _EvalSettings(), decode=_Decodes())


def _Decodes() -> bool:
  return FLAGS.job.startswith('decoder_')


def _SetUpLocalDevices(model_params: hyperparams.Params, cluster: ClusterConfig) -> None:
  local_devices.SetUpLocalDevices(model_params, _DeviceSettings(), cluster.worker_split_size,
                                  cluster.worker_replicas)


def _DeviceSettings() -> local_devices.DeviceSettings:
  return local_devices.DeviceSettings(
      run_locally=FLAGS.run_locally, memory_growth=FLAGS.gpu_memory_growth,
      gpu_split_mb=FLAGS.gpu_split_mb, gpus=FLAGS.gpus, num_cpu_devices=FLAGS.num_cpu_devices)


def _TrainSettings() -> train_job.TrainSettings:
  return train_job.TrainSettings(steps_per_loop=FLAGS.steps_per_loop,
                                 checkpoint_max_to_keep=FLAGS.checkpoint_max_to_keep,
                                 pipeline_stats_every=FLAGS.pipeline_stats_every)


def _EvalSettings() -> evaler.EvalSettings:
  return evaler.EvalSettings(job=FLAGS.job, model=FLAGS.model, once=FLAGS.eval_once,
                             timeout_secs=FLAGS.eval_timeout_secs, batches=FLAGS.eval_batches,
                             max_steps_given=FLAGS.max_steps is not None)


def main(argv: list[str]) -> None:
  try:
    if len(argv) > 1:
      raise errors.UserError(f'unexpected argument(s) {" ".join(argv[1:])}: every '
                                  'setting is a --flag (--helpshort lists them).')
    _Run()
  except preemption.Interrupted as e:
    sys.stderr.write(f'trainer: {e}\n')
    sys.exit(128 + e.signum)
  except KeyboardInterrupt:  # Ctrl-C outside training: no traceback.
    sys.stderr.write('trainer: interrupted (SIGINT).\n')
    sys.exit(128 + signal.SIGINT)
  except errors.UserError as e:
    sys.stderr.write(f'trainer: error: {" ".join(str(e).split())}\n')
    if isinstance(e, cluster_lib.WorkerUnavailableError):
      # A TensorFlow call may still wait on the lost worker in the job's thread;
      # a normal exit would abort in it.
      sys.stderr.flush()
      run_lock.ReleaseHeld()
      os._exit(elastic.WORKER_LOST)  # pylint: disable=protected-access
    sys.exit(elastic.NO_FIT if isinstance(e, elastic.NoFitError) else 1)


def Main() -> None:
  """Console-script entry point."""
  binaries.Run(main)


if __name__ == '__main__':
  Main()
