"""The trainer binary's import path: `python -m lingvo_gpipe.trainer`; the code is in
lingvo_gpipe.runners.trainer."""

from lingvo_gpipe.runners.trainer import *  # noqa: F401,F403
from lingvo_gpipe.runners.trainer import Main

if __name__ == '__main__':
  Main()
