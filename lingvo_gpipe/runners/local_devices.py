"""This process's devices and the pipelines' places on them: the trainer binary's device
set-up, apart from its flags so that every job (trainer, evaler, worker, pipeline check)
configures devices through one path before TensorFlow's first op."""

import dataclasses

from absl import logging

from lingvo_gpipe.distribution import cluster as cluster_lib
from lingvo_gpipe.foundation import devices as devices_lib
from lingvo_gpipe.foundation import errors
from lingvo_gpipe.foundation import hyperparams
from lingvo_gpipe.pipeline import pipeline_params


@dataclasses.dataclass(frozen=True)
class DeviceSettings:
  """Which local devices this process makes (the trainer's device flags).

  run_locally: devices.LOCAL_KINDS: 'auto', 'cpu' or 'gpu' (--run_locally).
  memory_growth: GPUs allocate memory as needed (--gpu_memory_growth).
  gpu_split_mb: None, or MB per logical GPU split off GPU 0 (--gpu_split_mb).
  gpus: None (all), or the indices of the GPUs to use as given, strings (--gpus).
  num_cpu_devices: None (as many as the pipelines need), or the logical devices of a
    local run (--num_cpu_devices).
  """
  run_locally: str = 'auto'
  memory_growth: bool = True
  gpu_split_mb: int | None = None
  gpus: list[str] | None = None
  num_cpu_devices: int | None = None


def PlacePipelines(params: hyperparams.Params, split_size: int | None, replicas: int) -> None:
  """Puts every pipeline of `params` that names no devices on splits of the available devices.

  Each gets `replicas` data-parallel replicas, replica r on split r of
  split_size devices (cluster.PipelineDevices). Pipelines a task builds in
  code (not from its params) take the available devices by themselves, but
  cannot have replicas or a split size.
  """
  pipelines = [p for _, p in pipeline_params.Find(params)]
  if not pipelines and (replicas > 1 or split_size):
    raise errors.UserError(
        '--worker_replicas and --worker_split_size apply to PipeliningLayer params, and the '
        "task's params hold none (it builds its pipelines in code).")
  for p in pipelines:
    if p.devices is None:
      p.devices = cluster_lib.PipelineDevices(pipeline_params.NumStages(p), replicas,
                                              split_size)
    p.num_replicas = replicas


def ConfigureDevices(settings: DeviceSettings, num_devices: int) -> None:
  """This process's devices from `settings` (devices.ConfigureLocal), before TensorFlow's
  first op; logs which it has."""
  try:
    gpus = None if settings.gpus is None else [int(i) for i in settings.gpus]
  except ValueError:
    raise errors.UserError(f'--gpus takes GPU indices, e.g. 0,1; got {settings.gpus}.') from None
  try:
    configured = devices_lib.ConfigureLocal(settings.run_locally, num_devices,
                                            settings.memory_growth, settings.gpu_split_mb, gpus)
  except ValueError as e:
    raise errors.UserError(str(e)) from None
  logging.info('Devices: %s.', configured)


def SetUpLocalDevices(model_params: hyperparams.Params, settings: DeviceSettings,
                      split_size: int | None, replicas: int) -> None:
  """Logical devices for the pipelines of a local run, and their replicas' placement:
  `replicas` of each pipeline on splits of `split_size` devices (None: its stages)."""
  try:
    stages = split_size or pipeline_params.MaxStages(model_params.task) or 4
    most = pipeline_params.MaxDevices(model_params.task)  # With a pipeline's num_replicas.
  except ValueError as e:  # A bad config, e.g. from an override.
    raise errors.UserError(f'Cannot build the task: {e}') from None
  needed = max(replicas * stages, most)
  given = settings.num_cpu_devices
  if given is not None and given < needed and not any(
      p.allow_device_reuse or p.devices for _, p in pipeline_params.Find(model_params.task)):
    raise errors.UserError(
        f'--num_cpu_devices={given}, but the task\'s pipelines need {needed} devices: give at '
        'least that many, or leave the flag out to make them.')
  ConfigureDevices(settings, given or needed)
  if replicas > 1 or split_size:
    PlacePipelines(model_params.task, split_size, replicas)
