"""The params text format for one value: ValueToText writes a value as Python-like text,
ParseValue reads it back into the kind the param holds, naming classes, functions and dtypes
only of modules the program imported. Separate from the Params tree (hyperparams.py), which
writes and reads its 'a.b : value' lines through it; this module knows no Params.
"""

import ast
import importlib
import inspect
import sys

from lingvo_gpipe.foundation import moved_names


def ValueToText(value):
  """Python-like text for a value; ParseValue inverts it."""
  if value is None or isinstance(value, (bool, int, str, bytes)):
    return repr(value)
  if isinstance(value, float):
    return repr(value)  # Shortest text that round-trips exactly ('inf' too).
  if isinstance(value, list):
    return '[' + ', '.join(ValueToText(v) for v in value) + ']'
  if isinstance(value, tuple):
    inner = ', '.join(ValueToText(v) for v in value)
    return f'({inner},)' if len(value) == 1 else f'({inner})'
  if isinstance(value, dict):
    return '{' + ', '.join(f'{ValueToText(k)}: {ValueToText(v)}' for k, v in value.items()) + '}'
  if _IsDType(value):
    return f'tf.{value.name}'
  if isinstance(value, type) or callable(value):
    module = getattr(value, '__module__', None)
    qualname = getattr(value, '__qualname__', None)
    if module and qualname and '<' not in qualname:
      return f'{module}.{qualname}'
  return repr(value)


def _IsDType(value):
  return type(value).__name__ == 'DType' and hasattr(value, 'as_numpy_dtype')


def _Resolve(dotted, may_import):
  """The object 'pkg.mod.Class.attr' (or 'tf.float32') names, found in the modules this
  program has imported; a text never runs a new top-level module (a file in the working
  directory), and imports a submodule of an imported package only if `may_import`. A name of
  an earlier layout reads as where it lives now (moved_names.py)."""
  parts = moved_names.Current(dotted).split('.')
  if parts[0] == 'tf':
    parts[0] = 'tensorflow'
  if parts[0] not in sys.modules:
    raise ValueError(f'module {parts[0]!r} is not imported: a params text names classes, '
                     'functions and dtypes of modules the program has imported')
  obj = sys.modules[parts[0]]
  for i, attr in enumerate(parts[1:], 2):
    name = '.'.join(parts[:i])
    if inspect.ismodule(obj) and not hasattr(obj, attr):
      if may_import and name not in sys.modules:
        try:
          importlib.import_module(name)
        except ImportError:
          pass
      if name in sys.modules:
        obj = sys.modules[name]
        continue
    if not hasattr(obj, attr):
      raise ValueError(f'{".".join(parts[:i - 1])!r} has no {attr!r}')
    obj = getattr(obj, attr)
  return obj


def _LingvoRoot(cls):
  """The most basic class of `cls` that defines Params (BaseLayer, BaseInputGenerator, ...):
  the kind a class-valued param keeps; object for other classes."""
  return next((c for c in reversed(cls.__mro__) if 'Params' in vars(c)), object)


def _CheckNameFor(value, current, kinds, dotted):
  """Refuses a named object that is not of the kind the param holds: a class for a class
  (of the same Lingvo kind), a function for a function, a dtype for a dtype."""
  if isinstance(current, type) or (kinds and type in kinds):
    root = _LingvoRoot(current) if isinstance(current, type) else object
    if not (isinstance(value, type) and issubclass(value, root)):
      raise ValueError(f'{dotted!r} is not a class of kind {root.__name__}')
  elif _IsDType(current) and not _IsDType(value):
    raise ValueError(f'{dotted!r} is not a dtype')
  elif callable(current) and (isinstance(value, type) or not callable(value)):
    raise ValueError(f'{dotted!r} is not a function')


def _EvalNode(node, resolve):
  """A safe evaluator for literal text plus dotted names, which resolve(dotted) looks up."""
  if isinstance(node, ast.Constant):
    return node.value
  if isinstance(node, ast.List):
    return [_EvalNode(e, resolve) for e in node.elts]
  if isinstance(node, ast.Tuple):
    return tuple(_EvalNode(e, resolve) for e in node.elts)
  if isinstance(node, ast.Dict):
    return {_EvalNode(k, resolve): _EvalNode(v, resolve) for k, v in zip(node.keys, node.values)}
  if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    operand = _EvalNode(node.operand, resolve)
    if isinstance(operand, (int, float)) and not isinstance(operand, bool):
      return -operand if isinstance(node.op, ast.USub) else operand
  if isinstance(node, ast.Name):
    if node.id in ('inf', 'nan'):
      return float(node.id)
    if node.id in ('true', 'false'):
      return node.id == 'true'
  if isinstance(node, ast.Name):
    raise ValueError(f'bare word {node.id!r}: quote a string, or name a class or dtype by its '
                     "module ('tf.float32', 'lingvo_gpipe.layers.ProjectionLayer')")
  if isinstance(node, ast.Attribute):
    value = resolve(ast.unparse(node))
    if inspect.ismodule(value):
      raise ValueError(f'{ast.unparse(node)!r} is a module; expected a class, function or '
                       'dtype in it')
    return value
  raise ValueError(f'unsupported syntax {ast.unparse(node)!r}')


def ParseValue(text, current, key='value', kinds=None):
  """Parses `text` into a value of the same kind as `current`, or of one of `kinds`."""
  expected = ' or '.join(k.__name__ for k in kinds) if kinds else type(current).__name__

  def Fail(why):
    return ValueError(f'Params key {key!r}: cannot parse {text!r} as {expected} ({why}).')

  quoted = text[:1] in ('"', "'") and text[-1:] == text[:1]
  resolve = _Resolver(current, kinds)
  if kinds:
    try:
      return _CheckInt(OfKinds(_Eval(text, Fail, resolve), kinds, Fail), Fail)
    except ValueError:
      if str in kinds and not quoted:
        return text  # Unquoted strings are accepted as they are.
      raise
  if isinstance(current, str) and not quoted:
    return text
  value = _CheckInt(_Eval(text, Fail, resolve), Fail)
  if current is None or value is None:
    return value
  if isinstance(current, bool):
    if not isinstance(value, bool):
      raise Fail('expected True or False')
    return value
  if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
    return float(value)
  if isinstance(current, (int, float, str)) and type(value) is not type(current):
    raise Fail(f'got {type(value).__name__}')
  if isinstance(current, tuple) and isinstance(value, list):
    return tuple(value)
  if isinstance(current, list) and isinstance(value, tuple):
    return list(value)
  return value


def _Resolver(current, kinds):
  """resolve(dotted) for a param holding `current`: names are looked up (and submodules
  imported) only for a class-valued param; numbers and strings take no names."""
  takes_class = isinstance(current, type) or bool(kinds and type in kinds)
  takes = bool(kinds) or not isinstance(current, (bool, int, float, str))

  def Resolve(dotted):
    if not takes:
      raise ValueError(f'{dotted!r} names an object, and the value is a {type(current).__name__}')
    value = _Resolve(dotted, may_import=takes_class)
    _CheckNameFor(value, current, kinds, dotted)
    return value

  return Resolve


_INT64_LIMIT = 2**63


def _CheckInt(value, fail):
  """`value`, unless it is an int no 64-bit integer holds (no TensorFlow op takes it)."""
  if type(value) is int and not -_INT64_LIMIT <= value < _INT64_LIMIT:
    raise fail('out of the 64-bit integer range')
  return value


def _Eval(text, fail, resolve):
  """The Python literal (or named object) `text` spells; fail(why) if none."""
  try:
    return _EvalNode(ast.parse(text, mode='eval').body, resolve)
  except (SyntaxError, ValueError, AttributeError) as e:
    raise fail(e) from None
  except (RecursionError, MemoryError):
    raise fail('nested too deeply') from None


def OfKinds(value, kinds, fail):
  """`value` (a tuple as a list where only lists are taken) if it is one of `kinds`."""
  if isinstance(value, tuple) and list in kinds and tuple not in kinds:
    value = list(value)
  if type(value) is int and float in kinds and int not in kinds:
    value = float(value)
  if value is None or (isinstance(value, kinds) and
                       not (isinstance(value, bool) and bool not in kinds)):
    return value
  raise fail(f'got {type(value).__name__}')
