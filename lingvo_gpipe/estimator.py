"""The import path of lingvo_gpipe.runners.estimator, which holds the code."""

from lingvo_gpipe.runners.estimator import *  # noqa: F401,F403
