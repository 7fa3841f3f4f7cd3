"""Hierarchical, documented, freezable hyper-parameters (Lingvo's `Params`).

A `Params` is a tree of named values, each defined once with a doc string. Models
are configured by copying a template and setting values, then instantiated from
the frozen result, so a run's whole configuration is one printable, parseable text.
"""

import copy
import difflib
import re

from lingvo_gpipe.foundation import params_text

_NAME_RE = re.compile(r'^[a-z_][a-z0-9_]*$')
# One path component of a dotted key: `name` or `name[3]`.
_KEY_PART_RE = re.compile(r'^([a-z_][a-z0-9_]*)((?:\[\d+\])*)$')


class _Param:
  """One defined value with its doc string (and the types a text may set, or None)."""

  def __init__(self, name, value, doc, kinds=None):
    self.name = name
    self.value = value
    self.doc = doc
    self.kinds = kinds


def _SplitKeyPart(part, full_key):
  """'a[1][2]' -> ('a', [1, 2])."""
  m = _KEY_PART_RE.match(part)
  if not m:
    raise AttributeError(f'Malformed params key {full_key!r} at {part!r}.')
  indices = [int(i) for i in re.findall(r'\[(\d+)\]', m.group(2))]
  return m.group(1), indices


class Params:
  """A tree of defined hyper-parameters.

  Example:
    p = Params()
    p.Define('lr', 0.1, 'Learning rate.')
    p.lr = 0.2
    p.Set(**{'lr': 0.3})
  """

  def __init__(self):
    self.__dict__['_params'] = {}
    self.__dict__['_frozen'] = False

  # -- definition and access ------------------------------------------------

  def Define(self, name, default_value, description, kinds=None):
    """Defines `name`; every parameter must say what it is for.

    kinds: the types a text override (FromText) may give it, for a parameter that
    takes several, e.g. (int, list) for a count or a list; None: its value's type.
    """
    self._CheckNotFrozen(name)
    if not isinstance(name, str) or not _NAME_RE.match(name):
      raise ValueError(
          f'Params name {name!r} is invalid: expected a lower-case identifier '
          'matching ^[a-z_][a-z0-9_]*$.')
    if name in self._params:
      raise AttributeError(f'Params name {name!r} is already defined.')
    if name in _RESERVED_NAMES:
      raise AttributeError(f'Params name {name!r} is reserved (a Params method).')
    if kinds is not None:
      kinds = tuple(kinds)
      default_value = params_text.OfKinds(default_value, kinds, lambda why: ValueError(
          f'Params name {name!r}: default {default_value!r} is not one of its kinds '
          f"{', '.join(k.__name__ for k in kinds)} ({why})."))
    self._params[name] = _Param(name, default_value, description, kinds)

  def __getattr__(self, name):
    if name.startswith('__'):
      raise AttributeError(name)
    params = self.__dict__['_params']
    if name not in params:
      raise AttributeError(self._UnknownKeyMessage(name))
    return params[name].value

  def __setattr__(self, name, value):
    self._CheckNotFrozen(name)
    if name not in self._params:
      raise AttributeError(self._UnknownKeyMessage(name))
    self._params[name].value = value

  def __dir__(self):
    return sorted(self._params)

  def __contains__(self, name):
    return name in self._params

  def __len__(self):
    return len(self._params)

  def IsDefined(self, name):
    return name in self._params

  def Delete(self, *names):
    """Removes defined parameters; returns self."""
    for name in names:
      self._CheckNotFrozen(name)
      if name not in self._params:
        raise AttributeError(self._UnknownKeyMessage(name))
      del self._params[name]
    return self

  def IterParams(self):
    """(name, value) pairs in definition order."""
    for name, param in self._params.items():
      yield name, param.value

  def GetDoc(self, key):
    """The doc string given when `key` (dotted) was defined."""
    owner, last = self._LookUp(key)
    if last not in owner._params:
      raise AttributeError(owner._UnknownKeyMessage(last))
    return owner._params[last].doc

  def _UnknownKeyMessage(self, name):
    close = difflib.get_close_matches(name, list(self._params), n=3, cutoff=0.5)
    hint = f' Did you mean: {", ".join(close)}?' if close else ''
    return f'Unknown params key {name!r}.{hint} Defined: {sorted(self._params)}.'

  def _CheckNotFrozen(self, name):
    if self.__dict__['_frozen']:
      raise TypeError(f'This Params is frozen; cannot change {name!r}. '
                      'Copy() it to get a mutable version.')

  # -- dotted names ----------------------------------------------------------

  def _LookUp(self, key):
    """Resolves 'a.b[1].c' to (the Params owning 'c', 'c')."""
    parts = key.split('.')
    node = self
    for part in parts[:-1]:
      name, indices = _SplitKeyPart(part, key)
      node = getattr(node, name)
      for i in indices:
        node = node[i]
      if not isinstance(node, Params):
        raise AttributeError(f'Params key {key!r}: {part!r} is not a Params.')
    return node, parts[-1]

  def Get(self, key):
    """Value of a dotted key such as 'task.pipe.cell_tpl[0].name'."""
    owner, last = self._LookUp(key)
    name, indices = _SplitKeyPart(last, key)
    value = getattr(owner, name)
    for i in indices:
      value = value[i]
    return value

  def Set(self, **kwargs):
    """Sets dotted keys, e.g. p.Set(**{'a.b': 3}); returns self."""
    for key, value in kwargs.items():
      owner, last = self._LookUp(key)
      name, indices = _SplitKeyPart(last, key)
      if not indices:
        setattr(owner, name, value)
        continue
      owner._CheckNotFrozen(key)
      setattr(owner, name, _ReplaceAt(getattr(owner, name), indices, value, key))
    return self

  # -- copies, freezing, equality --------------------------------------------

  def Copy(self):
    """A deep, unfrozen copy."""
    return _CopyValue(self)

  def Freeze(self):
    """Makes this and every nested Params read-only; returns self."""
    self.__dict__['_frozen'] = True
    for _, value in self.IterParams():
      _ForEachParams(value, lambda p: p.Freeze())
    return self

  @property
  def is_frozen(self):
    return self.__dict__['_frozen']

  def __eq__(self, other):
    if not isinstance(other, Params) or type(self) is not type(other):
      return False
    return ({k: v.value for k, v in self._params.items()} ==
            {k: v.value for k, v in other._params.items()})

  def __ne__(self, other):
    return not self == other

  __hash__ = None

  def __deepcopy__(self, memo):
    return _CopyValue(self)

  # -- text ------------------------------------------------------------------

  def ToText(self):
    """Sorted 'a.b : value' lines that FromText reads back exactly."""
    return ''.join(f'{key} : {text}\n' for key, text in sorted(_TextItems(self, '')))

  def FromText(self, text):
    """Sets values from 'a.b : value' lines; types follow the current values."""
    for lineno, line in enumerate(text.splitlines(), 1):
      line = line.strip()
      if not line or line.startswith('#'):
        continue
      if ':' not in line:
        raise ValueError(f'Params text line {lineno} {line!r}: expected "key : value".')
      key, value_text = (s.strip() for s in line.split(':', 1))
      try:
        current = self.Get(key)
      except (AttributeError, IndexError, TypeError) as e:
        raise AttributeError(f'Params text line {lineno}: {e}{self._ElsewhereHint(key)}') from None
      if isinstance(current, Params):
        raise ValueError(f'Params key {key!r} is a group of params, not a value: set its keys '
                         f'({key}.<name> : value), not {key} : {value_text}.')
      value = params_text.ParseValue(value_text, current, key, self._Kinds(key))
      self._CheckClassSwap(key, value, lineno)
      self.Set(**{key: value})
    return self

  def _CheckClassSwap(self, key, cls, lineno):
    """Refuses a text `x.cls : Other` whose class defines params x lacks: the text sets
    values, it cannot add params to x (its params class can: x = Other.Params()). Params x
    holds beyond Other's are left unread (Adam's betas under SGD)."""
    owner, last = self._LookUp(key)
    if last != 'cls' or not isinstance(cls, type) or not hasattr(cls, 'Params'):
      return
    lacking = sorted(set(cls.Params()._params) - set(owner._params))
    if lacking:
      parent = key.rpartition('.')[0] or 'the params'
      raise ValueError(
          f'Params text line {lineno}: {key} : {cls.__name__} reads params {lacking} that '
          f'{parent} lacks: set {parent} = {cls.__name__}.Params() in the params class instead.')

  def _Kinds(self, key):
    """The types Define gave a dotted key, or None (an indexed key: its value's type)."""
    owner, last = self._LookUp(key)
    name, indices = _SplitKeyPart(last, key)
    return None if indices else owner._params[name].kinds

  def _ElsewhereHint(self, key):
    """' Did you mean ...?' naming defined keys that end with `key` or that `key` ends with:
    the same name under another parent, as Lingvo's task.train.max_steps for train.max_steps."""
    keys = [k for k, _ in _TextItems(self, '')]
    similar = [k for k in keys if k.endswith(f'.{key}') or key.endswith(f'.{k}')]
    return f' Did you mean {" or ".join(similar)}?' if similar else ''

  def __str__(self):
    return self.ToText()

  def __repr__(self):
    return f'{type(self).__name__}(\n{self.ToText()})'


_RESERVED_NAMES = frozenset(n for n in dir(Params) if not n.startswith('_'))


class InstantiableParams(Params):
  """Params that know the class they configure: `p.Instantiate()` builds it."""

  def __init__(self, cls=None):
    super().__init__()
    self.Define('cls', cls, 'The class these params instantiate.')

  def Instantiate(self, *args, **kwargs):
    if self.cls is None:
      raise ValueError('InstantiableParams.cls is None; nothing to instantiate.')
    return self.cls(self, *args, **kwargs)


# -- helpers: recursion over values --------------------------------------------


def _ForEachParams(value, fn):
  if isinstance(value, Params):
    fn(value)
  elif isinstance(value, (list, tuple)):
    for v in value:
      _ForEachParams(v, fn)
  elif isinstance(value, dict):
    for v in value.values():
      _ForEachParams(v, fn)


def _CopyValue(value):
  if isinstance(value, Params):
    new = type(value).__new__(type(value))
    new.__dict__['_params'] = {
        k: _Param(k, _CopyValue(p.value), p.doc, p.kinds) for k, p in value._params.items()}
    new.__dict__['_frozen'] = False
    return new
  if isinstance(value, list):
    return [_CopyValue(v) for v in value]
  if isinstance(value, tuple) and not hasattr(value, '_fields'):
    return tuple(_CopyValue(v) for v in value)
  if isinstance(value, dict):
    return type(value)((k, _CopyValue(v)) for k, v in value.items())
  if isinstance(value, (set, bytearray)) or type(value).__module__ == 'numpy':
    return copy.deepcopy(value)
  return value  # Immutable, a class, a function or a dtype: shared.


def _ReplaceAt(container, indices, value, key):
  """`container` with container[i0][i1]... = value; tuples are rebuilt."""
  if not isinstance(container, (list, tuple)):
    raise AttributeError(f'Params key {key!r}: indexing a non-list value.')
  i = indices[0]
  if not 0 <= i < len(container):
    raise IndexError(f'Params key {key!r}: index {i} out of range (len {len(container)}).')
  items = list(container)
  items[i] = value if len(indices) == 1 else _ReplaceAt(items[i], indices[1:], value, key)
  return items if isinstance(container, list) else type(container)(items)


# -- text serialization ---------------------------------------------------------


def _TextItems(value, prefix):
  """(key, text) pairs; lists holding Params expand into indexed keys. A Params deeper in a
  value (a dict's) has no text."""
  if isinstance(value, Params):
    items = []
    for name, v in value.IterParams():
      items += _TextItems(v, f'{prefix}.{name}' if prefix else name)
    return items
  if isinstance(value, (list, tuple)) and any(isinstance(v, Params) for v in value):
    items = []
    for i, v in enumerate(value):
      items += _TextItems(v, f'{prefix}[{i}]')
    return items
  nested = []
  _ForEachParams(value, nested.append)
  if nested:
    raise ValueError('A Params inside a dict cannot be written as text.')
  return [(prefix, params_text.ValueToText(value))]
