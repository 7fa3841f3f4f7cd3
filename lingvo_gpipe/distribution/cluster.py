"""Pipelines across processes and machines on TensorFlow's distributed runtime.

Each worker process serves its devices with a tf.distribute.Server
(StartServer). A client, the trainer or an evaler, connects to the workers
(Connect) and places the pipelines' stages on their devices (PipelineDevices):
one tf.function call then runs training steps across all processes, and
activations go from worker to worker without passing through the client.

Cluster specs are Lingvo's text, 'worker=host:port,host:port@job2=host:port'
(ParseClusterSpec), or the TF_CONFIG environment variable's JSON,
{"cluster": {"worker": [...]}, "task": {"type": "worker", "index": 0}}.

TensorFlow's runtime reports a worker process that exits at once, but waits
without end for one that hangs or whose machine is gone. A client therefore
runs its job under a HealthMonitor, which asks every worker for its status
(WorkerService.GetStatus, the RPC TensorFlow's own master uses) with a
deadline, and fails the job with an error naming the worker's task and address.
"""

import concurrent.futures
import contextlib
import errno
import json
import os
import socket
import threading
import time

from absl import logging
import grpc
import tensorflow as tf

from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import errors

WORKER_JOB = 'worker'
_GET_STATUS = '/tensorflow.WorkerService/GetStatus'


class ClusterError(errors.UserError):
  """A bad cluster spec, a server that cannot start, too few devices."""


class WorkerUnavailableError(ClusterError):
  """A worker died, hangs or cannot be reached."""


# -- cluster specs -----------------------------------------------------------------------


def _CheckAddress(job, address, source):
  host, colon, port = address.rpartition(':')
  if not (colon and host and port.isdigit() and 0 < int(port) < 65536):
    raise ClusterError(f'{source}: address {address!r} of job {job!r} is not host:port.')


def ParseClusterSpec(text, source='--cluster_spec'):
  """Lingvo's 'job=host:port,host:port@job2=host:port' as {job: [address, ...]}; errors name
  `source`."""
  spec = {}
  for part in filter(None, (p.strip() for p in text.split('@'))):
    job, sep, hosts = part.partition('=')
    job, addresses = job.strip(), [a.strip() for a in hosts.split(',')]  # Spaces are fine.
    if not sep or not job or not hosts.strip():
      raise ClusterError(f'{source}: {part!r} is not job=host:port[,host:port].')
    if job in spec:
      raise ClusterError(f'{source}: job {job!r} appears twice.')
    for address in addresses:
      _CheckAddress(job, address, source)
    spec[job] = addresses
  return spec


def ParseTfConfig(text):
  """(spec, task index or None) of TF_CONFIG's JSON text."""
  try:
    config = json.loads(text)
  except json.JSONDecodeError as e:
    raise ClusterError(f'TF_CONFIG is not JSON: {e}') from None
  cluster = config.get('cluster') if isinstance(config, dict) else None
  if not isinstance(cluster, dict) or not cluster:
    raise ClusterError(f'TF_CONFIG has no "cluster" of job -> addresses: {text!r}.')
  spec = {}
  for job, addresses in cluster.items():
    if not (isinstance(addresses, list) and addresses and
            all(isinstance(a, str) for a in addresses)):
      raise ClusterError(f'TF_CONFIG: job {job!r} must list "host:port" strings, got '
                         f'{addresses!r}.')
    for address in addresses:
      _CheckAddress(job, address, 'TF_CONFIG')
    spec[job] = list(addresses)
  index = config.get('task', {}).get('index')
  if index is not None and not (isinstance(index, int) and index >= 0):
    raise ClusterError(f'TF_CONFIG: task index must be an int >= 0, got {index!r}.')
  return spec, index


def WorkerAddresses(spec):
  """The worker job's addresses, by task."""
  if WORKER_JOB not in spec:
    raise ClusterError(f'The cluster spec has no {WORKER_JOB!r} job: {spec}.')
  return list(spec[WORKER_JOB])


# -- workers -----------------------------------------------------------------------------


_MIN_INTER_OP_THREADS = 2


def ServerConfig(intra_op_threads=0, inter_op_threads=0):
  """A worker's ConfigProto, and the same thread pools for the work clients send it.

  0 threads: TensorFlow's default, except that a worker gets at least 2 inter-op
  threads. One intra-op thread pins a worker's kernels to one core, as when
  each process gets one core with taskset.

  The eager context a client opens on a worker, which runs the client's
  functions, does not take the server's ConfigProto: its pools take their sizes
  from TF_NUM_INTRAOP_THREADS / TF_NUM_INTEROP_THREADS, else from the cores the
  process may use. So this sets those variables in this worker process. A
  worker pinned to one core would otherwise get one inter-op thread, which runs
  a chain of kernels to its end before it serves another worker's request for
  a tensor: each pipeline hand-over would then wait for the sending stage's
  whole run of steps, and the stages would run one after the other.
  """
  if inter_op_threads == 0 and len(os.sched_getaffinity(0)) < _MIN_INTER_OP_THREADS:
    inter_op_threads = _MIN_INTER_OP_THREADS
    logging.info('One core to run on: %d inter-op threads, so that tensors are handed over '
                 'while a kernel runs.', inter_op_threads)
  for name, threads in (('TF_NUM_INTRAOP_THREADS', intra_op_threads),
                        ('TF_NUM_INTEROP_THREADS', inter_op_threads)):
    if threads:
      os.environ[name] = str(threads)
  return tf.compat.v1.ConfigProto(intra_op_parallelism_threads=intra_op_threads,
                                  inter_op_parallelism_threads=inter_op_threads)


def _PortInUse(port):
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(('', port))
    except OSError as e:
      return e.errno == errno.EADDRINUSE
  return False


def StartServer(spec, job, task, config=None):
  """Starts this process's server as task `task` of `job`; returns the tf.distribute.Server.

  TensorFlow's gRPC server listens on every interface at the address's port
  (its C++ binds 0.0.0.0 and [::]; no API binds another address) and
  authenticates no one: the start line says so (docs/cluster.md: Security).
  """
  if job not in spec:
    raise ClusterError(f'The cluster spec has no {job!r} job: {spec}.')
  if not 0 <= task < len(spec[job]):
    raise ClusterError(f'Task {task} is not in the {len(spec[job])} task(s) of job {job!r}: '
                       f'{spec[job]}.')
  address = spec[job][task]
  port = int(address.rpartition(':')[2])
  try:
    server = tf.distribute.Server(tf.train.ClusterSpec(spec), job_name=job, task_index=task,
                                  config=config, start=True)
  except tf.errors.OpError as e:
    reason = f'port {port} is in use' if _PortInUse(port) else e.message
    raise ClusterError(f'Cannot start {job} task {task} at {address}: {reason}.') from None
  logging.warning('%s task %d (%s in the cluster spec) listens on port %d of %s, '
                  'unauthenticated: whoever reaches the port can run any op as this user, '
                  'reading and writing its files (docs/cluster.md: Security).', job, task, address,
                  port, ListeningInterfaces())
  return server


def ListeningInterfaces():
  """Where a server that binds 0.0.0.0 is reached, in words: every interface, or only
  loopback in a network namespace that has no other (tools/local_cluster.py
  --private_network)."""
  names = [name for _, name in socket.if_nameindex()]
  if names == ['lo']:
    return 'loopback only (this network namespace has no other interface)'
  return f'every interface ({", ".join(names)})'


# -- health ------------------------------------------------------------------------------


def _Describe(task, address, error, timeout_secs):
  """Why a worker failed a ping, as text naming its task and address."""
  if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
    reason = f'did not answer within {timeout_secs:g} s'
  else:
    reason = f'cannot be reached ({error.details()})'
  return f'{WORKER_JOB} task {task} ({address}) {reason}'


class _Pinger:
  """Status requests to TensorFlow servers, on one gRPC channel per address."""

  def __init__(self, addresses):
    self._addresses = list(addresses)
    self._channels = [grpc.insecure_channel(a) for a in self._addresses]
    self._calls = [c.unary_unary(_GET_STATUS) for c in self._channels]
    self._pool = concurrent.futures.ThreadPoolExecutor(max(1, len(self._addresses)),
                                                       thread_name_prefix='ping')

  def __enter__(self):
    return self

  def __exit__(self, *unused_exc_info):
    self._pool.shutdown(wait=False)
    for channel in self._channels:
      channel.close()

  def _PingOne(self, task, timeout_secs):
    try:
      self._calls[task](b'', timeout=timeout_secs)
    except grpc.RpcError as e:
      return _Describe(task, self._addresses[task], e, timeout_secs)
    return None

  def Failures(self, timeout_secs, tasks=None):
    """{task: description} of the workers that did not answer within timeout_secs."""
    tasks = range(len(self._addresses)) if tasks is None else tasks
    futures = {t: self._pool.submit(self._PingOne, t, timeout_secs) for t in tasks}
    results = {t: f.result() for t, f in futures.items()}
    return {t: text for t, text in results.items() if text is not None}


def _FailureText(failures):
  return '; '.join(failures[t] for t in sorted(failures))


def UnansweredWorkers(addresses, timeout_secs):
  """{task: description} of the workers that do not answer a status request in time."""
  with _Pinger(addresses) as pinger:
    return pinger.Failures(timeout_secs)


def WaitForWorkers(addresses, timeout_secs):
  """Returns once every worker answers; raises WorkerUnavailableError after timeout_secs."""
  deadline = time.time() + timeout_secs
  with _Pinger(addresses) as pinger:
    pending = range(len(addresses))
    while True:
      failures = pinger.Failures(min(1.0, timeout_secs), pending)
      if not failures:
        return
      if time.time() >= deadline:
        raise WorkerUnavailableError(
            f'Workers not ready after {timeout_secs:g} s: {_FailureText(failures)}. Start them '
            f'with --job={WORKER_JOB} --task=N and the same --cluster_spec.')
      pending = sorted(failures)
      time.sleep(0.2)


class HealthMonitor:
  """Runs a client's job while its workers answer; fails it in bounded time when one does not.

  The job runs in a separate thread, so a TensorFlow call stuck on a hung
  worker cannot block the error: the monitor raises WorkerUnavailableError
  within about interval_secs + timeout_secs of a worker's failure. A
  TensorFlow error of the job (a worker that exited) is reported the same way
  when a worker no longer answers.

  Args:
    addresses: the worker addresses, by task.
    timeout_secs: how long a worker may take to answer a status request.
    interval_secs: time between status requests.
  """

  def __init__(self, addresses, timeout_secs, interval_secs=1.0):
    self._addresses = list(addresses)
    self._timeout = timeout_secs
    self._interval = interval_secs

  def _Error(self, failures):
    return WorkerUnavailableError(
        f'Lost the cluster: {_FailureText(failures)}. Restart the worker(s), then the client: '
        'training resumes from the last checkpoint.')

  def Run(self, fn, *args, **kwargs):
    """fn(*args, **kwargs), or WorkerUnavailableError once a worker stops answering."""
    outcome = {}
    done = threading.Event()

    def Job():
      try:
        outcome['value'] = fn(*args, **kwargs)
      except BaseException as e:  # pylint: disable=broad-except
        outcome['error'] = e
      finally:
        done.set()

    with _Pinger(self._addresses) as pinger:
      threading.Thread(target=Job, name='cluster_job', daemon=True).start()
      while not done.wait(self._interval):
        failures = pinger.Failures(self._timeout)
        if failures and not done.is_set():
          raise self._Error(failures)
      error = outcome.get('error')
      if isinstance(error, tf.errors.OpError):
        failures = pinger.Failures(self._timeout)
        if failures:
          raise self._Error(failures) from error
      if isinstance(error, (tf.errors.AbortedError, tf.errors.UnavailableError)):
        # Every worker answers again: one restarted, and its state of this client is gone.
        raise WorkerUnavailableError(
            f'Lost the cluster: a worker restarted or dropped the connection while the job ran '
            f'({error.message.splitlines()[0][:200]}). Restart the client: training resumes '
            'from the last checkpoint.') from error
      if error is not None:
        raise error
      return outcome['value']


# -- the client --------------------------------------------------------------------------


def Connect(spec, timeout_secs):
  """Connects this process, as a client outside the spec, to the cluster's workers.

  Waits up to timeout_secs for every worker to answer. Only the worker job is
  connected: other jobs of a Lingvo spec (evalers, the client) serve nothing.
  """
  addresses = WorkerAddresses(spec)
  WaitForWorkers(addresses, timeout_secs)
  # The client is not in the spec: it must not be the master device default
  # (TensorFlow then looks for a master task that does not exist).
  tf.config.experimental_connect_to_cluster(
      tf.train.ClusterSpec({WORKER_JOB: addresses}), make_master_device_default=False)
  logging.info('Connected to %d worker(s): %s', len(addresses), ', '.join(addresses))


def PipelineDevices(num_stages, num_replicas=1, split_size=None):
  """The stage devices of R pipeline replicas, replica-major (R x K names).

  The available devices (a connected cluster's workers', by task) are cut
  into splits of split_size devices (default K); replica r runs its K stages
  on the first K devices of split r.
  """
  split = split_size or num_stages
  if split < num_stages:
    raise ClusterError(f'worker_split_size={split} devices per pipeline is fewer than the '
                       f'{num_stages} pipeline stages of the model.')
  available = list(devices_lib.Current().devices)
  if len(available) < split * num_replicas:
    raise ClusterError(
        f'{num_replicas} pipeline replica(s) x {split} devices need {split * num_replicas} '
        f'devices, but there are {len(available)}: {available}.')
  return [available[r * split + k] for r in range(num_replicas) for k in range(num_stages)]


def InputDevice():
  """The CPU of the first stage's task, where a client makes its batches.

  Every pipeline's first stage is on the first available device (split 0,
  replica 0), so batches made there do not cross the network each step.
  """
  first = tf.DeviceSpec.from_string(devices_lib.Current().devices[0])
  return first.replace(device_type='CPU', device_index=0).to_string()


def _DeviceOfInputs(op):
  if op.device:
    return op.device
  return next((x.device for x in op.inputs if x.device), '')


@contextlib.contextmanager
def ColocatedWithInputs():
  """While tracing: ops without a device run on the device of their first placed input.

  A pipeline places its cells' steps; glue ops (micro-batch splits and merges,
  loss gradients, gradient scaling) and a task's own ops carry no device, and
  would run on the client: each step's activations and gradients would cross
  to the client and back.
  """
  with tf.compat.v1.device(_DeviceOfInputs):
    yield
