"""One optimizer step and what keeps it safe: learner, optimizers, learning-rate schedules,
loss scaling, checkpoints, run locks and preemption."""
