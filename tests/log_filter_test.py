"""Tests of log_filter: which C++ log lines pass, and where stderr is not redirected."""

import os
import sys

import pytest

from lingvo_gpipe.foundation import log_filter


@pytest.mark.parametrize('line,level,shown', [
    ('I0000 00:00:17.9 28299 port.cc:153] oneDNN custom operations are on.\n', 3, False),
    ('I0000 00:00:17.9 28299 port.cc:153] oneDNN custom operations are on.\n', 0, True),
    ('W1127 07:52:30.5 28299 x.cc:1] a warning\n', 1, True),
    ('W1127 07:52:30.5 28299 x.cc:1] a warning\n', 2, False),
    ('E0000 00:00:17.9 28299 cuda_platform.cc:52] failed call to cuInit\n', 3, False),
    ('F0000 00:00:17.9 28299 x.cc:1] Check failed\n', 3, True),
    ('WARNING: All log messages before absl::InitializeLog() is called are written to '
     'STDERR\n', 1, False),
    ('Traceback (most recent call last):\n', 3, True),
])
def testTheLinesFollowTheLevel(line, level, shown):
  assert log_filter.Shown(line, level) is shown


@pytest.mark.parametrize('value,level', [('3', 3), ('0', 0), ('', 0), ('-1', 0), ('x', 0)])
def testTheLevelIsReadAsTensorFlowReadsIt(monkeypatch, value, level):
  monkeypatch.setenv('TF_CPP_MIN_LOG_LEVEL', value)
  assert log_filter.LogLevel() == level


def testOnlyAPythonInterpreterRunsTheFilter(monkeypatch, capfd):
  """A frozen or embedded application's executable is not run (it launched the application):
  the block's stderr is left as it is."""
  for executable, python in ((sys.executable, True), ('/usr/bin/my_app', False), (None, False)):
    monkeypatch.setattr(sys, 'executable', executable)
    assert (log_filter._Python() is not None) == python  # pylint: disable=protected-access
  with log_filter.Filtered(3):
    os.write(2, b'W0000 00:00:1.5 7 k.cc:1] a warning\n')
  assert 'a warning' in capfd.readouterr().err


def testTheBlocksLinesAreFilteredAndOthersAreNot(capfd):
  with log_filter.Filtered(3):
    os.write(2, b'E0000 00:00:1.5 7 cuda.cc:1] failed call to cuInit\n')
    os.write(2, b'F0000 00:00:1.5 7 x.cc:1] Check failed\n')
  os.write(2, b'E0000 00:00:1.5 7 cuda.cc:1] after the block\n')
  assert capfd.readouterr().err == ('F0000 00:00:1.5 7 x.cc:1] Check failed\n'
                                    'E0000 00:00:1.5 7 cuda.cc:1] after the block\n')
