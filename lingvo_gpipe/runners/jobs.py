"""What the trainer binary's jobs share: the task built with its checkpointer, where unplaced
ops go, and a logdir that is checked writable before anything is written to it."""

import contextlib
import os

import tensorflow as tf

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.pipeline import cell_functions
from lingvo_gpipe.pipeline import gpipe
from lingvo_gpipe.training import checkpointer as checkpointer_lib
from lingvo_gpipe.training import learner as learner_lib


def MakeWritableDir(path: str) -> None:
  """Creates `path` if needed and checks that files can be written there (a page of them:
  a full disk fails here, not in the lock file)."""
  probe = os.path.join(path, '.write_probe')
  try:
    with errors.Writing(f'to {path}'):
      tf.io.gfile.makedirs(path)
      with tf.io.gfile.GFile(probe, 'w') as f:
        f.write(' ' * 4096)
  finally:
    if tf.io.gfile.exists(probe):
      tf.io.gfile.remove(probe)


def Instantiate(model_params: hyperparams.Params, train_dir: str, with_learner: bool = False,
                max_to_keep: int = 5) -> tuple[tf.Module, tf.Variable, learner_lib.Learner | None,
                                                checkpointer_lib.Checkpointer]:
  """(task, global step, Learner or None, Checkpointer of train_dir keeping max_to_keep)."""
  try:
    task = model_params.Instantiate().task
    global_step = tf.Variable(0, dtype=tf.int64, trainable=False, name='global_step')
    learner = learner_lib.Learner(task.train_params, task.trainable_variables,
                                  global_step) if with_learner else None
    for pipe in Pipelines(task) if with_learner else []:
      cell_functions.CreateGradientSums(pipe)
  except ValueError as e:  # A bad config, e.g. from an override (the optimizer's too).
    raise errors.UserError(f'Cannot build the task: {e}') from None
  checkpointer = checkpointer_lib.Checkpointer(
      train_dir, task.variables, global_step, learner and learner.state,
      max_to_keep=max_to_keep)
  return task, global_step, learner, checkpointer


def StepPlacement(on_cluster: bool) -> contextlib.AbstractContextManager:
  """Where the ops a model leaves unplaced go: on a cluster with their inputs, not the client."""
  return cluster_lib.ColocatedWithInputs() if on_cluster else contextlib.nullcontext()


def Pipelines(task: tf.Module) -> list[gpipe.PipeliningLayer]:
  """The task's PipeliningLayers."""
  return [m for m in task.submodules if isinstance(m, gpipe.PipeliningLayer)]
