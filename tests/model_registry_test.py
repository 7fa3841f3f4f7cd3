"""Tests of lingvo_gpipe.models.model_registry."""

import importlib
import os
import pkgutil
import re
import sys

import pytest

from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry
import lingvo_gpipe.params

# A params file; Task() and Train() return shared module-level params, so only
# GetParams' deep copy keeps callers' changes from leaking into later calls.
_PARAMS_FILE = """\
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.models import base_model_params
from lingvo_gpipe.models import model_registry


def _Input(batch_size):
  p = hyperparams.Params()
  p.Define('batch_size', batch_size, 'Examples per batch.')
  return p


_TRAIN = _Input(32)
_TASK = hyperparams.Params()
_TASK.Define('name', 'tiny', 'Task name.')
_TASK.Define('dims', [4, 4], 'Layer widths.')


@model_registry.RegisterSingleTaskModel
class {name}(base_model_params.SingleTaskModelParams):

  def Train(self):
    return _TRAIN

  def Dev(self):
    return _Input(8)

  def Task(self):
    return _TASK
"""

_KEY_RE = re.compile(r'[A-Za-z_]\w*\.[A-Za-z_]\w*\.[A-Za-z_]\w*')


@pytest.fixture(autouse=True)
def _IsolatedRegistry(monkeypatch):
  """Each test registers into a copy of the table holding the project's models."""
  monkeypatch.delenv(model_registry.ENV_VAR, raising=False)
  model_registry.GetAllRegisteredKeys()  # Registers the project's params once.
  monkeypatch.setattr(model_registry, '_REGISTRY', dict(model_registry._REGISTRY))


def _Write(root, relative_path, text):
  path = root / relative_path
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(text)
  return path


def _WriteModel(root, relative_path, *class_names):
  return _Write(root, relative_path,
                '\n'.join(_PARAMS_FILE.replace('{name}', n) for n in class_names))


def testImportParamsDirectoryDerivesKeysFromPaths(tmp_path):
  _WriteModel(tmp_path, 'mt/mine.py', 'Mine')
  _WriteModel(tmp_path, 'lm/other.py', 'A', 'B')
  _Write(tmp_path, 'lm/__init__.py', '')
  _Write(tmp_path, '.ipynb_checkpoints/mine-checkpoint.py', 'not python')  # Hidden: skipped.
  model_registry.ImportParams(tmp_path)
  keys = model_registry.GetAllRegisteredKeys()
  assert {'mt.mine.Mine', 'lm.other.A', 'lm.other.B'} <= set(keys)
  assert keys == sorted(keys)
  cls = model_registry.GetClass('mt.mine.Mine')
  assert cls.__name__ == 'Mine'
  assert cls.__module__.endswith('.params.mt.mine')
  assert not cls.__module__.startswith(('mt', 'lingvo_gpipe.'))  # Cannot collide.


def testEnvironmentVariableIsReadAtLookup(tmp_path, monkeypatch):
  _WriteModel(tmp_path / 'a', 'mt/one.py', 'One')
  _WriteModel(tmp_path / 'b', 'asr/two.py', 'Two')
  monkeypatch.setenv(model_registry.ENV_VAR,
                     os.pathsep.join([str(tmp_path / 'a'), '', str(tmp_path / 'b')]))
  assert {'mt.one.One', 'asr.two.Two'} <= set(model_registry.GetAllRegisteredKeys())
  assert model_registry.GetParams('asr.two.Two', 'Train').input.batch_size == 32


def testImportingTheSameFilesAgainIsANoOp(tmp_path, monkeypatch):
  _WriteModel(tmp_path, 'mt/mine.py', 'Mine')
  model_registry.ImportParams(str(tmp_path))
  cls = model_registry.GetClass('mt.mine.Mine')
  model_registry.ImportParams(str(tmp_path) + os.sep)
  monkeypatch.chdir(tmp_path.parent)
  model_registry.ImportParams(tmp_path.name)  # A relative path.
  monkeypatch.setenv(model_registry.ENV_VAR, str(tmp_path))
  assert model_registry.GetClass('mt.mine.Mine') is cls  # Not executed again.


@pytest.fixture
def _PackageOnPath(tmp_path, monkeypatch):
  """A package `regtest_pkg.params` with domain `mt`, importable by name."""
  for package in ('regtest_pkg', 'regtest_pkg/params', 'regtest_pkg/params/mt'):
    _Write(tmp_path, f'{package}/__init__.py', '')
  _WriteModel(tmp_path, 'regtest_pkg/params/mt/mine.py', 'Mine')
  monkeypatch.syspath_prepend(str(tmp_path))
  yield tmp_path / 'regtest_pkg' / 'params'
  for name in [n for n in sys.modules if n.split('.')[0] == 'regtest_pkg']:
    del sys.modules[name]


def testSameFileByModuleNameByPathAndReloaded(_PackageOnPath):
  model_registry.ImportParams('regtest_pkg.params')
  cls = model_registry.GetClass('mt.mine.Mine')
  assert cls.__module__ == 'regtest_pkg.params.mt.mine'
  # The same file by path, then reloaded: the same key from the same file.
  model_registry.ImportParams(_PackageOnPath)
  importlib.reload(sys.modules['regtest_pkg.params.mt.mine'])
  reloaded = model_registry.GetClass('mt.mine.Mine')
  assert reloaded is sys.modules['regtest_pkg.params.mt.mine'].Mine
  assert reloaded is not cls


def testDuplicateKeyFromAnotherFileIsAnError(tmp_path):
  _WriteModel(tmp_path / 'a', 'mt/mine.py', 'Mine')
  second = _WriteModel(tmp_path / 'b', 'mt/mine.py', 'Mine')
  model_registry.ImportParams(tmp_path / 'a')
  with pytest.raises(ImportError) as e:
    model_registry.ImportParams(tmp_path / 'b')
  message = str(e.value)
  assert f'Params file {second} failed to import: ValueError' in message
  assert "key 'mt.mine.Mine'" in message and 'already registered by' in message
  assert str(tmp_path / 'a' / 'mt' / 'mine.py') in message


def testTwoModelsOfOneNameInOneFileAreAnError(tmp_path):
  """The second would silently replace the first (a reload replaces, as tested above)."""
  path = _WriteModel(tmp_path, 'mt/twice.py', 'Twice', 'Other', 'Twice')
  with pytest.raises(ImportError, match=f'{re.escape(str(path))} defines two models named Twice: '
                     "the second would replace the first under 'mt.twice.Twice'; rename one"):
    model_registry.ImportParams(tmp_path)


def testRegisteringFromAFunctionKeepsNothingAndOneClassTwiceIsFine(tmp_path):
  """A params file imported from a function keeps none of its locals alive (the check of
  names registered twice in one execution held the frames, and through them the callers'
  objects); one class registered twice, or from a function called twice, is no error."""
  import gc  # pylint: disable=g-import-not-at-top
  import weakref  # pylint: disable=g-import-not-at-top
  _WriteModel(tmp_path, 'mt/kept.py', 'Kept')

  class Big:
    pass

  def Load():
    big = Big()
    model_registry.ImportParams(tmp_path)
    return weakref.ref(big)

  ref = Load()
  gc.collect()
  assert ref() is None
  cls = model_registry.GetClass('mt.kept.Kept')
  assert model_registry.RegisterSingleTaskModel(cls) is cls

  def Define():
    return type('Kept', (cls,), {'__module__': cls.__module__})

  for _ in range(2):
    model_registry.RegisterSingleTaskModel(Define())


def testRegisterRejectsNonSubclasses():
  with pytest.raises(TypeError, match='expects a subclass of .*SingleTaskModelParams; got'):

    @model_registry.RegisterSingleTaskModel
    class NotAnExperiment:  # pylint: disable=unused-variable
      pass

  with pytest.raises(TypeError, match='got 3'):
    model_registry.RegisterSingleTaskModel(3)


@pytest.mark.parametrize('relative_path', ['top.py', 'mt/sub/deep.py'])
def testModelsMustSitInADomainFolder(tmp_path, relative_path):
  path = _WriteModel(tmp_path, relative_path, 'Mine')
  with pytest.raises(ImportError, match=re.escape(f'Params file {path} failed to import')) as e:
    model_registry.ImportParams(tmp_path)
  assert '<params root>/<domain>/<file>.py' in str(e.value)


def testModelsOutsideAParamsPackageAreRejected():
  with pytest.raises(ValueError, match='Cannot register Mine of .*model_registry_test'):

    @model_registry.RegisterSingleTaskModel
    class Mine(base_model_params.SingleTaskModelParams):  # pylint: disable=unused-variable
      pass


def testFileNamesMustBeIdentifiers(tmp_path):
  path = _WriteModel(tmp_path, 'mt/my-exp.py', 'Mine')
  with pytest.raises(ValueError, match=re.escape(f'Params file {path}: its folder and file')):
    model_registry.ImportParams(tmp_path)


def testUnknownKeyListsClosestKeys(tmp_path):
  _WriteModel(tmp_path, 'mt/mine.py', 'MineBase', 'MineBig')
  model_registry.ImportParams(tmp_path)
  with pytest.raises(LookupError,
                     match=r"key 'mt.mine.MineBsae'.*mt.mine.MineBase, mt.mine.MineBig"):
    model_registry.GetParams('mt.mine.MineBsae', 'Train')
  with pytest.raises(LookupError, match='None of the .* registered keys is close'):
    model_registry.GetClass('zzzzzzzzzzzzzzzzzzzzzzzzzz')


@pytest.mark.parametrize('source', ['/no/such/dir', 'no_such_module_xyz', 'a..b', ''])
def testBadSourcesAreErrors(source, monkeypatch):
  with pytest.raises(ValueError, match=f'Params source {re.escape(repr(source))} is neither'):
    model_registry.ImportParams(source)
  if source:
    monkeypatch.setenv(model_registry.ENV_VAR, source)
    with pytest.raises(ValueError, match=f'^{model_registry.ENV_VAR}: Params source'):
      model_registry.GetAllRegisteredKeys()


def testBadDatasetIsAnErrorListingTheAllowedOnes(tmp_path):
  _WriteModel(tmp_path, 'mt/mine.py', 'Mine')
  model_registry.ImportParams(tmp_path)
  for dataset in ('Eval', None):
    with pytest.raises(ValueError, match=f'Unknown dataset {dataset!r}: expected one of '
                       r'Train, Dev, Test \(case-insensitive\)'):
      model_registry.GetParams('mt.mine.Mine', dataset)


def testGetParamsSetsInputAndReturnsADeepCopy(tmp_path):
  _WriteModel(tmp_path, 'mt/mine.py', 'Mine')
  model_registry.ImportParams(tmp_path)
  p = model_registry.GetParams('mt.mine.Mine', 'train')
  assert (p.name, p.task.name, p.input.batch_size) == ('Mine', 'tiny', 32)
  assert p.train.max_steps > 0
  assert model_registry.GetParams('mt.mine.Mine', 'DEV').input.batch_size == 8
  assert model_registry.GetParams('mt.mine.Mine', 'Test').input.batch_size == 32  # Train's.
  p.task.dims.append(8)
  p.input.batch_size = 1
  p.train.max_steps = 1
  again = model_registry.GetParams('mt.mine.Mine', 'Train')
  assert (again.task.dims, again.input.batch_size) == ([4, 4], 32)
  assert again.train.max_steps != 1


def testBrokenParamsFileNamesTheFileAndTheError(tmp_path, monkeypatch, caplog):
  """A key of a broken file raises the file's error; other keys, of the same directory too,
  are found with a warning naming it."""
  broken = _Write(tmp_path, 'mt/broken.py', "raise RuntimeError('boom')\n")
  _WriteModel(tmp_path, 'mt/zfine.py', 'Fine')  # Imported after the broken file.
  monkeypatch.setenv(model_registry.ENV_VAR, str(tmp_path))
  message = f'Params file {broken} failed to import: RuntimeError: boom'
  with pytest.raises(ImportError, match=re.escape(message)) as e:
    model_registry.GetClass('mt.broken.Fixed')
  assert isinstance(e.value.__cause__, RuntimeError)
  assert model_registry.GetClass('mt.zfine.Fine').__name__ == 'Fine'
  assert 'mt.zfine.Fine' in model_registry.GetAllRegisteredKeys()
  assert model_registry.GetParams('lm.synthetic.GPipeTransformerLmTiny', 'Train').task
  assert f'{message}; its models are not registered.' in caplog.text
  _Write(tmp_path, 'mt/broken.py', 'def Oops(:\n')
  with pytest.raises(ImportError, match=re.escape(f'Params file {broken} failed to import: '
                                                  'SyntaxError')):
    model_registry.GetClass('mt.broken.Fixed')
  with pytest.raises(LookupError, match="No model is registered under key 'mt.other.Fixed'. "
                     r'.* Params file .*broken.py failed to import: SyntaxError'):
    model_registry.GetClass('mt.other.Fixed')
  # A broken file of the same <domain>.<file> elsewhere does not hide a registered key.
  _Write(tmp_path, 'lm/synthetic.py', "raise RuntimeError('boom')\n")
  assert model_registry.GetClass('lm.synthetic.GPipeTransformerLmTiny').__module__ == (
      'lingvo_gpipe.params.lm.synthetic')
  _WriteModel(tmp_path, 'mt/broken.py', 'Fixed')  # Fixing the file is enough: nothing cached.
  assert 'mt.broken.Fixed' in model_registry.GetAllRegisteredKeys()
  assert model_registry.GetClass('mt.broken.Fixed').__name__ == 'Fixed'


def testBrokenPackageByModuleName(_PackageOnPath):
  _Write(_PackageOnPath, 'mt/broken.py', 'import regtest_missing_dependency\n')
  with pytest.raises(ImportError, match=re.escape(
      f"Params file {_PackageOnPath / 'mt' / 'broken.py'} failed to import: "
      "ModuleNotFoundError: No module named 'regtest_missing_dependency'")):
    model_registry.ImportParams('regtest_pkg.params')


def testDiscoveryWalksTheProjectPackage(_PackageOnPath, monkeypatch):
  monkeypatch.setattr(model_registry, '_PROJECT_PARAMS', 'regtest_pkg.params')
  assert 'mt.mine.Mine' in model_registry.GetAllRegisteredKeys()  # No ImportParams needed.
  assert model_registry.GetClass('mt.mine.Mine').__module__ == 'regtest_pkg.params.mt.mine'


def testProjectParamsAreDiscovered():
  keys = model_registry.GetAllRegisteredKeys()
  project_keys = [k for k in keys
                  if model_registry.GetClass(k).__module__.startswith('lingvo_gpipe.params.')]
  for key in project_keys:
    assert _KEY_RE.fullmatch(key), key
    module = model_registry.GetClass(key).__module__
    assert key == f'{module[len("lingvo_gpipe.params."):]}.{key.split(".")[-1]}'
  for info in pkgutil.walk_packages(lingvo_gpipe.params.__path__, 'lingvo_gpipe.params.'):
    assert info.name in sys.modules  # Every params module was imported.
