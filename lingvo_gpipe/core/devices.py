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
  devices = list(devices) if explicit else AvailableDevices()
  needed = num_stages * num_replicas
  if not devices:
    raise ValueError('No devices to place pipeline stages on.')
  if len(devices) < needed and not allow_reuse:
    source = 'given' if explicit else 'found (tf.config.list_logical_devices)'
    layout = f'{num_replicas} replicas x {num_stages} stages' if num_replicas > 1 else (
        f'{num_stages} stages')
    raise ValueError(
        f'The pipeline needs {needed} devices ({layout}) but only {len(devices)} devices were '
        f'{source}: {devices}. Add devices (e.g. tf.config.set_logical_device_configuration '
        'for CPU) or set allow_device_reuse=True to place stages round-robin.')
  return [devices[k % len(devices)] for k in range(needed)]
