"""Which devices pipeline stages run on.

By default the stages take the devices TensorFlow knows: remote workers' devices
once connected to a cluster (tf.config.experimental_connect_to_cluster), else the
local accelerators, else the local (logical) CPU devices. So the same params run
on CPU, GPU or a cluster.
"""

import re

import tensorflow as tf


def _TaskIndex(name):
  match = re.search(r'/task:(\d+)', name)
  return int(match.group(1)) if match else 0


def _DeviceIndex(name):
  return int(name.rsplit(':', 1)[1])


def AvailableDevices():
  """Candidate stage devices, in stage order."""
  logical = tf.config.list_logical_devices()
  workers = [d for d in logical if '/job:worker' in d.name]
  if workers:
    pool = [d for d in workers if d.device_type == 'GPU'] or \
           [d for d in workers if d.device_type == 'CPU']
    return [d.name for d in sorted(pool, key=lambda d: (_TaskIndex(d.name),
                                                        _DeviceIndex(d.name)))]
  pool = tf.config.list_logical_devices('GPU') or tf.config.list_logical_devices('CPU')
  return [d.name for d in pool]


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
    devices: explicit device names, or None for AvailableDevices().
    allow_reuse: when there are fewer devices than stages, place stages
      round-robin instead of failing. Off by default: silently stacking stages
      on one device hides the memory a user planned for.
    num_replicas: R data-parallel copies of the K stages.
  """
  explicit = devices is not None
  if isinstance(devices, str):
    raise ValueError(f'devices must be a list of device names, one per stage, got the string '
                     f'{devices!r}.')
  devices = list(devices) if explicit else AvailableDevices()
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
        f'{"device was" if len(devices) == 1 else "devices were"} {source}: {devices}. Add '
        'devices (e.g. tf.config.set_logical_device_configuration for CPU) or set '
        'allow_device_reuse=True to place stages round-robin.')
  return [devices[k % len(devices)] for k in range(needed)]


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
