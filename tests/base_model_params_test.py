"""Tests of lingvo_gpipe.models.base_model_params."""

import doctest

import pytest

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.models import base_model_params


def _Input(batch_size):
  p = hyperparams.Params()
  p.Define('batch_size', batch_size, 'Examples per batch.')
  return p


class _Lm(base_model_params.SingleTaskModelParams):

  def Train(self):
    return _Input(32)

  def Test(self):
    return _Input(4)

  def Task(self):
    p = hyperparams.Params()
    p.Define('name', 'lm', 'Task name.')
    return p


def testModuleDocstringExampleRuns():
  result = doctest.testmod(base_model_params)
  assert result.attempted > 0 and result.failed == 0


def testModelWrapsTaskWithTrainerFields():
  p = _Lm().Model()
  assert p.name == '_Lm'
  assert p.task.name == 'lm'
  assert p.input is None
  assert (p.train.max_steps, p.train.save_interval_steps, p.train.summary_interval_steps,
          p.train.log_interval_steps) == (100_000, 1000, 100, 100)
  assert 'max_steps' in p.ToText()


def testDatasetsDefaultToTrain():
  experiment = _Lm()
  assert experiment.Dev().batch_size == 32
  assert experiment.Test().batch_size == 4
  assert base_model_params.DATASETS == ('Train', 'Dev', 'Test')


def testTrainAndTaskMustBeDefined():
  experiment = base_model_params.SingleTaskModelParams()
  with pytest.raises(NotImplementedError, match=r'SingleTaskModelParams must define Train\(\)'):
    experiment.Dev()
  with pytest.raises(NotImplementedError, match=r'must define Task\(\)'):
    experiment.Model()


def testTaskMustReturnParams():

  class Bad(_Lm):

    def Task(self):
      return {'name': 'lm'}

  with pytest.raises(TypeError,
                     match=r"Bad.Task\(\) must return a hyperparams.Params; got \{'name'"):
    Bad().Model()
