"""Which devices pipeline stages run on: one Topology per process.

By default the stages take the devices TensorFlow knows: remote workers' devices
once connected to a cluster (tf.config.experimental_connect_to_cluster), else the
local GPUs, else the local (logical) CPU devices. So the same params run on CPU,
GPU or a cluster. ConfigureLocal sets a process's devices up before TensorFlow's
first op (GPUs or logical CPUs, memory growth, a GPU split for testing).
"""

import dataclasses
import re

import tensorflow as tf

LOCAL_KINDS = ('auto', 'cpu', 'gpu')


def _TaskIndex(name):
  match = re.search(r'/task:(\d+)', name)
  return int(match.group(1)) if match else 0


def _DeviceIndex(name):
  return int(name.rsplit(':', 1)[1])


def ShortName(name):
  """'GPU:1', or 'worker/task:2/GPU:0' for a cluster's device: what a log line names."""
  spec = tf.DeviceSpec.from_string(name)
  local = f'{spec.device_type}:{spec.device_index or 0}'
  return local if spec.job in (None, 'localhost') else f'{spec.job}/task:{spec.task}/{local}'


@dataclasses.dataclass(frozen=True)
class Topology:
  """The devices this process's pipelines run on, in stage order, and their kind.

  kind: 'GPU' or 'CPU'; devices: full device names. A cluster's workers' devices
  come first (their GPUs if they have any, else their CPUs, by task), else the
  local GPUs, else the local logical CPUs.
  """
  kind: str
  devices: tuple

  @classmethod
  def Of(cls, logical_devices):
    """The topology of `logical_devices` (tf.config.LogicalDevice values)."""
    pool = [d for d in logical_devices if '/job:worker' in d.name] or [
        d for d in logical_devices if '/job:' not in d.name or '/job:localhost' in d.name]
    chosen = [d for d in pool if d.device_type == 'GPU'] or [
        d for d in pool if d.device_type == 'CPU']
    chosen = sorted(chosen, key=lambda d: (_TaskIndex(d.name), _DeviceIndex(d.name)))
    return cls(kind=chosen[0].device_type if chosen else 'CPU',
               devices=tuple(d.name for d in chosen))


def DescribeStages(stage_devices):
  """Each stage's device in one line, e.g. 'stage 0 on GPU:0, stage 1 on GPU:1'."""
  return ', '.join(f'stage {k} on {ShortName(d)}' for k, d in enumerate(stage_devices))


def Current():
  """This process's Topology as TensorFlow lists its devices now."""
  return Topology.Of(tf.config.list_logical_devices())


def GpuMemoryBytes(local_devices=None) -> dict:
  """Per local GPU ('GPU:0', ...), the bytes its allocator may take: a logical GPU's
  memory_limit, or what TensorFlow found usable on a physical one; {} without GPUs.

  TensorFlow's public API tells no GPU's memory; its device list (device_lib) holds each
  allocator's limit. local_devices: what device_lib.list_local_devices() returns (stand-ins
  in tests); listing them starts TensorFlow's devices.
  """
  if local_devices is None:
    if not tf.config.list_physical_devices('GPU'):
      return {}
    from tensorflow.python.client import device_lib  # pylint: disable=g-import-not-at-top
    local_devices = device_lib.list_local_devices()
  return {ShortName(d.name): int(d.memory_limit) for d in local_devices
          if d.device_type == 'GPU'}


def DefaultMemoryCap(gpu_memory: dict):
  """(the planner's per-device cap where none is given, in words): the smallest GPU's
  memory of GpuMemoryBytes, as each stage must fit its device; None on CPUs, whose logical
  devices share the host's memory."""
  if not gpu_memory:
    return None, 'none (no GPU)'
  name = min(gpu_memory, key=gpu_memory.get)
  return gpu_memory[name], f"{gpu_memory[name] / 2**20:.0f} MiB, {name}'s memory"


def LocalKind(run_locally, num_gpus):
  """'GPU' or 'CPU' for --run_locally (auto: GPUs when TensorFlow sees any)."""
  if run_locally not in LOCAL_KINDS:
    raise ValueError(f'run_locally must be one of {LOCAL_KINDS}, got {run_locally!r}.')
  if run_locally == 'gpu' and not num_gpus:
    raise ValueError('run_locally=gpu, but TensorFlow finds no GPU on this machine (is the '
                     "CUDA build of TensorFlow installed? docs/gpus.md); use 'cpu' or 'auto'.")
  if run_locally == 'auto':
    return 'GPU' if num_gpus else 'CPU'
  return run_locally.upper()


def ConfigureLocal(run_locally, num_devices, memory_growth=True, gpu_split_mb=None, gpus=None):
  """Sets this process's devices up before TensorFlow's first op; returns what it set, in
  words. (It leaves TensorFlow uninitialised: Current() would not.)

  Args:
    run_locally: 'cpu' (GPUs hidden; num_devices logical CPU devices stand in
      for accelerators), 'gpu', or 'auto' (gpu when TensorFlow sees a GPU).
    num_devices: the devices the pipelines need (logical CPUs made; on GPUs the
      logical GPUs of a split).
    memory_growth: GPUs allocate as needed. Off, TensorFlow takes nearly all of
      every GPU it sees at its first op, so no second process (another worker,
      an evaler) fits beside it.
    gpu_split_mb: split GPU 0 into num_devices logical GPUs of this many MB
      each: K stages on one GPU, for testing (memory growth does not apply).
    gpus: indices of the GPUs this process uses (a worker given its own); None: all.
  """
  physical = tf.config.list_physical_devices('GPU')
  kind = LocalKind(run_locally, len(physical))
  if kind == 'CPU':
    if gpus is not None or gpu_split_mb:
      raise ValueError(f'GPUs were named (gpus={gpus}, gpu_split_mb={gpu_split_mb}) for a run '
                       f'on CPUs (run_locally={run_locally!r}, {len(physical)} GPU(s) seen).')
    _Apply(tf.config.set_visible_devices, [], 'GPU')
    _LogicalDevices(tf.config.list_physical_devices('CPU')[0], num_devices,
                    tf.config.LogicalDeviceConfiguration())
    return f'{num_devices} logical CPU device{"s" if num_devices > 1 else ""}'
  chosen = physical if gpus is None else [_Gpu(physical, i) for i in gpus]
  _Apply(tf.config.set_visible_devices, chosen, 'GPU')
  names = [d.name.replace('/physical_device:', '') for d in chosen]
  if gpu_split_mb:
    _LogicalDevices(chosen[0], num_devices,
                    tf.config.LogicalDeviceConfiguration(memory_limit=gpu_split_mb))
    return f'{names[0]} split into {num_devices} logical GPUs of {gpu_split_mb} MB'
  if memory_growth:
    for gpu in chosen:
      _Apply(tf.config.experimental.set_memory_growth, gpu, True)
  return f'{", ".join(names)} (memory growth {"on" if memory_growth else "off"})'


def _Gpu(physical, index):
  if not 0 <= index < len(physical):
    raise ValueError(f'GPU {index} does not exist: TensorFlow sees {len(physical)} GPU(s) '
                     f'{[d.name for d in physical]}.')
  return physical[index]


def _Apply(setter, *args):
  """setter(*args), unless TensorFlow has set its devices up already: then they stay (a
  second call in one process, e.g. a test after another)."""
  try:
    setter(*args)
  except RuntimeError:
    pass


def _LogicalDevices(physical, count, config):
  """`count` logical devices of `physical`; ValueError if fewer exist already."""
  try:
    tf.config.set_logical_device_configuration(physical, [config] * count)
  except RuntimeError:  # Devices are initialised already: keep them if they suffice.
    have = len(tf.config.list_logical_devices(physical.device_type))
    if have < count:
      raise ValueError(
          f'TensorFlow initialised {have} {physical.device_type} device(s) before {count} '
          'could be configured (something ran TensorFlow ops first).') from None


def _Matches(wanted, device):
  """Whether DeviceSpec `device` is `wanted`: every field that `wanted` sets agrees."""
  for field in ('job', 'replica', 'task', 'device_index'):
    if getattr(wanted, field) is not None and getattr(wanted, field) != getattr(device, field):
      return False
  return wanted.device_type is None or (
      wanted.device_type.upper() == (device.device_type or '').upper())


def CheckDevicesExist(names):
  """Raises a ValueError naming the first device TensorFlow does not have.

  Without it, TensorFlow places ops for a missing device elsewhere (soft
  placement): a pipeline would silently run every stage on one device.
  """
  known = [d.name for d in tf.config.list_logical_devices()]
  # Local devices are listed without their job: that is /job:localhost/replica:0/task:0.
  specs = [s if s.job else s.replace(job='localhost', replica=0, task=0)
           for s in map(tf.DeviceSpec.from_string, known)]
  for name in names:
    try:
      wanted = tf.DeviceSpec.from_string(name)
    except ValueError as e:
      raise ValueError(f'Device {name!r} is not a device name: {e}') from None
    if not any(_Matches(wanted, spec) for spec in specs):
      raise ValueError(f'Device {name!r} does not exist here; TensorFlow has {known}. For '
                       'logical CPU devices call tf.config.set_logical_device_configuration '
                       'first; for a cluster, connect to it first.')


def StageDevices(num_stages, devices=None, allow_reuse=False, num_replicas=1):
  """One device name per stage of each replica, replica-major.

  Args:
    num_stages: K.
    devices: explicit device names, or None for the Topology's.
    allow_reuse: when there are fewer devices than stages, place stages
      round-robin instead of failing. Off by default: silently stacking stages
      on one device hides the memory a user planned for.
    num_replicas: R data-parallel copies of the K stages.
  """
  explicit = devices is not None
  if isinstance(devices, str):
    raise ValueError(f'devices must be a list of device names, one per stage, got the string '
                     f'{devices!r}.')
  topology = Current()
  devices = list(devices) if explicit else list(topology.devices)
  if explicit:
    CheckDevicesExist(devices)
  needed = num_stages * num_replicas
  if explicit and len(devices) > needed:
    raise ValueError(
        f'Got {len(devices)} devices {devices}, but the pipeline runs {num_replicas} x '
        f'{num_stages} stages (num_replicas x devices, each holding its chunks): give '
        f'{needed}, replica-major.')
  if not devices:
    raise ValueError('No devices to place pipeline stages on.')
  if explicit and not allow_reuse:
    _RefuseRepeats(devices)
  if len(devices) < needed and not allow_reuse:
    source = 'given' if explicit else 'found (tf.config.list_logical_devices)'
    layout = f'{num_replicas} replicas x {num_stages} stages' if num_replicas > 1 else (
        f'{num_stages} stages')
    raise ValueError(
        f'The pipeline needs {needed} devices ({layout}) but only {len(devices)} '
        f'{"device was" if len(devices) == 1 else "devices were"} {source}: {devices}. '
        f'{_MoreDevices(topology.kind)}, or set allow_device_reuse=True to place stages '
        'round-robin.')
  return [devices[k % len(devices)] for k in range(needed)]


def _MoreDevices(kind):
  if kind == 'GPU':
    return ('Add GPUs, or split one into logical GPUs with memory limits (the trainer\'s '
            '--gpu_split_mb, or tf.config.set_logical_device_configuration)')
  return ('Add devices (the trainer makes logical CPU devices; else call '
          'tf.config.set_logical_device_configuration first)')


def _RefuseRepeats(devices):
  """Two stages listed on one device stack their memory there, as reuse does: say so."""
  seen = {}
  for name in devices:
    key = tf.DeviceSpec.from_string(name).to_string()
    if key in seen:
      raise ValueError(f'devices lists one device twice ({seen[key]!r} and {name!r}) in '
                       f'{devices}: give distinct devices, or set allow_device_reuse=True to '
                       'stack stages on one device.')
    seen[key] = name
