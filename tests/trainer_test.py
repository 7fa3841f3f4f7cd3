"""Tests of the trainer binary (end to end, in subprocesses) and the Learner it runs.

The experiment is tests/testdata/params/toy/regression.py: a two-stage pipelined
MLP whose steps take milliseconds, so each subprocess costs mostly TensorFlow's
start-up.
"""

import glob
import os
import random
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import tensorflow as tf

from lingvo_gpipe import layers
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.runners import base_runner
from lingvo_gpipe.runners import trainer
from lingvo_gpipe.training import checkpoint_files
from lingvo_gpipe.training import checkpointer as checkpointer_lib

_PARAMS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'testdata', 'params')
_MODEL = 'toy.regression.PipelinedRegression'
_STEP_KEY = 'global_step/.ATTRIBUTES/VARIABLE_VALUE'


# -- helpers ---------------------------------------------------------------------------


def _Start(*flags, model=_MODEL, cpp_log_level='2', params_dir=_PARAMS_DIR):
  """Starts the trainer binary with `flags`; returns the Popen.

  cpp_log_level: TF_CPP_MIN_LOG_LEVEL, or None to leave it to the binary.
  params_dir: LINGVO_GPIPE_PARAMS, where `model` is registered.
  """
  env = dict(os.environ, LINGVO_GPIPE_PARAMS=str(params_dir),
             TF_CPP_MIN_LOG_LEVEL=cpp_log_level)
  if cpp_log_level is None:
    del env['TF_CPP_MIN_LOG_LEVEL']
  args = [sys.executable, '-m', 'lingvo_gpipe.runners.trainer'] + (
      [f'--model={model}'] if model else [])
  return subprocess.Popen(args + list(flags), env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)


def _Finish(proc, timeout=180):
  """(returncode, stdout, stderr) of a started trainer."""
  out, err = proc.communicate(timeout=timeout)
  return proc.returncode, out, err


def _Run(*flags, **kwargs):
  return _Finish(_Start(*flags, **kwargs))


def _Ok(result):
  code, _, err = result
  assert code == 0, err[-3000:]
  return err


def _ErrorLines(err):
  return [line for line in err.splitlines() if line.startswith('trainer: error:')]


def _Summaries(directory):
  """tag -> {step: numpy value} of the TensorBoard event files in `directory`."""
  summaries = {}
  for path in sorted(glob.glob(os.path.join(directory, 'events.out.tfevents.*'))):
    for event in tf.compat.v1.train.summary_iterator(path):
      for value in event.summary.value:
        summaries.setdefault(value.tag, {})[event.step] = tf.make_ndarray(value.tensor)
  return summaries


def _Scalars(directory):
  """tag -> {step: value} of the TensorBoard scalars in `directory`."""
  return {tag: {step: float(v) for step, v in values.items()}
          for tag, values in _Summaries(directory).items()
          if all(v.dtype != object for v in values.values())}


def _Checkpoint(path):
  """All tensors of a checkpoint, read in full (so a broken file fails here)."""
  reader = tf.train.load_checkpoint(path)
  return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


def _ModelValues(path):
  return {k: v for k, v in _Checkpoint(path).items() if k.startswith('model/')}


def _Listing(directory):
  return {name: os.stat(os.path.join(directory, name)).st_mtime_ns
          for name in os.listdir(directory)}


# -- end to end ------------------------------------------------------------------------


def testTrainResumeAndEvaluate(tmp_path):
  logdir, straight = str(tmp_path / 'log'), str(tmp_path / 'straight')
  train_dir = os.path.join(logdir, 'train')
  uninterrupted = _Start(f'--logdir={straight}', '--max_steps=10')
  err = _Ok(_Run(f'--logdir={logdir}'))  # The params' max_steps: 6.

  assert tf.train.latest_checkpoint(train_dir).endswith('ckpt-6')
  assert sorted(os.path.basename(p) for p in glob.glob(f'{train_dir}/ckpt-*.index')) == [
      'ckpt-2.index', 'ckpt-4.index', 'ckpt-6.index']
  assert _Checkpoint(os.path.join(train_dir, 'ckpt-4'))[_STEP_KEY] == 4
  progress = [line for line in err.splitlines() if 'step 6/6' in line]
  assert progress and 'examples/s' in progress[0] and 'time left' in progress[0]
  assert f'tensorboard --logdir={logdir}' in err and 'ckpt-6' in err
  scalars = _Scalars(train_dir)
  for tag in ('loss', 'learning_rate', 'grad_norm', 'abs_error'):
    assert sorted(scalars[tag]) == [1, 2, 3, 4, 5, 6], tag
  for tag in ('examples_per_second', 'step_time'):  # Not of the first call: it traced.
    assert sorted(scalars[tag]) == [2, 3, 4, 5, 6], tag
  assert scalars['learning_rate'][3] == pytest.approx(0.05)
  assert 'task.hidden_dim : 8' in open(os.path.join(train_dir, 'params.txt')).read()

  # Resume to step 10 while an evaler follows the checkpoints.
  evaler = _Start(f'--logdir={logdir}', '--job=evaler_dev', '--max_steps=10')
  err = _Ok(_Run(f'--logdir={logdir}', '--max_steps=10'))
  assert 'Restored' in err and 'ckpt-6 (global step 6)' in err
  assert 'step 7/10' in err and 'step 1/' not in err
  assert sorted(_Scalars(train_dir)['loss']) == list(range(1, 11))
  assert _Checkpoint(tf.train.latest_checkpoint(train_dir))[_STEP_KEY] == 10
  _Ok(_Finish(evaler))
  assert 10 in _Scalars(os.path.join(logdir, 'eval_dev'))['loss']

  # A resumed run ends where an uninterrupted one does: optimizer slots, step
  # and input position were all restored.
  _Ok(_Finish(uninterrupted))
  resumed = _ModelValues(os.path.join(train_dir, 'ckpt-10'))
  expected = _ModelValues(os.path.join(straight, 'train', 'ckpt-10'))
  assert sorted(resumed) == sorted(expected) and len(resumed) == 4
  for name, value in expected.items():
    np.testing.assert_allclose(resumed[name], value, rtol=1e-5, atol=1e-6, err_msg=name)

  # Without --max_steps an evaler stops at the trainer's end (its params.txt), not at the
  # registered model's (6 here, where a trainer run to 2 never gets).
  short = os.path.join(str(tmp_path), 'short')
  _Ok(_Run(f'--logdir={short}', '--max_steps=2', '--model_params_override=train.max_steps : 20'))
  err = _Ok(_Run(f'--logdir={short}', '--job=evaler_dev', '--eval_timeout_secs=60',
                 '--model_params_override=train.max_steps : 20'))
  assert 'evaluating until train.max_steps=2.' in err and 'eval_dev step 2 ' in err

  # An evaler waiting for steps that no trainer will write gives up.
  code, _, err = _Run(f'--logdir={logdir}', '--job=evaler_dev', '--max_steps=12',
                      '--eval_timeout_secs=1')
  assert code == 1 and 'eval_dev step 10 ' in err, err[-3000:]
  assert _ErrorLines(err) == [
      f'trainer: error: No new checkpoint in {train_dir} for --eval_timeout_secs=1 (last '
      'evaluated: step 10, train.max_steps=12): is the trainer running?']

  err = _Ok(_Run(f'--logdir={logdir}', '--job=evaler_test', '--eval_once'))
  test_scalars = _Scalars(os.path.join(logdir, 'eval_test'))
  assert sorted(test_scalars) == ['abs_error', 'loss'] and list(test_scalars['loss']) == [10]
  assert 'eval_test step 10 (3 batches)' in err


def testDecoderJobAndExportOfATrainedLm(tmp_path):
  """Greedy decodes reproduce every sequence the teacher-forced model gets all right, so
  the decoder's exact match is at least the evaler's sequence accuracy."""
  logdir = str(tmp_path / 'log')
  lm = 'lm.synthetic.GPipeTransformerLmTiny'
  _Ok(_Run(f'--logdir={logdir}', '--max_steps=150', model=lm))
  err = _Ok(_Run(f'--logdir={logdir}', '--job=decoder_dev', '--eval_once', model=lm))
  decode_dir = os.path.join(logdir, 'decoder_dev')
  lines = open(os.path.join(decode_dir, 'decodes-150.txt')).read().splitlines()
  assert lines[0] == 'match\tprompt\thypothesis\treference' and len(lines) == 1 + 4 * 32
  rows = [line.split('\t') for line in lines[1:]]
  assert all(match == str(int(hyp == ref)) for match, _, hyp, ref in rows)
  scalars = _Scalars(decode_dir)
  exact = scalars['exact_match'][150]
  assert exact == pytest.approx(sum(r[0] == '1' for r in rows) / len(rows))
  assert 0.0 <= scalars['bleu'][150] <= 100.0 and 'decoder_dev step 150 (4 batches)' in err
  table = _Summaries(decode_dir)['decodes'][150].item().decode()
  assert table.splitlines()[2] == f'| {" | ".join(rows[0])} |'
  _Ok(_Run(f'--logdir={logdir}', '--job=evaler_dev', '--eval_once', model=lm))
  accuracy = _Scalars(os.path.join(logdir, 'eval_dev'))['sequence_accuracy'][150]
  assert exact >= accuracy - 1e-6 and accuracy > 0, (exact, accuracy)

  export_dir = str(tmp_path / 'export')
  _Ok(_Run(f'--logdir={logdir}', '--mode=export_decoder', f'--export_dir={export_dir}',
           model=lm))
  serve = tf.saved_model.load(export_dir).signatures['serving_default']
  prompt, hypothesis = rows[0][1], rows[0][2]
  ids = [int(i) for i in prompt.split()]
  out = serve(ids=tf.constant([ids], tf.int32), lengths=tf.constant([len(ids)]))
  start, length = int(out['start'][0]), int(out['lengths'][0])
  assert ' '.join(str(t) for t in out['tokens'][0, start:start + length].numpy()) == hypothesis


_FLOAT16 = ('--model_params_override=task.stack.fprop_dtype : tf.float16; '
            'task.train.loss_scale.growth_interval : 3; train.summary_interval_steps : 1')


def testFloat16TrainsUnderADynamicLossScaleThatResumes(tmp_path):
  """float16 turns loss scaling on by itself; skipped steps are logged; the scale and its
  counters are checkpointed, so a resumed run ends bitwise where an uninterrupted one does."""
  lm = 'lm.synthetic.GPipeTransformerLmTiny'
  straight, logdir = str(tmp_path / 'straight'), str(tmp_path / 'log')
  uninterrupted = _Start(f'--logdir={straight}', '--max_steps=12', _FLOAT16, model=lm)
  err = _Ok(_Run(f'--logdir={logdir}', '--max_steps=6', _FLOAT16, model=lm))
  assert re.search(r'step 1 skipped \(float16 gradients overflowed; nothing applied\); loss '
                   r'scale now 16384\.', err), err[-3000:]
  _Ok(_Run(f'--logdir={logdir}', '--max_steps=12', _FLOAT16, model=lm))
  _Ok(_Finish(uninterrupted))
  resumed = _Checkpoint(os.path.join(logdir, 'train', 'ckpt-12'))
  expected = _Checkpoint(os.path.join(straight, 'train', 'ckpt-12'))
  scale_keys = [k for k in expected if k.startswith('loss_scale/')]
  assert len(scale_keys) == 3 and expected['loss_scale/skipped_steps/.ATTRIBUTES/'
                                            'VARIABLE_VALUE'] > 0
  for name in scale_keys + [k for k in expected if k.startswith('model/')]:
    np.testing.assert_array_equal(resumed[name], expected[name], err_msg=name)
  scalars = _Scalars(os.path.join(straight, 'train'))
  assert sorted(scalars['loss_scale']) == sorted(scalars['loss']) and 12 in scalars['loss']
  assert all(np.isfinite(v) for v in scalars['loss'].values())
  assert scalars['loss'][12] < scalars['loss'][min(scalars['loss'])]
  # Its decoder, exported as trained (float16, from params.txt), serves float32 scores.
  export_dir = str(tmp_path / 'export')
  err = _Ok(_Run(f'--logdir={straight}', '--mode=export_decoder', f'--export_dir={export_dir}',
                 model=lm))
  assert re.search(r"Exporting with the trainer's settings .*task\.stack\.fprop_dtype", err), err
  serve = tf.saved_model.load(export_dir).signatures['serving_default']
  out = serve(ids=tf.constant([[1, 5, 6]], tf.int32), lengths=tf.constant([3]))
  assert out['scores'].dtype == tf.float32 and np.isfinite(out['scores'].numpy()).all()


def testNanStopsTrainingAndKeepsTheLastGoodCheckpoint(tmp_path):
  logdir = str(tmp_path / 'log')
  code, _, err = _Run(f'--logdir={logdir}', '--max_steps=10',
                      '--model_params_override=task.nan_at_step : 5')
  assert code == 1 and 'Traceback' not in err
  train_dir = os.path.join(logdir, 'train')
  lines = _ErrorLines(err)
  assert len(lines) == 1 and re.fullmatch(
      r'trainer: error: The step from global step 5 to 6: loss nan, gradient norm [0-9.]+ is '
      r'not finite; training stopped without applying it \(global step 5\). Last good '
      f'checkpoint: {re.escape(train_dir)}/ckpt-4.',
      lines[0]), lines
  latest = tf.train.latest_checkpoint(train_dir)
  assert latest.endswith('ckpt-4')
  values = _Checkpoint(latest)
  assert values[_STEP_KEY] == 4
  assert all(np.all(np.isfinite(v)) for k, v in values.items() if k.startswith('model/'))
  # An evaler whose loss is not finite (NaN from step 3 on) fails, naming it.
  code, _, err = _Run(f'--logdir={logdir}', '--job=evaler_dev', '--eval_once',
                      '--model_params_override=task.nan_at_step : 3')
  assert code == 1 and _ErrorLines(err) == [
      f'trainer: error: eval_dev of {train_dir}/ckpt-4 (step 4): loss nan not finite.'], err


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def testAStepCancelledByAnOpFailingInAChunkRaisesThatOpsError(tmp_path, schedule):
  """toy.regression.FailsOnBatch2's step 2, in the middle of a loop call of 4 steps, fails
  inside stage 2 on its batch, which TensorFlow reports only as CancelledError: the trainer
  runs that step again eagerly on the same batch and raises the op's own error (also where
  a split backward's W, traced, re-creates B's ops: eagerly B takes the weight gradients)."""
  from lingvo_gpipe.foundation import errors  # pylint: disable=g-import-not-at-top
  logdir = str(tmp_path / 'log')
  code, _, err = _Run(f'--logdir={logdir}', '--steps_per_loop=4',
                      '--model_params_override=train.save_interval_steps : 6; '
                      f"task.stack.schedule : '{schedule}'",
                      model='toy.regression.FailsOnBatch2')
  lines = err.strip().splitlines()
  assert code == 1 and lines[-1] == errors.RERUN_NOTE, err[-3000:]
  assert lines[-2].startswith('ValueError: Pipeline cell 2 (regression/stack/cell2) failed on '
                              'the output of cell 1'), err[-3000:]
  assert 'FailsOnNonFinite: a non-finite activation' in lines[-2]
  assert 'running it again eagerly to find the op that failed' in err


def testKill9MidRunThenCleanResume(tmp_path):
  logdir = str(tmp_path / 'log')
  train_dir = os.path.join(logdir, 'train')
  fast = 'train.save_interval_steps : 1; train.log_interval_steps : 1000'
  proc = _Start(f'--logdir={logdir}', '--max_steps=1000000', f'--model_params_override={fast}')
  deadline = time.time() + 120
  while time.time() < deadline:  # Checkpoints every step: wait for a few.
    latest = tf.train.latest_checkpoint(train_dir)
    if latest and int(latest.rsplit('-', 1)[1]) >= 5:
      break
    time.sleep(0.05)
  time.sleep(random.uniform(0.0, 0.2))  # Somewhere in a step or a save.
  os.kill(proc.pid, signal.SIGKILL)
  proc.communicate()
  assert proc.returncode == -signal.SIGKILL

  latest = tf.train.latest_checkpoint(train_dir)
  step = int(_Checkpoint(latest)[_STEP_KEY])
  assert step >= 5 and latest.endswith(f'ckpt-{step}')
  err = _Ok(_Run(f'--logdir={logdir}', f'--max_steps={step + 3}',
                 f'--model_params_override={fast}'))
  # The state file can lag the directory by the save the kill interrupted: the trainer
  # restores the newest intact checkpoint on disk, which is never older than the state file's.
  restored = int(re.search(r'Restored \S+ \(global step (\d+)\)', err).group(1))
  assert restored >= step
  assert _Checkpoint(tf.train.latest_checkpoint(train_dir))[_STEP_KEY] == max(restored, step + 3)


def testHealthyRunLogsNoErrorsAndNoTensorFlowInfo(tmp_path):
  """As a user runs it (TF_CPP_MIN_LOG_LEVEL unset): checkpoints are saved, and no line is
  at error level or TensorFlow's per-checkpoint INFO line."""
  err = _Ok(_Finish(_Start(f'--logdir={tmp_path}', '--max_steps=4', cpp_log_level=None)))
  assert 'Saved checkpoint' in err and 'step 4/4' in err
  assert 'from step 0 to train.max_steps=4 (--max_steps=N to change)' in err
  # How the pipeline runs: the toy's 2 layers, each a cell, its M=2, the default schedule.
  assert re.search(r'Pipeline \S+/pipe: 2 cells on K=2 devices \(v=1\), M=2, schedule gpipe, '
                   r'remat always; stage 0 on CPU:0, stage 1 on CPU:1\.', err), err[-3000:]
  noise = [line for line in err.splitlines()
           if re.match(r'[EF]\d{4} |[IW]0000 00:00:', line) or 'Sharding callback' in line or
           'retracing' in line]
  assert not noise, err[-3000:]


def testDefaultDevicesCountAPipelinesOwnReplicas(tmp_path):
  """2 stages x 2 replicas of the stack: 4 devices, not the 2 of its stages."""
  err = _Ok(_Run(f'--logdir={tmp_path}', '--max_steps=1',
                 '--model_params_override=task.stack.num_replicas : 2',
                 model='lm.synthetic.GPipeTransformerLmTiny'))
  assert 'Pipeline lm/stack: 2 cells on K=2 devices (v=1) x 2 replicas, M=2' in err


def testHelpExitsZero():
  code, out, err = _Run('--help', model=None)
  assert code == 0 and '--model_params_override' in out, err[-3000:]
  # --helpshort lists the trainer's own flags, also where the README's import path runs the
  # shim lingvo_gpipe/trainer.py (absl lists the flags of the file run).
  proc = subprocess.run([sys.executable, '-m', 'lingvo_gpipe.trainer', '--helpshort'],
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'), capture_output=True,
                        text=True, check=False)
  out = proc.stdout
  assert proc.returncode == 0 and '--model_params_override' in out and '--logdir' in out, out
  assert out.startswith('The trainer binary: trains') and '--log_dir' not in out


def testInspectParamsAppliesOverrides():
  override = ('task.hidden_dim : 7\ntask.train.learning_rate : 0.5; '
              'train.max_steps : 3; task.name : "a;b"')
  code, out, err = _Run('--mode=inspect_params', f'--model_params_override={override}',
                        '--max_steps=9')
  assert code == 0, err
  lines = out.splitlines()
  for expected in ('task.hidden_dim : 7', 'task.train.learning_rate : 0.5',
                   'train.max_steps : 9', "task.name : 'a;b'",
                   'task.train.optimizer.cls : lingvo_gpipe.training.optimizer.Adam',
                   'input.cls : _lingvo_gpipe_params_dir_'):
    assert any(line.startswith(expected) for line in lines), expected


def _MainInProcess(capsys, *argv):
  """Runs trainer.main with flags `argv` in this process; returns (exit code, stderr)."""
  trainer.FLAGS.unparse_flags()
  trainer.FLAGS(['trainer'] + list(argv))
  code = 0
  try:
    trainer.main(['trainer'])
  except SystemExit as e:
    code = e.code
  finally:
    trainer.FLAGS.unparse_flags()
  return code, capsys.readouterr().err


def testUserErrorsAreOneLine(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', _PARAMS_DIR)
  tf.config.list_logical_devices()  # Start TensorFlow with conftest's devices: in process, a
  # case that configures fewer first would leave every later case (and test) with those.
  not_a_dir = tmp_path / 'file'
  not_a_dir.write_text('')
  logdir = f'--logdir={tmp_path}/log'
  model = f'--model={_MODEL}'
  cases = [
      (['--model=toy.regression.PipelinedRegresion', logdir],
       "No model is registered under key 'toy.regression.PipelinedRegresion'. Closest "
       'registered keys: toy.regression.PipelinedRegression'),
      ([model, logdir, '--model_params_override=task.hiden_dim : 3'],
       "Unknown params key 'hiden_dim'. Did you mean: hidden_dim"),
      ([model, logdir, '--model_params_override=task.train.max_steps : 3'],
       "Unknown params key 'max_steps'. Defined: ['clip_gradient_norm_to_value', "
       "'learning_rate', 'loss_scale', 'lr_schedule', 'optimizer']. Did you mean "
       "train.max_steps?"),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir,
        '--model_params_override=task.input.batch_size : 5'],
       "model_params_override sets task.input.batch_size, but the input that runs is the "
       "model's input (the task gets a copy): set input.batch_size instead."),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir,
        "--model_params_override=task.stack.devices : ['/device:CPU:0', '/device:GPU:3']"],
       "Cannot build the task: Device '/device:GPU:3' does not exist here"),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir,
        '--model_params_override=task.stack.num_micro_batches : 64'],
       'input.batch_size=32 cannot be split by task.stack.num_micro_batches=64: A batch of 32 '
       'examples is smaller than num_micro_batches=64: every micro-batch needs at least one '
       'example (a configured batch that leaves some empty idles the pipeline every step).'),
      ([model, logdir, '--model_params_override=input.num_batches : abc'],
       "cannot parse 'abc' as NoneType (bare word 'abc': quote a string"),
      ([model, logdir, '--model_params_override=task.train.learning_rate : -0.1'],
       'Cannot build the task: regression.train.learning_rate=-0.1: expected a finite number '
       '>= 0.'),
      ([model, logdir, '--model_params_override=task.hidden_dim : abc'],
       "Params key 'task.hidden_dim': cannot parse 'abc' as int"),
      ([model, logdir, '--model_params_override=task.hidden_dim : 0'],
       'Cannot build the task: '),
      ([model, logdir, '--model_params_override=input.batch_size : 0'],
       'Cannot build the input generator: input: batch_size must be positive, got 0.'),
      (['--model=lm.text.GPipeByteLm', logdir,
        f'--model_params_override=input.input_file : {tmp_path}/none.txt'],
       f"Cannot build the input generator: text_train: cannot read input_file "
       f"'{tmp_path}/none.txt': No such file or directory."),
      ([model, f'--logdir={not_a_dir}/log'], f'Cannot write to {not_a_dir}/log/train'),
      ([model, logdir, '--job=evaler_dev', '--eval_once'],
       f'No checkpoint in {tmp_path}/log/train to evaluate.'),
      ([model, logdir, '--job=evaler_dev', '--eval_timeout_secs=0'],
       '--eval_timeout_secs must be > 0, got 0.'),
      ([model, logdir, '--job=evaler_dev', '--eval_timeout_secs=0.5'],
       f'No new checkpoint in {tmp_path}/log/train for --eval_timeout_secs=0.5 (none evaluated '
       'yet, train.max_steps=6): is the trainer running?'),
      ([model, logdir, '--job=trainer_client'],
       '--job=trainer_client needs a cluster with a worker job'),
      (['--job=worker', '--cluster_spec=worker=localhost:2222', '--task=1'],
       '--task=1 but --cluster_spec lists 1 worker task(s).'),
      ([model, logdir, '--task=3'],
       '--task=3 picks a process of its job in the cluster spec, and --job=controller,trainer is '
       'not a job of any (none given); drop --task.'),
      ([model, logdir, '--cluster_spec=worker=localhost'],
       "address 'localhost' of job 'worker' is not host:port"),
      ([model, logdir, '--cluster_spec=worker=localhost:2222'],
       '--cluster_spec is for --job=trainer_client, worker and the evalers'),
      ([model, logdir, '--worker_replicas=2', '--worker_split_size=1'],
       "--worker_replicas and --worker_split_size apply to PipeliningLayer params, and the "
       "task's params hold none"),
      ([model, '--num_cpu_devices=0'], '--num_cpu_devices must be >= 1, got 0.'),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir, '--num_cpu_devices=1'],
       "--num_cpu_devices=1, but the task's pipelines need 2 devices"),
      ([model], '--logdir is required.'),
      ([model, logdir, '--max_steps=-5'], '--max_steps must be >= 0, got -5.'),
      ([model, logdir, '--checkpoint_max_to_keep=0'],
       '--checkpoint_max_to_keep must be >= 1, got 0.'),
      ([model, logdir, '--job=evaler_dev', '--eval_batches=0'],
       '--eval_batches must be >= 1, got 0.'),
      ([model, logdir, '--job=evaler_dev', '--eval_batches=-1'],
       '--eval_batches must be >= 1, got -1.'),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir,
        '--model_params_override=task.stack.virtual_stages : 0'],
       'Cannot build the task: stack: virtual_stages=0 must be a positive int dividing the 2 '
       'cells.'),
      ([model, logdir, '--model_params_override=task.train.optimizer.beta1 : 1.5'],
       'Cannot build the task: Adam: beta1 must be in [0, 1), got 1.5.'),
      ([model, logdir, '--model_params_override=train.max_steps : -5'],
       'max_steps must be at least 0, got -5.'),
      ([model, logdir, '--model_params_override=train.log_interval_steps : 0'],
       'log_interval_steps must be at least 1, got 0.'),
      ([model, logdir, '--pipeline_stats_every=-1'],
       '--pipeline_stats_every must be >= 0, got -1.'),
      ([model, logdir, '--pipeline_stats_every=1', '--job=evaler_dev'],
       '--pipeline_stats_every times training steps, and --mode=sync --job=evaler_dev trains '
       'none: drop it.'),
      ([model, '--pipeline_stats_every=1', '--mode=check_pipeline'],
       '--mode=check_pipeline --job=controller,trainer trains none'),
      ([model, logdir, '--job=decoder_dev'],
       '--job=decoder_dev decodes sequence tasks (LanguageModelTask, EncoderDecoderTask); the '
       f'task of --model={_MODEL} is RegressionTask.'),
      ([model, logdir, '--mode=export_decoder'], '--mode=export_decoder decodes sequence tasks'),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir, '--mode=export_decoder'],
       f'No checkpoint in {tmp_path}/log/train to export.'),
      (['--model=lm.synthetic.GPipeTransformerLmTiny', logdir, '--job=decoder_test',
        '--model_params_override=task.decoder.beam_size : 0'],
       'Cannot build the task: lm.decoder.beam_size=0: expected an int >= 1.'),
  ] + ([] if tf.config.list_physical_devices('GPU') else [
      ([model, logdir, '--run_locally=gpu'],
       'run_locally=gpu, but TensorFlow finds no GPU on this machine'),
      ([model, logdir, '--gpus=0'], 'GPUs were named (gpus=[0], gpu_split_mb=None) for a run on '
       "CPUs (run_locally='auto', 0 GPU(s) seen)."),
      ([model, logdir, '--gpu_split_mb=512', '--run_locally=cpu'], 'gpu_split_mb=512'),
  ])
  for argv, message in cases:
    code, err = _MainInProcess(capsys, *argv)
    lines = _ErrorLines(err)
    assert code == 1 and len(lines) == 1 and message in lines[0], (argv, err)
    assert not os.path.exists(f'{tmp_path}/log/train/params.txt'), argv  # Before the run.
  assert not glob.glob(f'{tmp_path}/log/train/ckpt-*')  # Nothing trained or saved.


def testListModelsPrintsKeysWithTheirDocstringsFirstLine():
  code, out, err = _Run('--mode=list_models', model=None)
  assert code == 0, err[-3000:]
  rows = [line.split(None, 1) for line in out.splitlines()]
  described = dict(rows)
  assert [key for key, _ in rows] == sorted(described) and len(rows) > 5
  assert described[_MODEL] == 'Six steps, a checkpoint every two, summaries and logs every step.'
  assert described['lm.text.GPipeByteLm'].startswith('A 4-layer, 2-stage byte LM of any UTF-8')


_TRAIN_AND_DEV = """
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.params.lm import synthetic


@model_registry.RegisterSingleTaskModel
class TrainAndDev(base_model_params.SingleTaskModelParams):
  Train = synthetic.GPipeTransformerLmTiny.Train
  Dev = synthetic.GPipeTransformerLmTiny.Dev
  Task = synthetic.GPipeTransformerLmTiny.Task
"""


def testEvalerSaysWhenItsDatasetFallsBackToTrain(tmp_path, capsys, monkeypatch, caplog):
  (tmp_path / 'toy').mkdir()
  (tmp_path / 'toy' / 'train_and_dev.py').write_text(_TRAIN_AND_DEV)
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', str(tmp_path))
  for job, falls_back in (('evaler_dev', False), ('evaler_test', True)):
    caplog.clear()
    code, err = _MainInProcess(capsys, '--model=toy.train_and_dev.TrainAndDev', f'--job={job}',
                               '--mode=inspect_params')
    assert code == 0, err
    notes = [r.getMessage() for r in caplog.records if 'Train() data' in r.getMessage()]
    assert notes == (['toy.train_and_dev.TrainAndDev defines no Test(): evaluating its Train() '
                      'data instead.'] if falls_back else []), job


_FILL_DRAIN_WITH_LOSS_PER_MICRO_BATCH = """
from lingvo_gpipe.models import model_registry
from lingvo_gpipe.params.lm import synthetic


@model_registry.RegisterSingleTaskModel
class OwnOrder(synthetic.GPipeTransformerLmTiny):

  def Task(self):
    p = super().Task()
    p.stack.schedule = ('schedule gpipe K=2 M=2 v=1\\n'
                        'device0: F0@0 F1@0 BW1@0 BW0@0\\n'
                        'device1: F0@1 L0@1 F1@1 L1@1 BW1@1 BW0@1\\n')
    return p
"""


def testPipelineStatisticsLabelAUsersOwnOrderByItsText(tmp_path):
  """Its device orders are fill-drain's, its losses per micro-batch: not 'gpipe'."""
  (tmp_path / 'toy').mkdir()
  (tmp_path / 'toy' / 'own_order.py').write_text(_FILL_DRAIN_WITH_LOSS_PER_MICRO_BATCH)
  err = _Ok(_Run('--max_steps=2', f'--logdir={tmp_path}/log', '--pipeline_stats_every=1',
                 model='toy.own_order.OwnOrder', params_dir=tmp_path))
  logged = [line.split('] ', 1)[1] for line in err.splitlines() if ' pipeline (' in line]
  assert len(logged) == 1 and logged[0].startswith(
      'step 2 pipeline (gpipe (text), K=2, M=2): '), logged


def testEvalOnceWithoutCheckpointWritesNothing(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', _PARAMS_DIR)
  code, _ = _MainInProcess(capsys, f'--model={_MODEL}', f'--logdir={tmp_path}/log',
                           '--job=evaler_dev', '--eval_once')
  assert code == 1 and not os.path.exists(tmp_path / 'log')


def testCheckpointOfAnotherModelIsRefusedAndNothingWritten(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', _PARAMS_DIR)
  logdir = str(tmp_path / 'log')
  flags = [f'--model={_MODEL}', f'--logdir={logdir}', '--max_steps=2']
  code, err = _MainInProcess(capsys, *flags)
  assert code == 0, err
  train_dir = os.path.join(logdir, 'train')
  before = _Listing(train_dir)
  code, err = _MainInProcess(capsys, *flags, '--max_steps=4',
                             '--model_params_override=task.hidden_dim : 16')
  assert code == 1 and _ErrorLines(err) == [
      f'trainer: error: Checkpoint {train_dir}/ckpt-2 is from a different model: variable '
      'regression/pipe/hidden/b is [8] float32 there, [16] float32 here (and 2 more '
      'differences). Use another logdir, or the model and params it was written by.']
  assert _Listing(train_dir) == before


def testAnEvalerPassesOverADamagedLatestCheckpointInOneLine(tmp_path, capsys, monkeypatch,
                                                            caplog):
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', _PARAMS_DIR)
  logdir = str(tmp_path / 'log')
  flags = [f'--model={_MODEL}', f'--logdir={logdir}', '--max_steps=4']
  assert _MainInProcess(capsys, *flags)[0] == 0
  latest = os.path.join(logdir, 'train', 'ckpt-4')
  with open(latest + '.data-00000-of-00001', 'r+b') as f:
    f.truncate(10)
  before = _Listing(os.path.join(logdir, 'train'))
  code, err = _MainInProcess(capsys, *flags, '--job=evaler_dev', '--eval_once')
  assert code == 0 and 'Traceback' not in err, err
  damaged = [r.getMessage() for r in caplog.records if 'is damaged' in r.getMessage()]
  assert len(damaged) == 1 and damaged[0].startswith(f'Checkpoint {latest} is damaged (')
  assert list(_Scalars(os.path.join(logdir, 'eval_dev'))['loss']) == [2]
  assert _Listing(os.path.join(logdir, 'train')) == before  # An evaler only reads.


def testAnEvalerSkipsACheckpointRemovedWhileItLoads(tmp_path, capsys, monkeypatch, caplog):
  monkeypatch.setenv('LINGVO_GPIPE_PARAMS', _PARAMS_DIR)
  logdir = str(tmp_path / 'log')
  flags = [f'--model={_MODEL}', f'--logdir={logdir}', '--max_steps=4']
  assert _MainInProcess(capsys, *flags)[0] == 0
  train_dir = os.path.join(logdir, 'train')
  load_checkpoint = tf.train.load_checkpoint
  check_model = checkpointer_lib.Checkpointer.CheckModel

  def OpenedThenRotatedAway(path):
    reader = load_checkpoint(path)
    checkpoint_files.Remove(train_dir, checkpoint_files.Step(path))
    return reader

  def CheckModelDuringRotation(self, path):
    with monkeypatch.context() as patch:
      patch.setattr(tf.train, 'load_checkpoint', OpenedThenRotatedAway)
      return check_model(self, path)

  monkeypatch.setattr(checkpointer_lib.Checkpointer, 'CheckModel', CheckModelDuringRotation)
  code, err = _MainInProcess(capsys, *flags, '--job=evaler_dev', '--eval_timeout_secs=0.5')
  assert code == 1 and 'Traceback' not in err
  skipped = [r.getMessage() for r in caplog.records if 'removed (rotation)' in r.getMessage()]
  assert skipped == [f'Checkpoint {train_dir}/ckpt-4 was removed (rotation) while it was '
                     'loaded; skipped.']
  assert _ErrorLines(err) == [
      f'trainer: error: No new checkpoint in {train_dir} for --eval_timeout_secs=0.5 (none '
      'evaluated yet, train.max_steps=4): is the trainer running?']


# -- in process: flags, stages, the Learner -------------------------------------------


def testModelInputOverrideReachesTheTaskCheck():
  """An override of the model's input is what the task checks itself against."""
  params = base_runner.LoadModelParams('lm.synthetic.GPipeTransformerLmTiny', 'Train',
                                       'input.seq_len : 40')
  assert params.task.input.seq_len == 40
  with pytest.raises(ValueError, match='40'):
    params.task.Instantiate()


# -- one run, any layout: resume under another cut, a balance plan, unpipelined ----------


_TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'tools')


def testARunResumesUnderAnotherCutAPlanAndUnpipelinedWithTheSameLosses(tmp_path):
  """An own cut at K=3 (an override's cell ends) -> plan_balance's K=3, M=4 -> one stage:
  the losses and final weights of an uninterrupted run as registered, K=2 (relative 1e-5)."""
  tiny = 'lm.synthetic.GPipeTransformerLmTiny'
  common = ('train.save_interval_steps : 3; train.summary_interval_steps : 1; '
            'train.log_interval_steps : 3')

  def Train(logdir, max_steps, override='', *flags):
    _Ok(_Run(f'--logdir={logdir}', f'--model_params_override={common}; train.max_steps : '
             f'{max_steps}{override}', *flags, model=tiny))

  Train(tmp_path / 'whole', 9)
  moved = tmp_path / 'moved'
  Train(moved, 3, '; task.stack.splits : [1, 2, 4]')
  plan = str(tmp_path / 'plan.json')
  proc = subprocess.run([sys.executable, os.path.join(_TOOLS, 'plan_balance.py'),
                         f'--model={tiny}', '--stages=3', '--micro_batches=4', '--repeats=1',
                         f'--out={plan}'], env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL='2'),
                        capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  Train(moved, 6, '', f'--balance_file={plan}')
  Train(moved, 9, '; task.stack.splits : 1')
  want = _Scalars(os.path.join(tmp_path, 'whole', 'train'))['loss']
  got = _Scalars(os.path.join(moved, 'train'))['loss']
  assert sorted(got) == sorted(want) and len(want) >= 8
  for step, value in want.items():
    assert abs(got[step] - value) <= 1e-5 * abs(value), (step, got[step], value)
  final = [_Checkpoint(os.path.join(d, 'train', 'ckpt-9')) for d in (tmp_path / 'whole', moved)]
  assert sorted(final[0]) == sorted(final[1])
  for name, value in final[0].items():
    if not (name.startswith('model/') and value.dtype.kind == 'f'):
      continue
    if 'key_proj/b/' in name:
      # Its gradient is 0 but for rounding (a softmax ignores a shift), which Adam scales up
      # to steps of the learning rate: both runs hold such noise, and only that.
      assert max(np.abs(value).max(), np.abs(final[1][name]).max()) < 1e-2, name
      continue
    scale = float(np.abs(value).max())
    assert float(np.abs(final[1][name] - value).max()) <= 1e-5 * scale, name


def testTrainerAndEstimatorShareOneCheckpointLayout(tmp_path):
  """A trainer checkpoint trains on in an Estimator's model_dir, and back."""
  from lingvo_gpipe.runners import estimator  # pylint: disable=g-import-not-at-top
  from lingvo_gpipe.models import model_registry  # pylint: disable=g-import-not-at-top
  model_registry.ImportParams(_PARAMS_DIR)
  logdir = tmp_path / 'run'
  _Ok(_Run(f'--logdir={logdir}', '--max_steps=2'))
  model_dir = str(logdir / 'train')
  est = estimator.Estimator.from_registry(_MODEL, estimator.RunConfig(
      model_dir=model_dir, iterations_per_loop=2, save_checkpoints_steps=2))
  assert est.evaluate(estimator.RegistryInputFn(_MODEL, 'Dev'))['global_step'] == 2
  est.train(estimator.RegistryInputFn(_MODEL, 'Train'), max_steps=4)
  err = _Ok(_Run(f'--logdir={logdir}', '--max_steps=6'))
  assert 'from step 4 to train.max_steps=6' in err
  # The same 6 steps in one trainer run give the same weights.
  _Ok(_Run(f'--logdir={tmp_path / "whole"}', '--max_steps=6'))
  want = _Checkpoint(str(tmp_path / 'whole' / 'train' / 'ckpt-6'))
  got = _Checkpoint(str(logdir / 'train' / 'ckpt-6'))
  for name, value in want.items():
    if name.startswith('model/'):
      np.testing.assert_allclose(got[name], value, rtol=1e-5, atol=1e-7, err_msg=name)


_FULL_DISK_SCRIPT = r'''
set -u
d=$1
mount -t tmpfs -o size=1m tmpfs "$d"
train() {
  python -m lingvo_gpipe.trainer --model=toy.regression.PipelinedRegression "$@"; echo "exit $?";
}
fill() { dd if=/dev/zero of="$d/fill" bs=4k 2>/dev/null; truncate -s "-$1" "$d/fill"; }
train --logdir="$d/log" --max_steps=2
fill 0; echo '# full at start'; train --logdir="$d/new" --max_steps=2; ls -A "$d/new/train"
rm "$d/fill"; fill 8192; echo '# full at a save'; train --logdir="$d/log" --max_steps=4
rm "$d/fill"; echo '# space again'; train --logdir="$d/log" --max_steps=4
python -c "import tensorflow as tf; print('latest', tf.train.latest_checkpoint('$d/log/train'))"
'''


def testAFullDiskIsOneLineAndLosesNothing(tmp_path):
  """A full disk (a 1 MiB tmpfs in a user and mount namespace of its own) at start-up or at
  a save stops the trainer with one line naming the path; the run then resumes from its last
  checkpoint once there is space."""
  if subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'true'],
                    capture_output=True, check=False).returncode:
    pytest.skip('this machine allows no unprivileged user and mount namespaces')
  disk = tmp_path / 'disk'
  disk.mkdir()
  env = dict(os.environ, LINGVO_GPIPE_PARAMS=_PARAMS_DIR, TF_CPP_MIN_LOG_LEVEL='2',
             PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ['PATH'])
  result = subprocess.run(['unshare', '--user', '--map-root-user', '--mount', 'bash', '-c',
                           _FULL_DISK_SCRIPT, 'sh', str(disk)], env=env, capture_output=True,
                          text=True, timeout=600, check=False)
  out, err = result.stdout, result.stderr
  assert 'Traceback' not in err, err[-3000:]
  assert out.split('\n# ')[1:] == [
      'full at start\nexit 1',
      'full at a save\nexit 1',
      f'space again\nexit 0\nlatest {disk}/log/train/ckpt-4\n'], out + err[-3000:]
  start, save = _ErrorLines(err)
  assert start == (f'trainer: error: Cannot write to {disk}/new/train: {disk}/new/train/'
                   '.write_probe; No space left on device'), err[-3000:]
  assert re.fullmatch(
      f'trainer: error: Cannot write checkpoint {disk}/log/train/ckpt-4 \\(the older '
      f'checkpoints are kept\\): {disk}/log/train/ckpt-4_temp/\\S+; No space left on device',
      save), save


def testAnEvalerEvaluatesTheModelAndDataTheTrainerRanWith(tmp_path):
  """The trainer's overrides, recorded in <logdir>/train/params.txt, are the evaler's too
  where Dev shares the Train setting (a model size, the batch size; not Dev's own seed), so
  it evaluates the trained model without repeating them; its own override wins."""
  logdir = str(tmp_path / 'log')
  trained = 'task.hidden_dim : 6; input.batch_size : 4; input.seed : 7'
  _Ok(_Run(f'--logdir={logdir}', '--max_steps=2', f'--model_params_override={trained}'))
  err = _Ok(_Run(f'--logdir={logdir}', '--job=evaler_dev', '--eval_once'))
  taken = [line for line in err.splitlines() if "Evaluating with the trainer's settings" in line]
  assert len(taken) == 1 and taken[0].endswith(
      f"({logdir}/train/params.txt): input.batch_size : 4; task.hidden_dim : 6"), taken
  assert 'eval_dev step 2 (2 batches)' in err  # Dev's own seed and num_batches.
  err = _Ok(_Run(f'--logdir={logdir}', '--job=evaler_dev', '--eval_once',
                 '--model_params_override=input.batch_size : 2'))
  taken = [line for line in err.splitlines() if "Evaluating with the trainer's settings" in line]
  assert len(taken) == 1 and taken[0].endswith('params.txt): task.hidden_dim : 6'), taken
  assert re.search(r"Evaluating with your own override of settings the trainer set "
                   r"\(.*params\.txt\), the trainer's being: input\.batch_size : 4\.", err), (
                       err[-3000:])
  # Without them the evaler would build another model than the checkpoint's.
  code, _, err = _Run(f'--logdir={logdir}', '--job=evaler_dev', '--eval_once',
                      '--model_params_override=task.hidden_dim : 8')
  assert code == 1 and 'is from a different model' in err
