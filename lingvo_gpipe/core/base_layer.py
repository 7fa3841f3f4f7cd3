"""Lingvo's import path of lingvo_gpipe.foundation.base_layer, which holds the code."""

from lingvo_gpipe.foundation.base_layer import *  # noqa: F401,F403
