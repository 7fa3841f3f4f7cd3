"""Tests of failed_op_logs: the loss probe's failed ops log nothing; other lines stay."""

import os
import subprocess
import sys
import textwrap

_SCRIPT = textwrap.dedent('''
    import sys
    import tensorflow as tf
    from lingvo_gpipe.pipeline import loss_probe

    def Loss(logits, labels):
      print('the loss runs', file=sys.stderr)  # Written during the probe: kept.
      return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))

    logits, labels = tf.random.normal([4, 3]), tf.constant([0, 2, 1, 1])
    value, weight = loss_probe.MicroBatchLoss(Loss, 4, 16, 0, '1f1b')(logits, labels)
    print('probed', float(weight), file=sys.stderr)
    try:  # The same failure outside the probe is logged.
      Loss(logits, labels - 7)
    except tf.errors.InvalidArgumentError:
      pass
    ''')


def testTheProbesFailedOpsLogNothingAndOtherLinesAreKept():
  """A sparse cross-entropy fails on the probes' labels -1, -100 and 255, which TensorFlow
  logs as warnings; within the probe they are dropped, outside they are not."""
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0')
  result = subprocess.run([sys.executable, '-c', _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=True)
  lines = result.stderr.splitlines()
  assert 'probed 0.25' in lines
  assert lines.count('the loss runs') > 10  # Every probe's calls, and the first.
  failed = [line for line in lines if 'OP_REQUIRES failed' in line]
  assert failed, lines  # The one outside the probe.
  assert not [line for line in failed if any(f'label value of {v} ' in line
                                             for v in (-1, -100, 255))], failed


_DIES_IN_A_BLOCK = textwrap.dedent('''
    import os
    from lingvo_gpipe.pipeline import failed_op_logs

    with failed_op_logs.Dropped():
      with failed_op_logs.Dropped():  # A probe within a probe: no deadlock.
        os.write(2, b'W0000 00:00:1.5 7 op_kernel.cc:1] OP_REQUIRES failed at x.cc:1 : bad\\n')
        os.write(2, b'written in the block\\n')
        os._exit(3)  # Dies in the block (a crash): what it wrote is out all the same.
    ''')


def testABlockWithinABlockAndADeathInABlockLoseNoLine():
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL='0')
  result = subprocess.run([sys.executable, '-c', _DIES_IN_A_BLOCK], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
  assert result.returncode == 3
  assert result.stderr == 'written in the block\n'
