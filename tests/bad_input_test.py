"""The trainer on 80-odd bad command lines: each is one error line and exit 1, writes nothing,
and neither hangs nor prints a traceback.

The cases run in one subprocess (tests/testdata/bad_inputs.py: the binary's main, in
process, one after another); `pytest -s` prints the table of outcomes.
"""

import json
import os
import re
import subprocess
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
_TOY = '--model=toy.regression.PipelinedRegression'
_LM = '--model=lm.synthetic.GPipeTransformerLmTiny'
_LOG = '--logdir={work}/log'
_DEEP = '-' * 5000 + '1'


def _Toy(override):
  return [_TOY, _LOG, f'--model_params_override={override}']


def _Lm(override):
  return [_LM, _LOG, f'--model_params_override={override}']


_OVERRIDES = [
    # Values that would import or call code.
    'input.cls : os.system', 'input.cls : os.path.join', 'input.cls : collections.OrderedDict',
    'task.cls : lingvo_gpipe.training.optimizer.Adam', 'task.train.optimizer.cls : os.system',
    'task.train.optimizer.cls : lingvo_gpipe.layers.ProjectionLayer',
    'task.hidden_dim : stray_module.Thing', 'task.hidden_dim : __import__("os")',
    'task.hidden_dim : (lambda: 1)()', 'task.hidden_dim : os.sep',
    # Groups and types.
    'train : 5', 'input : None', 'task : None', 'task.train : {}', 'random_seed : {1: 2}',
    'task.random_seed : 1.5', 'input.batch_size : 2.5', "input.batch_size : 'x'",
    'train.max_steps : 1e3', 'task.hidden_dim : 1e999', 'task.hidden_dim : True',
    # Numbers out of range.
    'input.batch_size : 99999999999999999999', 'input.batch_size : -3', 'input.batch_size : 0',
    'input.batch_size : nan', 'input.prefetch_batches : -5', 'input.input_dim : 0',
    'input.num_batches : 0', 'input.num_batches : -1',
    'task.train.learning_rate : 1e999', 'task.train.learning_rate : nan',
    'task.train.learning_rate : -inf', 'task.train.clip_gradient_norm_to_value : -1',
    'task.train.clip_gradient_norm_to_value : nan', 'task.train.optimizer.beta1 : 1.5',
    'task.train.optimizer.epsilon : -1', 'train.max_steps : -5',
    'train.save_interval_steps : -1', 'train.summary_interval_steps : -1',
    'train.log_interval_steps : -1', 'task.hidden_dim : -1', 'task.hidden_dim : 0',
    'task.hidden_dim : 99999999999999999999', 'task.num_micro_batches : 0',
    'task.num_micro_batches : -2', 'task.num_micro_batches : 9',
    # Text that is not params text.
    'task.nonexistent : 3', 'garbage without a colon', 'task.hidden_dim :', ': 5',
    'task..hidden_dim : 3', 'task.hidden_dim[0] : 3', 'task.hidden_dim : [1',
    f'task.hidden_dim : {_DEEP}', 'task.hidden_dim : ' + '[' * 5000,
]
_LM_OVERRIDES = [
    'task.stack.num_heads : 3', 'input.seq_len : 0', 'input.vocab_size : 1',
    "task.stack.schedule : 'nonsense'", "task.stack.remat : 'sometimes'",
    "task.stack.devices : ['/device:CPU:99', '/device:CPU:0']", 'task.stack.model_dim : 0',
    'task.stack.num_decoder_layers : 0', 'task.stack.dropout_prob : 1.5',
    'task.stack.label_smoothing : -0.5', 'task.stack.micro_batch_size : 0',
]
_FLAGS = [
    ['--max_steps=-1'], ['--max_steps=99999999999999999999'], ['--max_steps=abc'],
    ['--max_steps='], ['--steps_per_loop=0'], ['--checkpoint_max_to_keep=0'],
    ['--num_cpu_devices=0'], ['--num_cpu_devices=1'], ['--worker_replicas=0'],
    ['--worker_split_size=0'], ['--pipeline_stats_every=-1'], ['--task=-1'], ['--task=3'],
    ['--job=nonsense'], ['--mode=nonsense'], ['--run_locally=tpu'], ['--nonexistent_flag=1'],
    ['stray'], ['--balance_file=/nonexistent/plan.json'], ['--balance_file=/etc/hostname'],
    ['--worker_memory_log_secs=nan'], ['--gpus=a'], ['--gpu_split_mb=0'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--worker_timeout_secs=nan'],
    ['--elastic'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--elastic',
     '--worker_replicas=2'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--elastic',
     '--elastic_min_workers=2'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--elastic',
     '--elastic_wait_secs=nan'],
    ['--job=trainer_client', '--elastic', '--elastic_workers_file=/nonexistent/workers.txt'],
    ['--job=trainer_client', '--elastic', '--elastic_workers_file=/etc/hostname'],
    ['--elastic_workers_file=/etc/hostname'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--worker_timeout_secs=inf'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:1', '--worker_timeout_secs=-1'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost'],
    ['--job=trainer_client', '--cluster_spec=garbage'],
    ['--job=trainer_client', '--cluster_spec=worker=localhost:99999'],
    ['--cluster_spec=worker=localhost:2222'],
    ['--job=evaler_dev', '--eval_timeout_secs=nan'],
    ['--job=evaler_dev', '--eval_timeout_secs=inf'],
    ['--job=evaler_dev', '--eval_timeout_secs=-1'], ['--job=evaler_dev', '--eval_batches=0'],
    ['--job=evaler_dev', '--pipeline_stats_every=5'],
    ['--mode=check_pipeline', '--check_tolerance=nan'],
    ['--mode=check_pipeline', '--check_steps=0'],
]
_WITHOUT_LOGDIR = [
    [_TOY], ['--model=no.such.Model', _LOG], ['--model=', _LOG], [_LOG],
    [_TOY, '--logdir={work}/runs/exp[1]'], [_TOY, '--logdir={work}/with*star'],
    [_TOY, '--logdir=/dev/null/log'], [_TOY, '--logdir='], ['--job=worker'],
]
CASES = ([(o, _Toy(o)) for o in _OVERRIDES] + [(o, _Lm(o)) for o in _LM_OVERRIDES] +
         [(' '.join(f), [_TOY, _LOG] + f) for f in _FLAGS] +
         [(' '.join(f), f) for f in _WITHOUT_LOGDIR])
# Lines of a log record (absl's, TensorFlow's C++), not what the binary says to its user.
_LOG_RECORD = re.compile(r'^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ |^WARNING: All log messages before')


def _UserLines(stderr):
  return [line for line in stderr.splitlines() if line.strip() and not _LOG_RECORD.match(line)]


def _Verdict(outcome):
  """'' if the case ended as a bad input should, else what went wrong."""
  lines = _UserLines(outcome['stderr'])
  if outcome['code'] != 1:
    return f'exit {outcome["code"]}'
  if len(lines) != 1 or not lines[0].startswith('trainer: error: '):
    return f'{len(lines)} lines'
  if outcome['written']:
    return f'wrote {outcome["written"]}'
  return ''


@pytest.fixture(scope='module')
def outcomes(tmp_path_factory):
  work = tmp_path_factory.mktemp('bad_inputs')
  cases_json = work / 'cases.json'
  cases_json.write_text(json.dumps(CASES))
  env = dict(os.environ, LINGVO_GPIPE_PARAMS=os.path.join(_TESTS, 'testdata', 'params'),
             TF_CPP_MIN_LOG_LEVEL='2')
  result = subprocess.run(
      [sys.executable, os.path.join(_TESTS, 'testdata', 'bad_inputs.py'), str(cases_json),
       str(work / 'runs')], env=env, cwd=str(work), capture_output=True, text=True, timeout=900,
      check=False)
  found = {o['name']: o for o in map(json.loads, result.stdout.splitlines())}
  assert len(found) == len(CASES), result.stderr[-3000:]
  print(f'\n{"bad input":<60} verdict  error line')
  for name, _ in CASES:
    lines = _UserLines(found[name]['stderr'])
    print(f'{name[:60]:<60} {_Verdict(found[name]) or "ok":<8} {(lines or [""])[-1][:150]}')
  return found


def testThereAreEightyOrMoreCasesAllDistinct():
  assert len(CASES) >= 80 and len({name for name, _ in CASES}) == len(CASES)


@pytest.mark.parametrize('name', [name for name, _ in CASES])
def testABadInputIsOneLineExitOneAndWritesNothing(outcomes, name):
  outcome = outcomes[name]
  assert not _Verdict(outcome), outcome['stderr'][-3000:]
