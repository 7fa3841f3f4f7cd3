"""devices: the Topology of stand-in device lists, the local set-up's choices, stage names."""

import pytest
import tensorflow as tf

from lingvo_gpipe.foundation import devices


def _Devices(*names):
  return [tf.config.LogicalDevice(name, tf.DeviceSpec.from_string(name).device_type)
          for name in names]


def testLocalGpusComeBeforeTheCpu():
  topology = devices.Topology.Of(_Devices('/device:CPU:0', '/device:GPU:0', '/device:GPU:1'))
  assert topology == devices.Topology('GPU', ('/device:GPU:0', '/device:GPU:1'))


def testLocalCpusWithoutGpus():
  topology = devices.Topology.Of(_Devices('/device:CPU:0', '/device:CPU:1'))
  assert topology == devices.Topology('CPU', ('/device:CPU:0', '/device:CPU:1'))


def testAClustersWorkersComeFirstByTaskAndTheirGpusBeforeTheirCpus():
  local = ['/job:localhost/replica:0/task:0/device:CPU:0',
           '/job:localhost/replica:0/task:0/device:GPU:0']
  cpus = [f'/job:worker/replica:0/task:{t}/device:CPU:0' for t in (1, 0)]
  gpus = [f'/job:worker/replica:0/task:{t}/device:GPU:{i}' for t in (1, 0) for i in (1, 0)]
  assert devices.Topology.Of(_Devices(*local, *cpus)) == devices.Topology(
      'CPU', tuple(reversed(cpus)))
  assert devices.Topology.Of(_Devices(*local, *cpus, *gpus)).devices == (
      gpus[3], gpus[2], gpus[1], gpus[0])


def testThisProcessIsTheTestsFourLogicalCpus():
  topology = devices.Current()
  assert topology.kind == 'CPU' and len(topology.devices) >= 4


@pytest.mark.parametrize('run_locally,gpus,kind', [
    ('auto', 0, 'CPU'), ('auto', 2, 'GPU'), ('cpu', 2, 'CPU'), ('gpu', 1, 'GPU')])
def testLocalKind(run_locally, gpus, kind):
  assert devices.LocalKind(run_locally, gpus) == kind


def testLocalKindRefusesWhatCannotRun():
  with pytest.raises(ValueError, match='run_locally=gpu, but TensorFlow finds no GPU'):
    devices.LocalKind('gpu', 0)
  with pytest.raises(ValueError, match=r"run_locally must be one of .*, got 'tpu'"):
    devices.LocalKind('tpu', 0)


def testGpusNamedForACpuRunAreRefused():
  with pytest.raises(ValueError, match=r'GPUs were named \(gpus=\[0\], gpu_split_mb=None\) '
                     r"for a run on CPUs \(run_locally='auto', 0 GPU\(s\) seen\)"):
    devices.ConfigureLocal('auto', 4, gpus=[0])
  with pytest.raises(ValueError, match='gpu_split_mb=512'):
    devices.ConfigureLocal('cpu', 4, gpu_split_mb=512)


def testConfiguringTheDevicesTheProcessHasKeepsThem():
  assert devices.ConfigureLocal('auto', 4) == '4 logical CPU devices'
  with pytest.raises(ValueError, match=r'TensorFlow initialised \d+ CPU device\(s\) before 64 '
                     'could be configured'):
    devices.ConfigureLocal('cpu', 64)


def testShortNamesAndTheStageLine():
  assert devices.ShortName('/device:GPU:1') == 'GPU:1'
  assert devices.ShortName('/job:localhost/replica:0/task:0/device:CPU:2') == 'CPU:2'
  assert devices.ShortName('/job:worker/replica:0/task:3/device:GPU:0') == 'worker/task:3/GPU:0'
  assert devices.DescribeStages(['/device:GPU:0', '/device:GPU:1']) == (
      'stage 0 on GPU:0, stage 1 on GPU:1')


def testTooFewGpusSayHowToSplitOne(monkeypatch):
  monkeypatch.setattr(devices, 'Current', lambda: devices.Topology('GPU', ('/device:GPU:0',)))
  with pytest.raises(ValueError, match=r"needs 2 devices .* split one into logical GPUs with "
                     r"memory limits \(the trainer's --gpu_split_mb"):
    devices.StageDevices(2)


class _LocalDevice:
  """A stand-in for an entry of device_lib.list_local_devices()."""

  def __init__(self, name, device_type, memory_limit):
    self.name, self.device_type, self.memory_limit = name, device_type, memory_limit


def testGpuMemoryAndThePlannersDefaultCap():
  two_gpus = [_LocalDevice('/device:CPU:0', 'CPU', 268435456),
              _LocalDevice('/device:GPU:0', 'GPU', 15 * 2**30),
              _LocalDevice('/device:GPU:1', 'GPU', 7 * 2**30)]
  memory = devices.GpuMemoryBytes(two_gpus)
  assert memory == {'GPU:0': 15 * 2**30, 'GPU:1': 7 * 2**30}
  assert devices.DefaultMemoryCap(memory) == (7 * 2**30, "7168 MiB, GPU:1's memory")
  # On CPUs (this machine) no cap: the logical devices share the host's memory.
  assert devices.GpuMemoryBytes() == {}
  assert devices.DefaultMemoryCap({}) == (None, 'none (no GPU)')
