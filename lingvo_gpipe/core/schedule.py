"""Lingvo's import path of lingvo_gpipe.pipeline.schedule, which holds the code with
pipeline.schedule_actions and pipeline.named_schedules."""

from lingvo_gpipe.pipeline.named_schedules import *  # noqa: F401,F403
from lingvo_gpipe.pipeline.schedule import *  # noqa: F401,F403
from lingvo_gpipe.pipeline.schedule_actions import *  # noqa: F401,F403
