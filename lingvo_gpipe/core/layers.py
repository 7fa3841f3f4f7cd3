"""Lingvo's import path of lingvo_gpipe.layers, which holds the code."""

from lingvo_gpipe.layers import *  # noqa: F401,F403
