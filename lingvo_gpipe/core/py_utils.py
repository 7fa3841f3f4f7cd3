"""Lingvo's import path of lingvo_gpipe.foundation.py_utils, which holds the code."""

from lingvo_gpipe.foundation.py_utils import *  # noqa: F401,F403
