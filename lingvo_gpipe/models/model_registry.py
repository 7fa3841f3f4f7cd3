"""Finds experiments (SingleTaskModelParams subclasses) by key.

A params file registers its experiments with a decorator:

  # params/lm/my_lm.py
  from lingvo_gpipe.models import base_model_params
  from lingvo_gpipe.models import model_registry

  @model_registry.RegisterSingleTaskModel
  class TinyLm(base_model_params.SingleTaskModelParams):
    ...

and a trainer asks for them by key, `<domain>.<file>.<ClassName>`:

  p = model_registry.GetParams('lm.my_lm.TinyLm', 'Train')

The key is the class's place below the params root: the part of its module name
after the first component named `params` (so `lingvo_gpipe.params.lm.my_lm`
gives `lm.my_lm`), or, for a file of a user's params directory, the file's path
relative to that directory. Keys do not depend on where anything is installed.

Lookups import the params first, so nobody has to import them by hand:
  * every module of the `lingvo_gpipe.params` package (each domain folder needs
    an `__init__.py` and an entry in pyproject's `packages` to be found);
  * the directories or dotted module names listed, separated by os.pathsep, in
    the environment variable LINGVO_GPIPE_PARAMS;
  * anything passed to ImportParams().
Importing is idempotent, so the same params may be named several times. A
params file that fails to import costs only its own models: a lookup of another
key warns of it and goes on; a lookup of a key of that file raises its error.
"""

import difflib
import hashlib
import importlib
import importlib.util
import os
import pkgutil
import sys
import weakref

from absl import logging

from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.models import base_model_params

ENV_VAR = 'LINGVO_GPIPE_PARAMS'
_PROJECT_PARAMS = 'lingvo_gpipe.params'

# Key -> registered SingleTaskModelParams subclass.
_REGISTRY = {}
# Key -> a weak reference to the module code (a params file's execution) that registered
# it: a reload or another import of the file runs new code; weak, so that it keeps nothing.
_REGISTERED_BY = {}
# Import errors of params files already warned of.
_WARNED = set()


def _FileOf(cls):
  return getattr(sys.modules.get(cls.__module__), '__file__', None)


def _SourceOf(cls):
  """The file defining `cls`, else its module name: what error messages show."""
  return _FileOf(cls) or cls.__module__


def _KeyOf(cls):
  parts = cls.__module__.split('.')
  below = parts[parts.index('params') + 1:] if 'params' in parts else []
  if len(below) != 2:
    raise ValueError(
        f'Cannot register {cls.__name__} of {_SourceOf(cls)}: models must be defined in '
        'a params file <params root>/<domain>/<file>.py, giving the key '
        '<domain>.<file>.<ClassName>.')
  return '.'.join(below + [cls.__name__])


def _IsSameFile(cls_a, cls_b):
  file_a, file_b = _FileOf(cls_a), _FileOf(cls_b)
  return bool(file_a and file_b) and os.path.realpath(file_a) == os.path.realpath(file_b)


def RegisterSingleTaskModel(cls):
  """Class decorator: registers an experiment under `<domain>.<file>.<ClassName>`.

  Registering a class again from the same file (a module imported twice, e.g.
  by package name and by path, or reloaded) replaces the entry, as re-executing
  a module rebinds its names; the same key from another file, or twice in one
  execution of a file (two classes of one name), is an error.
  """
  if not (isinstance(cls, type) and issubclass(cls, base_model_params.SingleTaskModelParams)):
    raise TypeError('RegisterSingleTaskModel expects a subclass of '
                    f'base_model_params.SingleTaskModelParams; got {cls!r}.')
  key = _KeyOf(cls)
  old = _REGISTRY.get(key)
  if old is not None and not _IsSameFile(old, cls):
    raise ValueError(f'Model key {key!r} of {_SourceOf(cls)} is already registered by '
                     f'{_SourceOf(old)}.')
  code = sys._getframe(1).f_code  # pylint: disable=protected-access
  registered_by = _REGISTERED_BY.get(key)
  if old not in (None, cls) and registered_by is not None and registered_by() is code:
    raise ValueError(f'{_SourceOf(cls)} defines two models named {cls.__name__}: the second '
                     f'would replace the first under {key!r}; rename one.')
  _REGISTRY[key] = cls
  if code.co_name == '<module>':  # A function's code runs again for each call: no check.
    _REGISTERED_BY[key] = weakref.ref(code)
  else:
    _REGISTERED_BY.pop(key, None)
  return cls


# -- importing params -------------------------------------------------------------


def _ImportModule(name):
  """Imports module `name`; a failure names the module's file and the cause."""
  try:
    spec = importlib.util.find_spec(name)
  except Exception as e:
    # A missing parent package means there is no such module; anything else,
    # such as a parent importing a missing dependency, is a broken parent.
    if not (isinstance(e, ModuleNotFoundError) and f'{name}.'.startswith(f'{e.name}.')):
      raise ImportError(f'Params module {name} failed to import: {type(e).__name__}: {e}',
                        name=name) from e
    spec = None
  if spec is None:
    raise ValueError(f'Params source {name!r} is neither a directory nor an importable '
                     'module name.')
  try:
    return importlib.import_module(name)
  except Exception as e:
    raise ImportError(f'Params file {spec.origin or name} failed to import: '
                      f'{type(e).__name__}: {e}', name=name, path=spec.origin) from e


def _Collect(errors, import_fn, *args):
  """import_fn(*args); its ImportError is appended to `errors` if that is a list, else raised."""
  try:
    import_fn(*args)
  except ImportError as e:
    if errors is None:
      raise
    errors.append(e)


def _ImportModuleTree(name, errors=None):
  """Imports module `name` and, if it is a package, every module below it; a module that
  fails stops the import, or with a list `errors`, is appended to it and skipped."""
  module = _ImportModule(name)
  if hasattr(module, '__path__'):
    for info in pkgutil.iter_modules(module.__path__, name + '.'):
      _Collect(errors, _ImportModuleTree, info.name, errors)


def _ImportFile(root, package, path):
  """Imports params file `path` of directory `root` as module `package`.<relative path>."""
  relative = os.path.splitext(os.path.relpath(path, root))[0].split(os.sep)
  if relative[-1] == '__init__':
    relative.pop()
  if not all(part.isidentifier() for part in relative):
    raise ValueError(f'Params file {path}: its folder and file names must be Python '
                     'identifiers, since they form the model key.')
  name = '.'.join([package] + relative)
  if name in sys.modules:
    return
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[name] = module
  try:
    spec.loader.exec_module(module)
  except Exception as e:
    del sys.modules[name]
    raise ImportError(f'Params file {path} failed to import: {type(e).__name__}: {e}',
                      name=name, path=path) from e


def _ImportDirectory(directory, errors=None):
  root = os.path.realpath(directory)
  # A module name unique to the directory, so it cannot shadow or be shadowed by
  # installed packages and a second import of the directory is a no-op. Its last
  # component `params` makes keys start at the directory's domain folders.
  digest = hashlib.sha1(root.encode()).hexdigest()[:16]
  package = f'_lingvo_gpipe_params_dir_{digest}.params'
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if not d.startswith('.'))
    for filename in sorted(filenames):
      if filename.endswith('.py'):
        _Collect(errors, _ImportFile, root, package, os.path.join(dirpath, filename))


def ImportParams(path_or_module_name, errors=None):
  """Imports the experiments of a params directory or a (dotted) module or package.

  A directory's .py files are imported by path, each under a module name unique
  to the directory (so they are no package: they cannot import each other
  relatively); a package is imported with every module below it. A file that
  fails to import raises its ImportError, or, given a list `errors`, is appended
  to it while the other files are imported.
  """
  source = os.fspath(path_or_module_name)
  if os.path.isdir(source):
    _ImportDirectory(source, errors)
  elif source and all(part.isidentifier() for part in source.split('.')):
    _Collect(errors, _ImportModuleTree, source, errors)
  else:
    raise ValueError(f'Params source {source!r} is neither a directory nor a dotted '
                     'module name.')


def _Discover():
  """Imports the project's params and those named by the environment variable; returns the
  ImportErrors of the params files that failed (the others are imported all the same)."""
  errors = []
  _ImportModuleTree(_PROJECT_PARAMS, errors)
  for source in os.environ.get(ENV_VAR, '').split(os.pathsep):
    if source:
      try:
        ImportParams(source, errors)
      except ValueError as e:
        raise ValueError(f'{ENV_VAR}: {e}') from None
  return errors


def _WarnOf(errors):
  """Warns once per process of each params file's import error."""
  for e in errors:
    if str(e) not in _WARNED:
      _WARNED.add(str(e))
      logging.warning('%s; its models are not registered.', e)


# -- lookups --------------------------------------------------------------------


def GetAllRegisteredKeys():
  """Sorted keys of every registered experiment (a params file that fails to import is
  warned of)."""
  _WarnOf(_Discover())
  return sorted(_REGISTRY)


def GetClass(key):
  """The SingleTaskModelParams subclass registered under `key`.

  A params file that failed to import is warned of. For a key not registered, a failed
  file that would have registered it (its module name ends in the key's `<domain>.<file>`)
  raises its ImportError; else the LookupError names the files that failed.
  """
  errors = _Discover()
  if key not in _REGISTRY:
    module = str(key).rpartition('.')[0]
    own = [e for e in errors if module and f'.{e.name}'.endswith(f'.{module}')]
    if own:
      raise own[0]
    close = difflib.get_close_matches(str(key), list(_REGISTRY), n=5, cutoff=0.5)
    hint = (f'Closest registered keys: {", ".join(close)}.' if close else
            f'None of the {len(_REGISTRY)} registered keys is close; see GetAllRegisteredKeys().')
    failed = ''.join(f' {e}.' for e in errors)
    raise LookupError(f'No model is registered under key {key!r}. {hint}{failed}')
  _WarnOf(errors)
  return _REGISTRY[key]


def GetDescription(key):
  """The first line of the docstring of the class registered under `key`; '' without one."""
  lines = (GetClass(key).__doc__ or '').strip().splitlines()  # Classes do not inherit __doc__.
  return lines[0] if lines else ''


def GetParams(key, dataset):
  """Model() params of experiment `key`, with `input` set to `dataset`'s input params.

  `dataset` is one of base_model_params.DATASETS, in any case. The result is a
  deep copy the caller may change freely.
  """
  method = dataset.capitalize() if isinstance(dataset, str) else None
  if method not in base_model_params.DATASETS:
    raise ValueError(f'Unknown dataset {dataset!r}: expected one of '
                     f'{", ".join(base_model_params.DATASETS)} (case-insensitive).')
  experiment = GetClass(key)()
  model = experiment.Model()
  if not (isinstance(model, hyperparams.Params) and 'input' in model):
    raise TypeError(f'{key}: Model() must return a hyperparams.Params defining `input`; '
                    f'got {model!r}.')
  input_params = getattr(experiment, method)()
  if not isinstance(input_params, hyperparams.Params):
    raise TypeError(f'{key}: {method}() must return a hyperparams.Params; '
                    f'got {input_params!r}.')
  model = model.Copy()
  model.input = input_params.Copy()
  return model
