# The trainer binary's import path: `python -m lingvo_gpipe.trainer`; the code is in
# lingvo_gpipe.runners.trainer, whose docstring is this module's (absl prints it as usage).
from lingvo_gpipe.runners import trainer as _trainer
from lingvo_gpipe.runners.trainer import *  # noqa: F401,F403
from lingvo_gpipe.runners.trainer import Main

__doc__ = _trainer.__doc__

if __name__ == '__main__':
  Main()
