"""Tests of the registered GPipe experiments: complete, consistent and runnable on CPU."""

import numpy as np
import pytest

from lingvo_gpipe.foundation import py_utils
from lingvo_gpipe.models import base_model
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry

_KEYS = [
    'image.synthetic.GPipeConvNet',
    'lm.synthetic.GPipeTransformerLmBig',
    'lm.synthetic.GPipeTransformerLmTiny',
    'lm.text.GPipeByteLm',
    'mt.synthetic.GPipeTransformerReverse',
]
# Small enough to run a Dev batch through in a test.
_RUNNABLE = [k for k in _KEYS if not k.endswith('Big')]


def _Batch(model_params):
  return next(iter(model_params.input.Instantiate().GetDataset()))


@pytest.mark.parametrize('key', _KEYS)
def testRegisteredWithDocumentedTrainDevTestInputs(key):
  assert key in model_registry.GetAllRegisteredKeys()
  cls = model_registry.GetClass(key)
  assert cls.__doc__ and len(cls.__doc__.split()) > 8
  inputs = {d: model_registry.GetParams(key, d) for d in base_model_params.DATASETS}
  for dataset, p in inputs.items():
    assert p.cls is base_model.SingleTaskModel  # So p.Instantiate() builds the model.
    assert {'name', 'task', 'train', 'input'} <= {name for name, _ in p.IterParams()}
    assert p.name == cls.__name__
    if dataset != 'Train':
      assert p.input.num_batches, f'{dataset} must be a finite pass'
      assert p.input != inputs['Train'].input
  assert inputs['Train'].input.num_batches is None


@pytest.mark.parametrize('key', _RUNNABLE)
def testTaskEvaluatesADevBatch(key):
  p = model_registry.GetParams(key, 'Dev')
  task = p.task.Instantiate()  # Checks the input against the stack, as task.input is set.
  assert p.task.input is not None
  with py_utils.EvalMode():
    metrics = task.FPropTower(task.theta, _Batch(p))
  assert 'loss' in metrics and np.isfinite(metrics.loss[0].numpy())
  assert task.stack.num_stages >= 2


def testBigLmHasFourStagesAndFourTimesAsManyMicroBatches():
  p = model_registry.GetParams('lm.synthetic.GPipeTransformerLmBig', 'Train')
  stack = p.task.Instantiate().stack
  assert stack.num_stages == 4
  assert stack.NumMicroBatches(p.input.batch_size) >= 4 * stack.num_stages
  assert all(len(cell.sub) >= 2 for cell in stack.cell)


def testByteLmReadsTheFileNamedByAnOverride(tmp_path):
  path = tmp_path / 'mine.txt'
  text = 'Grüße aus der Pipeline! ' * 200
  path.write_text(text, encoding='utf-8')
  p = model_registry.GetParams('lm.text.GPipeByteLm', 'Train')
  p.FromText(f'input.input_file : {path}\n')
  batch = _Batch(p)
  assert all(bytes(list(ids)) in text.encode('utf-8') for ids in batch.ids.numpy())
  task = p.task.Instantiate()
  metrics, _ = task.ForwardBackward(task.theta, batch)
  assert metrics.loss[0].numpy() > np.log(256) - 1.0  # Untrained: about uniform over bytes.


def testGetParamsInstantiatesTheModelAsLingvoDoes():
  """GetParams(key, dataset).Instantiate() builds the model; its task is named as alone."""
  key = 'lm.synthetic.GPipeTransformerLmTiny'
  model = model_registry.GetParams(key, 'Train').Instantiate()
  alone = model_registry.GetParams(key, 'Train').task.Instantiate()
  assert model.GetTask() is model.task
  assert [v.name for v in model.variables] == [v.name for v in alone.variables]
  assert model.variables[0].name.startswith('lm/stack/')
  for a, b in zip(model.variables, alone.variables):
    np.testing.assert_array_equal(a.numpy(), b.numpy())
