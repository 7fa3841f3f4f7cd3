"""Measuring and planning a pipeline: per-action timelines, the simulator and the balance
planner."""
