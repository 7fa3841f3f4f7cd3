"""The package layout's rule: a sub-package imports only itself and the packages below it,
and no library module imports a facade (the Lingvo paths in core/ and the top-level
modules). Read from the source, so a function-level import counts too."""

import ast
import importlib
import pathlib

import pytest

import lingvo_gpipe

# Lowest first: a package may import the ones before it, never the ones after.
LAYERS = ['foundation', 'inputs', 'layers', 'pipeline', 'insight', 'training', 'models',
          'distribution', 'runners']
ROOT = pathlib.Path(lingvo_gpipe.__file__).parent


def _Imports(path):
  """The lingvo_gpipe modules and packages a file imports (`from a import b` gives a.b)."""
  out = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.ImportFrom) and (node.module or '').startswith('lingvo_gpipe'):
      out.update(f'{node.module}.{a.name}' for a in node.names)
    elif isinstance(node, ast.Import):
      out.update(a.name for a in node.names if a.name.startswith('lingvo_gpipe'))
  return out


def _Package(dotted):
  """The sub-package of 'lingvo_gpipe.<pkg>...', or None for a facade or the root."""
  parts = dotted.split('.')
  return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def _LibraryFiles():
  return [f for pkg in LAYERS for f in sorted((ROOT / pkg).glob('*.py'))]


def testEveryModuleIsInAPackageOrAFacade():
  facades = {'__init__', 'trainer', 'model_registry', 'base_model_params', 'keras_pipeline',
             'estimator'}
  top = {f.stem for f in ROOT.glob('*.py')}
  assert top == facades
  assert {d.name for d in ROOT.iterdir() if d.is_dir() and (d / '__init__.py').exists()} == (
      set(LAYERS) | {'core'})


@pytest.mark.parametrize('path', _LibraryFiles(), ids=lambda p: f'{p.parent.name}/{p.name}')
def testImportsRunDownward(path):
  own = LAYERS.index(path.parent.name)
  for dotted in _Imports(path):
    pkg = _Package(dotted)
    assert pkg is not None, f'{path} imports the facade or root {dotted}'
    assert LAYERS.index(pkg) <= own, f'{path} ({LAYERS[own]}) imports {dotted} ({pkg}), above it'


def testTheRuleCatchesAnUpwardImport(tmp_path):
  bad = tmp_path / 'x.py'
  bad.write_text('def F():\n  from lingvo_gpipe.runners import trainer\n')
  assert _Package(next(iter(_Imports(bad)))) == 'runners'


@pytest.mark.parametrize('facade, target, name', [
    ('core.gpipe', 'pipeline.gpipe', 'PipeliningLayer'),
    ('core.layers', 'layers.basic', 'ProjectionLayer'),
    ('core.base_layer', 'foundation.base_layer', 'BaseLayer'),
    ('core.hyperparams', 'foundation.hyperparams', 'Params'),
    ('core.py_utils', 'foundation.py_utils', 'NestedMap'),
    ('core.schedule', 'pipeline.schedule', 'Schedule'),
    ('trainer', 'runners.trainer', 'Main'),
    ('model_registry', 'models.model_registry', 'RegisterSingleTaskModel'),
    ('base_model_params', 'models.base_model_params', 'SingleTaskModelParams'),
    ('keras_pipeline', 'runners.keras_pipeline', 'PipelineModel'),
    ('estimator', 'runners.estimator', 'Estimator'),
])
def testFacadesReExportLingvoPaths(facade, target, name):
  a = importlib.import_module(f'lingvo_gpipe.{facade}')
  b = importlib.import_module(f'lingvo_gpipe.{target}')
  assert getattr(a, name) is getattr(b, name)


def testTheErrorsModuleImportsNoTensorFlow():
  """Binaries and tools import foundation.errors before binaries.QuietTensorFlow, which must
  run before TensorFlow loads (else every healthy run prints TensorFlow's start-up lines)."""
  tree = ast.parse((ROOT / 'foundation' / 'errors.py').read_text())
  top = [a.name for node in tree.body if isinstance(node, ast.Import) for a in node.names]
  top += [node.module for node in tree.body if isinstance(node, ast.ImportFrom)]
  assert not any(name.startswith('tensorflow') for name in top), top
