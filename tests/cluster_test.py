"""Tests of pipelines across processes: specs, placement, health, and the trainer on a cluster.

Multi-process tests start worker processes on free loopback ports with
tools/local_cluster.py's LocalCluster, which a fixture stops however the test
ends, and compare with a run in one process on one device. Connecting to a
cluster changes a process's whole TensorFlow context, so clients run in
subprocesses: tests/testdata/cluster_client.py and the trainer binary.
"""

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.pipeline import pipeline_params
from lingvo_gpipe.runners import elastic
from lingvo_gpipe.runners import local_devices
from lingvo_gpipe.runners import trainer

_TESTS = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_TESTS)
_PARAMS_DIR = os.path.join(_TESTS, 'testdata', 'params')
_MODEL = 'toy.regression.PipelinedRegression'
_STEP_KEY = 'global_step/.ATTRIBUTES/VARIABLE_VALUE'


def _Import(name, path):
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


local_cluster = _Import('local_cluster', os.path.join(_ROOT, 'tools', 'local_cluster.py'))
cluster_client = _Import('cluster_client', os.path.join(_TESTS, 'testdata', 'cluster_client.py'))


def _Env():
  return dict(os.environ, LINGVO_GPIPE_PARAMS=_PARAMS_DIR, TF_CPP_MIN_LOG_LEVEL='2')


def _StartTrainer(*flags):
  return subprocess.Popen([sys.executable, '-m', 'lingvo_gpipe.runners.trainer'] + list(flags),
                          env=_Env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _Finish(proc, timeout=180):
  """(returncode, stderr) of a started process; kills it if it overruns."""
  try:
    _, err = proc.communicate(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    _, err = proc.communicate()
    pytest.fail(f'Process overran {timeout} s:\n{err[-3000:]}')
  return proc.returncode, err


def _Ok(proc):
  code, err = _Finish(proc)
  assert code == 0, err[-3000:]
  return err


def _ErrorLines(err):
  return [line for line in err.splitlines() if line.startswith('trainer: error:')]


def _ModelValues(path):
  reader = tf.train.load_checkpoint(path)
  return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()
          if k.startswith('model/')}


def _LatestStep(train_dir):
  latest = tf.train.latest_checkpoint(train_dir)
  return int(latest.rsplit('-', 1)[1]) if latest else 0


def _WaitForStep(train_dir, step, proc, timeout=120):
  deadline = time.time() + timeout
  while _LatestStep(train_dir) < step:
    if proc.poll() is not None:
      pytest.fail(f'The trainer exited early:\n{proc.communicate()[1][-3000:]}')
    if time.time() > deadline:
      pytest.fail(f'No checkpoint of step {step} after {timeout} s.')
    time.sleep(0.05)


# -- specs and flags ---------------------------------------------------------------------


def testParseClusterSpec():
  assert cluster_lib.ParseClusterSpec('') == {}
  assert cluster_lib.ParseClusterSpec('worker=h0:1,h1:2@evaler=h2:3') == {
      'worker': ['h0:1', 'h1:2'], 'evaler': ['h2:3']}
  assert cluster_lib.ParseClusterSpec(' worker = h0:1, h1:2 @ evaler=h2:3') == {
      'worker': ['h0:1', 'h1:2'], 'evaler': ['h2:3']}
  for bad in ('worker', 'worker=h0', 'worker=h0:x', 'worker=h0:1@worker=h1:2', '=h:1',
              'worker=h0:70000', 'worker= ', 'worker=h0:1,'):
    with pytest.raises(cluster_lib.ClusterError, match='--cluster_spec'):
      cluster_lib.ParseClusterSpec(bad)


def testParseTfConfig():
  text = '{"cluster": {"worker": ["h0:1", "h1:2"]}, "task": {"type": "worker", "index": 1}}'
  assert cluster_lib.ParseTfConfig(text) == ({'worker': ['h0:1', 'h1:2']}, 1)
  assert cluster_lib.ParseTfConfig('{"cluster": {"worker": ["h:1"]}}') == ({'worker': ['h:1']},
                                                                           None)
  for bad, message in [('{', 'TF_CONFIG is not JSON'),
                       ('{"task": {}}', 'TF_CONFIG has no "cluster"'),
                       ('{"cluster": {"worker": "h:1"}}', "job 'worker' must list"),
                       ('{"cluster": {"worker": ["h"]}}', "address 'h' of job 'worker'"),
                       ('{"cluster": {"worker": ["h:1"]}, "task": {"index": -1}}',
                        'task index must be an int >= 0, got -1')]:
    with pytest.raises(cluster_lib.ClusterError, match=re.escape(message)):
      cluster_lib.ParseTfConfig(bad)


def _ClusterConfig(*argv):
  trainer.FLAGS.unparse_flags()
  trainer.FLAGS(['trainer'] + list(argv))
  try:
    return trainer.ClusterConfig.FromFlags()
  finally:
    trainer.FLAGS.unparse_flags()


def testTfConfigGivesTheClusterAndTaskUnlessFlagsDo(monkeypatch):
  monkeypatch.setenv('TF_CONFIG', '{"cluster": {"worker": ["h0:1", "h1:2"]}, '
                                  '"task": {"type": "worker", "index": 1}}')
  config = _ClusterConfig('--job=worker')
  assert config.spec == {'worker': ['h0:1', 'h1:2']} and config.task == 1
  assert _ClusterConfig('--job=worker', '--task=0').task == 0
  assert _ClusterConfig('--job=worker', '--cluster_spec=worker=h:9').spec == {'worker': ['h:9']}
  assert _ClusterConfig('--job=controller,trainer').spec == {}  # Local training ignores it.
  with pytest.raises(errors.UserError,
                     match=re.escape('--worker_replicas must be >= 1, got 0.')):
    _ClusterConfig('--job=trainer_client', '--worker_replicas=0')


def testPipelineDevicesAreReplicaMajorSplits(monkeypatch):
  names = [f'/job:worker/replica:0/task:{t}/device:CPU:0' for t in range(6)]
  monkeypatch.setattr(devices_lib, 'Current', lambda: devices_lib.Topology('CPU', tuple(names)))
  assert cluster_lib.PipelineDevices(2) == names[:2]
  assert cluster_lib.PipelineDevices(2, num_replicas=2) == names[:4]
  assert cluster_lib.PipelineDevices(2, 2, split_size=3) == [names[0], names[1], names[3],
                                                             names[4]]
  with pytest.raises(cluster_lib.ClusterError, match='worker_split_size=1 devices per pipeline '
                     'is fewer than the 2 pipeline stages'):
    cluster_lib.PipelineDevices(2, split_size=1)
  with pytest.raises(cluster_lib.ClusterError, match=r'3 pipeline replica\(s\) x 3 devices '
                     'need 9 devices, but there are 6'):
    cluster_lib.PipelineDevices(3, 3)


def testWorkerReplicasAndSplitSizeReachTheModelsPipelines(monkeypatch):
  names = [f'/job:worker/replica:0/task:{t}/device:CPU:0' for t in range(6)]
  monkeypatch.setattr(devices_lib, 'Current', lambda: devices_lib.Topology('CPU', tuple(names)))
  params = trainer.base_runner.LoadModelParams('lm.synthetic.GPipeTransformerLmTiny', 'Train')
  stack = params.task.stack
  stages = pipeline_params.MaxStages(params.task)
  local_devices.PlacePipelines(params.task, split_size=3, replicas=2)
  assert stack.num_replicas == 2
  assert stack.devices == names[:stages] + names[3:3 + stages]


def testUnplacedOpsFollowTheirInputs():
  @tf.function(autograph=False)
  def Fn():
    with cluster_lib.ColocatedWithInputs():
      with tf.device('/device:CPU:1'):
        x = tf.random.stateless_normal([2], [1, 2], name='x')
      doubled = tf.multiply(x, 2.0, name='doubled')
      with tf.device('/device:CPU:2'):
        pinned = tf.add(doubled, 1.0, name='pinned')
      summed = tf.reduce_sum(pinned, name='summed')
      return summed, tf.timestamp(name='no_inputs')

  graph = Fn.get_concrete_function().graph
  devices = {name: graph.get_operation_by_name(name).device
             for name in ('doubled', 'pinned', 'summed', 'no_inputs')}
  assert devices == {'doubled': '/device:CPU:1', 'pinned': '/device:CPU:2',
                     'summed': '/device:CPU:2', 'no_inputs': ''}


# -- health ------------------------------------------------------------------------------


@pytest.mark.slow
def testAJobFailingOnARestartedWorkerIsALostClusterError(two_workers):
  """A worker restarted while the client ran answers again, but the client's state on it is
  gone: the job's TensorFlow error (seen in a checkpoint save) becomes a one-line error."""

  def Job():
    raise tf.errors.AbortedError(None, None, 'Unable to find a context_id matching the '
                                 'specified one (4816). Perhaps the worker was restarted?\nmore')

  with pytest.raises(cluster_lib.WorkerUnavailableError) as info:
    cluster_lib.HealthMonitor(two_workers.addresses, timeout_secs=4.0).Run(Job)
  assert str(info.value) == (
      'Lost the cluster: a worker restarted or dropped the connection while the job ran (Unable '
      'to find a context_id matching the specified one (4816). Perhaps the worker was '
      'restarted?). Restart the client: training resumes from the last checkpoint.')
  assert cluster_lib.HealthMonitor(two_workers.addresses, 4.0).Run(lambda: 7) == 7


def testMonitorFailsAJobWhoseWorkersAreSilentOrGone():
  silent = socket.socket()  # Accepts connections (the kernel does) but never answers.
  silent.bind(('127.0.0.1', 0))
  silent.listen()
  try:
    addresses = [f'127.0.0.1:{silent.getsockname()[1]}',
                 f'127.0.0.1:{local_cluster.FreePorts(1)[0]}']
    failures = cluster_lib.UnansweredWorkers(addresses, 1.0)
    assert failures[0] == f'worker task 0 ({addresses[0]}) did not answer within 1 s'
    assert failures[1].startswith(f'worker task 1 ({addresses[1]}) cannot be reached (')
    start = time.time()
    with pytest.raises(cluster_lib.WorkerUnavailableError) as info:
      cluster_lib.HealthMonitor(addresses, timeout_secs=1.0, interval_secs=0.2).Run(
          time.sleep, 60)
    assert time.time() - start < 10
    assert str(info.value).startswith(f'Lost the cluster: {failures[0]}; {failures[1][:40]}')
    with pytest.raises(cluster_lib.WorkerUnavailableError,
                       match=re.escape(f'Workers not ready after 1 s: {failures[0]}')):
      cluster_lib.WaitForWorkers(addresses, 1.0)
  finally:
    silent.close()


def testServerConfigGivesClientContextsTheWorkerThreadsAndTwoInterOpOnOneCore():
  """The eager context a client opens on a worker sizes its pools from the environment."""
  code = ('import json, os\n'
          'from lingvo_gpipe.distribution import cluster\n'
          'config = cluster.ServerConfig(*json.loads(os.environ["THREADS"]))\n'
          'print(config.intra_op_parallelism_threads, config.inter_op_parallelism_threads,\n'
          '      os.environ.get("TF_NUM_INTRAOP_THREADS"),'
          ' os.environ.get("TF_NUM_INTEROP_THREADS"))\n')

  def Run(threads, cpus):
    env = dict(_Env(), THREADS=json.dumps(threads))
    env.pop('TF_NUM_INTRAOP_THREADS', None)
    env.pop('TF_NUM_INTEROP_THREADS', None)
    out = subprocess.run(['taskset', '-c', cpus, sys.executable, '-c', code], env=env,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    return out.split()

  assert Run([1, 0], '0') == ['1', '2', '1', '2']  # One core: still 2 inter-op threads.
  assert Run([0, 3], '0') == ['0', '3', 'None', '3']
  assert Run([0, 0], '0,1') == ['0', '0', 'None', 'None']  # Two cores: TensorFlow's default.


def testWorkerOnAPortInUseIsAOneLineError():
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', 0))
    taken.listen()
    port = taken.getsockname()[1]
    code, err = _Finish(_StartTrainer('--job=worker', f'--cluster_spec=worker=localhost:{port}'),
                        timeout=60)
  assert code == 1 and _ErrorLines(err) == [
      f'trainer: error: Cannot start worker task 0 at localhost:{port}: port {port} is in use.']


def testLocalClusterToolPrintsTheSpecAndStopsItsWorkersOnSigterm(tmp_path):
  spec_file = tmp_path / 'spec.txt'
  tool = subprocess.Popen([sys.executable, os.path.join(_ROOT, 'tools', 'local_cluster.py'),
                           '--num_workers=1', f'--spec_file={spec_file}'], env=_Env(),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    spec_text = tool.stdout.readline().strip()
    spec = cluster_lib.ParseClusterSpec(spec_text)
    assert not cluster_lib.UnansweredWorkers(spec['worker'], 5.0)
    assert spec_file.read_text() == spec_text + '\n'  # Written before the spec is printed.
    tool.send_signal(signal.SIGTERM)
    assert _Finish(tool, timeout=60)[0] == 128 + signal.SIGTERM
    assert 'cannot be reached' in cluster_lib.UnansweredWorkers(spec['worker'], 5.0)[0]
    assert not spec_file.exists()
  finally:
    tool.kill()


_PRIVATE_CLIENT = """
import os, sys, time
from lingvo_gpipe.distribution import cluster
spec_text = sys.argv[-1].split('=', 1)[1]
assert not cluster.UnansweredWorkers(cluster.ParseClusterSpec(spec_text)['worker'], 5.0)
open(os.path.join(sys.argv[1], 'inside.partial'), 'w').write(spec_text)
os.rename(os.path.join(sys.argv[1], 'inside.partial'), os.path.join(sys.argv[1], 'inside'))
deadline = time.time() + 60
while not os.path.exists(os.path.join(sys.argv[1], 'done')) and time.time() < deadline:
  time.sleep(0.1)
sys.exit(7)
"""


def testAPrivateNetworkKeepsTheWorkersFromEveryoneOutsideIt(tmp_path):
  """--private_network: the command after `--` reaches the workers, this process (outside
  their network namespace) cannot, the workers' start line says loopback only, and the
  tool exits with the command's code."""
  if subprocess.run(['unshare', '--user', '--map-root-user', '--net', 'true'],
                    capture_output=True, check=False).returncode:
    pytest.skip('this machine allows no unprivileged user and network namespaces')
  tool = subprocess.Popen(
      [sys.executable, os.path.join(_ROOT, 'tools', 'local_cluster.py'), '--num_workers=2',
       '--private_network', f'--worker_log_dir={tmp_path}', '--', sys.executable, '-c',
       _PRIVATE_CLIENT, str(tmp_path)], env=_Env(), stdout=subprocess.PIPE,
      stderr=subprocess.PIPE, text=True)
  try:
    deadline = time.time() + 120
    while not (tmp_path / 'inside').exists() and tool.poll() is None and time.time() < deadline:
      time.sleep(0.2)
    addresses = cluster_lib.ParseClusterSpec((tmp_path / 'inside').read_text())['worker']
    for address in addresses:
      with pytest.raises(ConnectionRefusedError):
        socket.create_connection(('127.0.0.1', int(address.rpartition(':')[2])), timeout=5)
    (tmp_path / 'done').write_text('')
    code, err = _Finish(tool, timeout=60)
    assert code == 7, err
  finally:
    tool.kill()
  log = (tmp_path / 'worker0.log').read_text()
  assert 'listens on port' in log and 'of loopback only' in log and 'unauthenticated' in log


def testAPrivateNetworkNeedsACommand():
  code, err = _Finish(subprocess.Popen(
      [sys.executable, os.path.join(_ROOT, 'tools', 'local_cluster.py'), '--private_network'],
      env=_Env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), timeout=60)
  assert code == 1 and 'give the command that uses the workers after `--`' in err


# -- pipelines on workers ----------------------------------------------------------------


@pytest.fixture(scope='module')
def four_workers():
  with local_cluster.LocalCluster(4) as workers:
    yield workers


@pytest.mark.slow
def testPipelinesOnWorkersEqualOneDevice(four_workers, tmp_path):
  layouts = ['2x1', '3x1', '2x2']
  proc = subprocess.Popen(
      [sys.executable, os.path.join(_TESTS, 'testdata', 'cluster_client.py'),
       f'--workers={four_workers.spec_text}', f'--layouts={",".join(layouts)}',
       f'--out_dir={tmp_path}'], env=_Env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
      text=True)
  _Ok(proc)
  for layout in layouts:
    stages, replicas = map(int, layout.split('x'))
    got = np.load(tmp_path / f'{layout}.npz')
    workers = [f'/job:worker/replica:0/task:{t}/device:CPU:0' for t in range(stages * replicas)]
    assert list(got['stage_devices']) == workers, layout
    # Weights on replica 0's stages, in order; every placed op of the step on a worker.
    for name, device in zip(got['grad_names'], got['variable_devices']):
      stage = int(re.search(r'proj(\d+)', name).group(1))
      assert device == workers[stage], (layout, name, device)
    assert set(got['op_devices']) == set(workers), (layout, got['op_devices'])

    one_device = cluster_client.MakePipeline(stages, 1, ['/device:CPU:0'] * stages,
                                             num_micro_batches=1)
    loss, grads, _ = cluster_client.LossAndGradients(one_device)
    np.testing.assert_allclose(got['loss'], loss, rtol=1e-5, err_msg=layout)
    assert list(got['grad_names']) == list(grads), layout
    for i, (name, grad) in enumerate(grads.items()):
      np.testing.assert_allclose(got[f'grad_{i}'], grad, rtol=1e-5, atol=1e-6,
                                 err_msg=f'{layout} {name}')


@pytest.fixture
def two_workers(tmp_path):
  with local_cluster.LocalCluster(2, log_dir=str(tmp_path)) as workers:
    yield workers


@pytest.mark.slow
def testTrainerClientFailsFastOnALostWorkerAndResumes(two_workers, tmp_path):
  logdir, straight = str(tmp_path / 'log'), str(tmp_path / 'straight')
  train_dir = os.path.join(logdir, 'train')
  timeout = 4.0
  client = ['--job=trainer_client', f'--cluster_spec={two_workers.spec_text}', f'--model={_MODEL}',
            f'--logdir={logdir}', f'--worker_timeout_secs={timeout:g}',
            '--model_params_override=train.save_interval_steps : 1; '
            'train.log_interval_steps : 1000']

  def LoseWorker(task, sig, expected):
    """Trains until two more checkpoints exist, then `sig` to worker `task`: a one-line error."""
    proc = _StartTrainer(*client, '--max_steps=1000000')
    _WaitForStep(train_dir, _LatestStep(train_dir) + 2, proc)
    lost = time.time()
    two_workers.KillWorker(task, sig)
    code, err = _Finish(proc, timeout=60)
    assert time.time() - lost < timeout + 10
    assert code == elastic.WORKER_LOST and len(_ErrorLines(err)) == 1, err[-3000:]
    assert f'Lost the cluster: worker task {task} ({two_workers.addresses[task]}) {expected}' in (
        _ErrorLines(err)[0])
    # The client exits at once (os._exit, a TensorFlow call may still wait): without its lock.
    assert not os.path.exists(os.path.join(train_dir, 'trainer.lock'))
    two_workers.KillWorker(task)  # Also ends a stopped worker.
    two_workers.StartWorker(task)
    two_workers.WaitUntilReady()
    return err

  LoseWorker(1, signal.SIGKILL, 'cannot be reached')
  err = LoseWorker(0, signal.SIGSTOP, f'did not answer within {timeout:g} s')
  assert 'Restored' in err  # The second client resumed.

  step = _LatestStep(train_dir)
  uninterrupted = _StartTrainer(f'--model={_MODEL}', f'--logdir={straight}',
                                f'--max_steps={step + 2}')
  err = _Ok(_StartTrainer(*client, f'--max_steps={step + 2}'))
  assert f'(global step {step})' in err and f'Trained to step {step + 2}.' in err
  _Ok(uninterrupted)
  resumed = _ModelValues(tf.train.latest_checkpoint(train_dir))
  expected = _ModelValues(tf.train.latest_checkpoint(os.path.join(straight, 'train')))
  assert sorted(resumed) == sorted(expected) and len(resumed) == 4
  for name, value in expected.items():
    np.testing.assert_allclose(resumed[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
  assert os.listdir(train_dir).count('params.txt') == 1
  assert any(name.startswith('events.out.tfevents') for name in os.listdir(train_dir))

  # The evaler on the cluster and the local one agree on the same weights.
  evals = [_StartTrainer(f'--model={_MODEL}', f'--logdir={d}', '--job=evaler_test',
                         '--eval_once', *flags)
           for d, flags in ((logdir, [f'--cluster_spec={two_workers.spec_text}']),
                            (straight, []))]
  lines = [re.search(r'eval_test step (\d+) \(3 batches\): abs_error (\S+)  loss (\S+)',
                     _Ok(proc)) for proc in evals]
  assert all(lines), lines
  assert lines[0].group(1) == lines[1].group(1) == str(step + 2)
  np.testing.assert_allclose([float(lines[0].group(3))], [float(lines[1].group(3))], rtol=1e-5)


def testEachLocalWorkerUsesItsOwnGpuWhereThereAreGpus(tmp_path):
  """Workers on one host would each take every GPU; worker i gets GPU i mod their count."""
  def Gpus(**kwargs):
    cluster = local_cluster.LocalCluster(3, log_dir=str(tmp_path), **kwargs)
    return [[a for a in cluster.Command(t) if a.startswith('--gpus')] for t in range(3)]

  assert Gpus(num_gpus=2) == [['--gpus=0'], ['--gpus=1'], ['--gpus=0']]
  assert Gpus() == [[], [], []]  # This machine has none.
  command = local_cluster.LocalCluster(2, cpus=[1, 0], log_dir=str(tmp_path),
                                       num_gpus=1).Command(1)
  assert command[:3] == ['taskset', '-c', '0'] and command[-1] == '--gpus=0'


@pytest.mark.slow
def testADecoderJobOnTheClusterDecodesAsOneProcess(two_workers, tmp_path):
  """--job=decoder_dev with --cluster_spec runs the LM's stages on the workers and writes
  the decodes that the same job writes in one process."""
  lm = 'lm.synthetic.GPipeTransformerLmTiny'
  local, remote = tmp_path / 'local', tmp_path / 'remote'
  _Ok(_StartTrainer(f'--model={lm}', f'--logdir={local}', '--max_steps=20'))
  shutil.copytree(local, remote)
  decoder = [f'--model={lm}', '--job=decoder_dev', '--eval_once']
  _Ok(_StartTrainer(*decoder, f'--logdir={local}'))
  err = _Ok(_StartTrainer(*decoder, f'--logdir={remote}',
                          f'--cluster_spec={two_workers.spec_text}'))
  assert 'Connected to 2 worker(s)' in err
  decodes = [(d / 'decoder_dev' / 'decodes-20.txt').read_text() for d in (local, remote)]
  assert decodes[0] == decodes[1] and len(decodes[0].splitlines()) > 1
  rows = [line.split('\t') for line in decodes[0].splitlines()[1:]]
  assert all(len(row) == 4 for row in rows) and any(row[2] for row in rows)
