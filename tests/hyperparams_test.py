"""Tests of lingvo_gpipe.foundation.hyperparams."""

import re
import sys

import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import hyperparams


class _Thing:
  """A class referenced from params text."""


def _Nested():
  inner = hyperparams.Params()
  inner.Define('width', 8, 'Width.')
  inner.Define('act', 'relu', 'Activation.')
  p = hyperparams.Params()
  p.Define('lr', 0.1, 'Learning rate.')
  p.Define('steps', 100, 'Steps.')
  p.Define('inner', inner, 'A nested params.')
  return p


def testDefineGetSet():
  p = _Nested()
  assert p.lr == 0.1
  p.lr = 0.5
  assert p.Get('lr') == 0.5
  assert p.Set(**{'inner.width': 16, 'steps': 7}) is p
  assert p.inner.width == 16 and p.steps == 7
  assert p.Get('inner.act') == 'relu'
  assert p.IsDefined('lr') and not p.IsDefined('nope')
  assert p.GetDoc('inner.width') == 'Width.'


@pytest.mark.parametrize('name', ['Bad', '1x', 'a-b', ''])
def testDefineRejectsBadNames(name):
  with pytest.raises(ValueError, match='invalid'):
    hyperparams.Params().Define(name, 1, 'doc')


def testRedefineIsAnError():
  p = _Nested()
  with pytest.raises(AttributeError, match='already defined'):
    p.Define('lr', 1.0, 'again')


def testUnknownKeySuggestsCloseNames():
  p = _Nested()
  with pytest.raises(AttributeError, match='Did you mean: steps'):
    _ = p.stepz
  with pytest.raises(AttributeError, match='Did you mean: width'):
    p.Set(**{'inner.widht': 3})


def testDelete():
  p = _Nested()
  p.Delete('steps')
  assert not p.IsDefined('steps')
  with pytest.raises(AttributeError):
    p.Delete('steps')


def testCopyIsDeep():
  p = _Nested()
  q = p.Copy()
  q.inner.width = 99
  assert p.inner.width == 8
  assert p == _Nested() and q != p


def testFreezeIsDeep():
  p = _Nested().Freeze()
  with pytest.raises(TypeError, match='frozen'):
    p.lr = 1.0
  with pytest.raises(TypeError, match='frozen'):
    p.inner.width = 1
  q = p.Copy()
  q.inner.width = 1  # Copies are mutable again.
  assert q.inner.width == 1


def testListOfParamsIndexedKeys():
  p = hyperparams.Params()
  p.Define('cells', [_Nested(), _Nested()], 'Cells.')
  p.Set(**{'cells[1].inner.width': 3})
  assert p.Get('cells[1].inner.width') == 3
  assert p.cells[0].inner.width == 8
  assert 'cells[1].inner.width : 3' in p.ToText()


def _AllKinds():
  p = hyperparams.Params()
  p.Define('i', -3, '')
  p.Define('f', 0.1 + 0.2, '')
  p.Define('big', 1e300, '')
  p.Define('inf', float('inf'), '')
  p.Define('s', 'it\'s "quoted"\nline', '')
  p.Define('b', True, '')
  p.Define('n', None, '')
  p.Define('l', [1, 2.5, 'x', [None]], '')
  p.Define('t', (1, ('a',)), '')
  p.Define('d', {'a': 1, 'b': [2, 3]}, '')
  p.Define('dt', tf.bfloat16, '')
  p.Define('cls', _Thing, '')
  p.Define('fn', tf.nn.relu, '')
  p.Define('sub', _Nested(), '')
  p.Define('subs', [_Nested(), _Nested()], '')
  return p


def _Mutated():
  """A copy of _AllKinds with every value changed."""
  q = _AllKinds()
  q.Set(i=7, f=2.0 / 3.0, big=-1e-300, inf=float('-inf'), s='other', b=False, n=[1],
        l=[], t=(2,), d={}, dt=tf.int32, cls=hyperparams.Params, fn=tf.math.tanh)
  q.Set(**{'sub.inner.width': 5, 'subs[1].lr': 1e-4})
  return q


def testTextRoundTripIsExact():
  p = _AllKinds()
  q = _Mutated()
  assert p != q
  text = q.ToText()
  assert text.splitlines() == sorted(text.splitlines())
  p.FromText(text)
  assert p == q
  assert p.dt is tf.int32 and p.cls is hyperparams.Params and p.fn is tf.math.tanh
  assert isinstance(p.t, tuple) and p.subs[1].lr == 1e-4


def testFromTextTypesFollowCurrentValues():
  p = _Nested()
  p.FromText('lr : 1\nsteps : 5\ninner.act : gelu\n')
  assert isinstance(p.lr, float) and p.lr == 1.0
  assert p.inner.act == 'gelu'


@pytest.mark.parametrize('line', ['steps : abc', 'steps : 1.5', 'lr : [1'])
def testFromTextBadValueNamesKeyAndText(line):
  p = _Nested()
  key, text = (s.strip() for s in line.split(':'))
  with pytest.raises(ValueError) as e:
    p.FromText(line)
  assert repr(key) in str(e.value) and repr(text) in str(e.value)


def testFromTextTakesTheKindsAParamIsDefinedWith():
  """A count or a list of ends, as a stack's splits: both parse; others are refused."""
  p = hyperparams.Params()
  p.Define('splits', 1, 'A count or end indices.', kinds=(int, list))
  p.Define('count', 1, 'A count.')
  p.FromText('splits : [1, 2, 4]')
  assert p.splits == [1, 2, 4]
  # Kinds survive a copy; a tuple reads as a list.
  assert p.Copy().FromText('splits : (2, 4)').splits == [2, 4]
  p.FromText('splits : 3')
  assert p.splits == 3
  for line, got in (('splits : 2.5', 'float'), ('splits : True', 'bool'),
                    ("splits : 'a'", 'str'), ('count : [1, 2]', 'list')):
    expected = 'int or list' if line.startswith('splits') else 'int'
    with pytest.raises(ValueError, match=f'as {expected} \\(got {got}\\)'):
      p.FromText(line)


def testKindsReadTextAsTheSingleKindParamsDo():
  """An int reads as a float kind, and an unquoted word as a str kind, as for a float or str
  default; a default outside its kinds is refused where it is defined."""
  p = hyperparams.Params()
  p.Define('rate', 1, 'A rate or a list of rates.', kinds=(float, list))
  assert p.rate == 1.0 and isinstance(p.rate, float)  # The default reads as the text would.
  p.Define('mode', 'auto', 'A mode or a list of modes.', kinds=(str, list))
  p.FromText('rate : 2')
  assert p.rate == 2.0 and isinstance(p.rate, float)
  p.FromText('mode : fast')
  assert p.mode == 'fast'
  p.FromText("mode : ['a', 'b']")
  assert p.mode == ['a', 'b']
  with pytest.raises(ValueError, match="as float or list \\(got str\\)"):
    p.FromText("rate : 'x'")
  with pytest.raises(ValueError, match="'count': default 1.5 is not one of its kinds int, list"):
    p.Define('count', 1.5, 'A count or a list.', kinds=(int, list))


class _Op:
  """A class a params swap can name; PARAMS: the params it reads, with their defaults."""
  PARAMS = {}

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    for name, default in cls.PARAMS.items():
      p.Define(name, default, 'Read by the op.')
    return p


class _Adder(_Op):
  PARAMS = {'bias': 1}


class _OtherAdder(_Adder):
  pass


class _Scaler(_Op):
  PARAMS = {'scale': 2}


class _Constant(_Op):
  pass


def testATextSwapsAClassOnlyForOneThatReadsNoParamsItLacks():
  """`x.cls : Other` keeps x's params, so Other may read no params x lacks (Lingvo's
  optimizer swap from Adam to Momentum is done in the params class; to SGD, which reads
  none of Adam's, a text does it)."""
  outer = hyperparams.Params()
  outer.Define('op', _Adder.Params(), 'The op.')
  outer.FromText(f'op.cls : {__name__}._OtherAdder')
  assert outer.op.cls is _OtherAdder and outer.op.bias == 1
  outer.FromText(f'op.cls : {__name__}._Constant')
  assert outer.op.cls is _Constant
  with pytest.raises(ValueError, match=r"line 1: op.cls : _Scaler reads params \['scale'\] that "
                     r"op lacks: set op = _Scaler.Params\(\) in the params class instead"):
    outer.FromText(f'op.cls : {__name__}._Scaler')


def testFromTextUnknownKey():
  with pytest.raises(AttributeError, match='Did you mean: steps'):
    _Nested().FromText('stepss : 3')


@pytest.mark.parametrize('key,hint', [
    ('task.inner.width', ' Did you mean inner.width?'),  # A Lingvo-style path.
    ('width', ' Did you mean inner.width?'),
    ('inner.steps', ' Did you mean steps?'),
    ('inner.depth', ''),  # Defined nowhere under any parent: no hint.
])
def testFromTextUnknownKeyNamesTheSameNameUnderAnotherParent(key, hint):
  with pytest.raises(AttributeError) as e:
    _Nested().FromText(f'{key} : 3')
  assert str(e.value).endswith(f'].{hint}'), str(e.value)


def testStrIsReadable():
  assert 'inner.width : 8' in str(_Nested())


def testInstantiableParams():
  class Foo:
    def __init__(self, params):
      self.params = params

  p = hyperparams.InstantiableParams(Foo)
  p.Define('x', 1, 'x')
  foo = p.Instantiate()
  assert isinstance(foo, Foo) and foo.params.x == 1 and p.cls is Foo
  with pytest.raises(ValueError, match='cls is None'):
    hyperparams.InstantiableParams().Instantiate()


def testAClassValuedParamTakesOnlyAClassOfItsKind():
  """`op.cls : os.system` would call os.system(params) at Instantiate: a class-valued param
  takes only a class that shares its Lingvo root class (here _Op, which defines Params)."""
  outer = hyperparams.Params()
  outer.Define('op', _Adder.Params(), 'The op.')
  for value, why in (('os.system', "'os.system' is not a class of kind _Op"),
                     ('collections.OrderedDict', "is not a class of kind _Op"),
                     (f'{__name__}._Thing', 'is not a class of kind _Op')):
    with pytest.raises(ValueError, match=why):
      outer.FromText(f'op.cls : {value}')
  assert outer.op.cls is _Adder


def testATextNeverRunsAModuleTheProgramDidNotImport(tmp_path, monkeypatch):
  """A name whose top-level module is not imported (a file in the working directory) is
  refused, unrun; a submodule of an imported package is imported only for a class."""
  ran = tmp_path / 'ran'
  package = tmp_path / 'probe_pkg'
  package.mkdir()
  (package / '__init__.py').write_text('')
  side_effect = f'open({str(ran)!r}, "a").write("x")\n'
  (package / 'side.py').write_text(side_effect + 'def F():\n  pass\nclass C:\n  pass\n')
  (tmp_path / 'stray.py').write_text(side_effect + 'class C:\n  pass\n')
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.chdir(tmp_path)
  import probe_pkg  # pylint: disable=g-import-not-at-top,import-outside-toplevel,unused-import
  monkeypatch.delitem(sys.modules, 'probe_pkg.side', raising=False)
  p = hyperparams.Params()
  p.Define('cls', _Thing, 'A class.')
  p.Define('fn', len, 'A function.')
  with pytest.raises(ValueError, match="module 'stray' is not imported"):
    p.FromText('cls : stray.C')
  with pytest.raises(ValueError, match="'probe_pkg' has no 'side'"):
    p.FromText('fn : probe_pkg.side.F')
  assert not ran.exists() and 'stray' not in sys.modules
  p.FromText('cls : probe_pkg.side.C')
  assert p.cls.__name__ == 'C' and ran.read_text() == 'x'
  monkeypatch.delitem(sys.modules, 'probe_pkg.side')


@pytest.mark.parametrize('line, why', [
    ('inner : None', "'inner' is a group of params, not a value: set its keys"),
    ('inner : 5', "'inner' is a group of params"),
    ('steps : os.sep', "'os.sep' names an object, and the value is a int"),
    ('steps : 99999999999999999999', 'out of the 64-bit integer range'),
    ('steps : -9223372036854775809', 'out of the 64-bit integer range'),
    ('lr : ' + '-' * 5000 + '1', 'nested too deeply'),
    ('lr : ' + '[' * 5000, 'cannot parse'),
])
def testFromTextRefusesValuesThatMakeNoSenseInOneError(line, why):
  with pytest.raises(ValueError, match=re.escape(why)):
    _Nested().FromText(line)


def testAnInt64StillParses():
  p = _Nested().FromText('steps : 9223372036854775807')
  assert p.steps == 2**63 - 1
