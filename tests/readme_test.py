"""Runs every code block of README.md and docs/ as a user would, so no page goes stale.

An HTML comment before each fenced block says how the block is checked:

  <!-- readme_test: run -->          run as written: sh with `bash -e`, python with the
                                      interpreter, from the repository root;
  <!-- readme_test: run FLAGS -->    run with FLAGS appended to its one command: a long
                                      benchmark at its smallest size;
  <!-- readme_test: file PATH -->    save the block as PATH (a params file later blocks use);
  <!-- readme_test: ci -->           commands of .ci/run (the install, the suite), which runs
                                      them on a fresh clone: checked to be among them, not run;
  <!-- readme_test: tree -->         every file and folder the listing names exists.

A block without a comment fails. The blocks are tests in page order, README.md first, then
docs/*.md by name, then the dated results docs/benchmarks/*.md by name; the blocks of one page
share one temporary directory, so a block may use what an earlier block of its page made. Two substitutions make the commands run here as written:
  * `.venv/bin/python`, the environment the README's install makes, is this test's
    interpreter: run the test where this checkout is installed (as .ci/run's .venv is);
    testInterpreterImportsThisCheckout fails otherwise;
  * `/tmp/` is the page's temporary directory, so runs start empty and leave /tmp alone.
Each run has a user's environment (no TF_CPP_MIN_LOG_LEVEL, no LINGVO_GPIPE_PARAMS) and
passes when it exits 0 and prints no error-level line, traceback, retracing warning or
TensorFlow INFO line that the binaries drop.

Every relative link of a page names an existing file (and, after a '#', a heading of it);
README.md links every docs/*.md page and is at most 10,000 characters; the dated pages of
docs/benchmarks/ are listed, newest first, by its README.md, which README.md or
docs/measuring.md links.
"""

import collections
import dataclasses
import glob
import os
import re
import shlex
import signal
import subprocess
import sys

import pytest

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The pages whose blocks run, in the order they run; paths relative to _ROOT.
PAGES = ['README.md'] + [os.path.relpath(p, _ROOT)
                         for folder in (('docs',), ('docs', 'benchmarks'))
                         for p in sorted(glob.glob(os.path.join(_ROOT, *folder, '*.md')))]
# The top-level docs pages, each of which README.md links.
DOCS_PAGES = [page for page in PAGES if os.path.dirname(page) == 'docs']
_FENCE = re.compile(r'^```(\w*)\n(.*?)^```$', re.M | re.S)
_MARKER = re.compile(r'<!-- readme_test: (\w+)(.*?)-->\n', re.S)
_KINDS = ('run', 'file', 'ci', 'tree')
_LINK = re.compile(r'\[[^\]]*\]\(([^)\s]+)\)')  # [text](target)
_HEADING = re.compile(r'^#+ (.*)$', re.M)
# Lines a healthy run does not print: error level (absl and TensorFlow's C++), tracebacks,
# retracing warnings, TensorFlow INFO lines the binaries drop (those of its load, logged before
# its logging starts, carry the time 0000 00:00).
_NOISE = re.compile(r'^[EF]\d{4} .*|^[IW]0000 00:00:.*|.*(Traceback|retracing|Sharding callback|'
                    r'default session config).*', re.M)


@dataclasses.dataclass(frozen=True)
class Block:
  page: str  # One of PAGES.
  line: int  # Of the opening fence.
  kind: str  # One of _KINDS, or None without a marker.
  arg: str  # What follows the kind in the marker, whitespace collapsed.
  lang: str
  code: str

  def __str__(self):
    return f'{self.page}:{self.line} ({self.kind})'


def _Read(page):
  with open(os.path.join(_ROOT, page)) as f:
    return f.read()


def _Blocks(page):
  text = _Read(page)
  blocks = []
  for fence in _FENCE.finditer(text):
    before = text[:fence.start()]
    start = before.rfind('<!-- readme_test:')
    marker = _MARKER.fullmatch(before, start) if start >= 0 else None
    kind, arg = (marker.group(1), ' '.join(marker.group(2).split())) if marker else (None, '')
    blocks.append(Block(page, text.count('\n', 0, fence.start()) + 1, kind, arg, fence.group(1),
                        fence.group(2)))
  return blocks


BLOCKS = [block for page in PAGES for block in _Blocks(page)]


@pytest.fixture(scope='module')
def tmp_dirs(tmp_path_factory):
  """page -> its temporary directory, which the page's blocks share."""
  return collections.defaultdict(lambda: str(tmp_path_factory.mktemp('page')))


def _AsHere(code, tmp):
  """The block's text with /tmp/ in `tmp` and the README's .venv as this interpreter."""
  return code.replace('/tmp/', f'{tmp}/').replace('.venv/bin/python', shlex.quote(sys.executable))


def _Commands(code):
  """The shell commands of a block: lines joined at trailing backslashes, split at '&&'."""
  lines = code.replace('\\\n', ' ').splitlines()
  return [' '.join(c.split()) for line in lines for c in line.split('&&') if c.strip()]


def _Run(block, tmp):
  """Runs a `run` block in a user's environment; returns (exit code, output)."""
  code = _AsHere(block.code, tmp)
  if block.arg:
    assert len(_Commands(code)) == 1, f'{block}: flags are appended to one command only'
    code = f'{code.rstrip()} {block.arg}'
  if block.lang == 'sh':
    args = ['bash', '-e', '-o', 'pipefail', '-c', code]
  else:
    assert block.lang == 'python' and not block.arg, block
    args = [sys.executable, '-c', code]
  env = {k: v for k, v in os.environ.items()
         if k not in ('TF_CPP_MIN_LOG_LEVEL', 'LINGVO_GPIPE_PARAMS')}
  # A session of its own: whatever the block leaves running is stopped with it.
  proc = subprocess.Popen(args, cwd=_ROOT, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=600)
  finally:
    try:
      os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  return proc.returncode, out


def _CheckCi(block):
  """Each command of the block is one that .ci/run runs (ignoring its --quiet)."""
  with open(os.path.join(_ROOT, '.ci', 'run')) as f:
    ci = {c.replace(' --quiet', '') for c in _Commands(f.read())}
  for command in _Commands(block.code):
    assert command in ci, f'{block}: {command!r} is not a command of .ci/run'


def _CheckTree(block):
  """Every file or folder of the listing (names ending in .py or /, at 2 spaces a level)
  exists; <placeholders> and description lines are skipped."""
  folders = []
  for line in block.code.splitlines():
    depth = (len(line) - len(line.lstrip())) // 2
    names = [n for n in re.split(r'\s{2,}', line.strip())[0].split(', ')
             if n.endswith(('.py', '/')) and '<' not in n]
    if not names:
      continue
    folders = folders[:depth]
    for name in names:
      path = os.path.join(_ROOT, *folders, name)
      assert os.path.exists(path), f'{block}: {path} does not exist'
    if names[-1].endswith('/'):
      folders.append(names[-1])


def testInterpreterImportsThisCheckout():
  """The blocks' `.venv/bin/python` is this interpreter: it must run this checkout's code."""
  import lingvo_gpipe  # pylint: disable=g-import-not-at-top
  import lingvo_gpipe.params  # pylint: disable=g-import-not-at-top
  for module in (lingvo_gpipe, lingvo_gpipe.params):
    assert os.path.realpath(module.__file__).startswith(os.path.realpath(_ROOT) + os.sep), (
        f'{module.__name__} is {module.__file__}, not from {_ROOT}: run the tests in an '
        'environment where this checkout is installed (pip install -e .)')


def testEveryBlockSaysHowItIsChecked():
  assert BLOCKS and all(b.kind in _KINDS for b in BLOCKS), [str(b) for b in BLOCKS]


def _Links(page):
  """The link targets of a page's text, not of its code blocks or code spans."""
  return _LINK.findall(re.sub(r'`[^`\n]*`', '', _FENCE.sub('', _Read(page))))


def _Anchors(page):
  """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-'."""
  return {re.sub(r'[^\w\- ]', '', h.strip().lower()).replace(' ', '-')
          for h in _HEADING.findall(_FENCE.sub('', _Read(page)))}


@pytest.mark.parametrize('page', PAGES)
def testRelativeLinksResolve(page):
  """Each relative link names an existing file and, after a '#', a heading of it."""
  broken = []
  for target in _Links(page):
    if re.match(r'[a-z]+:', target):  # https:, mailto:
      continue
    path, _, anchor = target.partition('#')
    path = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    if not os.path.exists(os.path.join(_ROOT, path)):
      broken.append(f'{target}: no file {path}')
    elif anchor and path.endswith('.md') and anchor not in _Anchors(path):
      broken.append(f'{target}: no heading of {path} has the anchor {anchor}')
  assert not broken, f'{page}: ' + '; '.join(broken)


def testReadmeLinksEveryDocsPageAndIsShort():
  linked = {os.path.normpath(target.partition('#')[0]) for target in _Links('README.md')}
  unlinked = [page for page in DOCS_PAGES if page not in linked]
  assert not unlinked, f'README.md links none of {unlinked}: add them to its Documentation list'
  size = len(_Read('README.md').encode())
  assert size <= 10000, f'README.md has {size} characters, more than 10,000: move some to docs/'


def testTheReadmesPictureIsWhatTheLibraryPrints():
  """The K x M picture is the grid of GPipe's fill-drain at K=4, M=4, as Schedule prints it."""
  from lingvo_gpipe.pipeline import schedule  # pylint: disable=g-import-not-at-top
  grid = str(schedule.Schedule('gpipe', 4, 4)).splitlines()[1:]
  picture = '\n'.join('    ' + row for row in grid)
  assert picture in _Read('README.md'), f'README.md should show, indented by 4:\n{picture}'


def testBenchmarksIndexLinksEveryDatedPageNewestFirst():
  """docs/benchmarks/README.md lists each dated page once, newest first, and is linked."""
  index = os.path.join('docs', 'benchmarks', 'README.md')
  dated = [page for page in PAGES if os.path.dirname(page) == os.path.dirname(index)
           and page != index]
  assert dated and all(re.fullmatch(r'\d{4}-\d{2}-\d{2}-[a-z0-9_-]+\.md', os.path.basename(p))
                       for p in dated), f'{dated}: name dated pages YYYY-MM-DD-<topic>.md'
  listed = [os.path.normpath(os.path.join(os.path.dirname(index), target.partition('#')[0]))
            for target in _Links(index) if not re.match(r'[a-z]+:|\.\./', target)]
  assert sorted(listed) == sorted(dated), f'{index} lists {listed}, not each of {dated} once'
  dates = [os.path.basename(page)[:10] for page in listed]
  assert dates == sorted(dates, reverse=True), f'{index}: list the pages newest first'
  linking = [page for page in ('README.md', os.path.join('docs', 'measuring.md'))
             if index in {os.path.normpath(os.path.join(os.path.dirname(page),
                                                        target.partition('#')[0]))
                          for target in _Links(page)}]
  assert linking, f'neither README.md nor docs/measuring.md links {index}'


@pytest.mark.parametrize('block', BLOCKS, ids=str)
def testBlock(block, tmp_dirs):
  tmp = tmp_dirs[block.page]
  if block.kind == 'ci':
    _CheckCi(block)
  elif block.kind == 'tree':
    _CheckTree(block)
  elif block.kind == 'file':
    path = _AsHere(block.arg, tmp)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w') as f:
      f.write(block.code)
  else:
    assert block.kind == 'run', f'{block}: no <!-- readme_test: ... --> right before it'
    code, out = _Run(block, tmp)
    assert code == 0, f'{block} exited with {code}:\n{out[-3000:]}'
    noise = [m.group(0) for m in _NOISE.finditer(out)]
    assert not noise, f'{block} printed:\n' + '\n'.join(noise)
