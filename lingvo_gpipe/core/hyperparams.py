"""Lingvo's import path of lingvo_gpipe.foundation.hyperparams, which holds the code."""

from lingvo_gpipe.foundation.hyperparams import *  # noqa: F401,F403
