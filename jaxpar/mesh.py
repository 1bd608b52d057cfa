"""Device meshes with jaxpar's three named axes ``('data', 'stage', 'tensor')``.

Every jaxpar function takes its axis name as a keyword with these defaults, so
one mesh serves data, pipeline and tensor parallelism at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import AxisType, Mesh

from jaxpar import _compat
from jaxpar._validate import check_int

__all__ = ['AXES', 'axis_size', 'make_mesh', 'simulate_cpu_devices']

AXES = ('data', 'stage', 'tensor')


def simulate_cpu_devices(n: int) -> None:
  """Makes the CPU backend expose ``n`` devices (call before any JAX operation).

  Args:
    n: number of simulated CPU devices, ``n >= 1``.

  Raises:
    TypeError: if ``n`` is not an int.
    ValueError: if ``n < 1``.
    RuntimeError: if the backend already started with a different count.

  Example:
    >>> import jaxpar
    >>> jaxpar.simulate_cpu_devices(8)   # first cell of a notebook
  """
  check_int('n', n, where='simulate_cpu_devices')
  if _compat.backends_are_initialized():
    have = jax.device_count()
    if have == n and jax.default_backend() == 'cpu':
      return
    raise RuntimeError(
        f'simulate_cpu_devices({n}) was called after JAX started with {have} '
        f'{jax.default_backend()} device(s). Call it before any JAX operation '
        '(first line of the script, first cell of the notebook, or '
        'tests/conftest.py), then restart the process or kernel.')
  jax.config.update('jax_num_cpu_devices', int(n))


def make_mesh(*, data: int = 1, stage: int = 1, tensor: int = 1,
              devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A mesh of shape ``(data, stage, tensor)`` with all axes ``Explicit``.

  Built by ``jax.make_mesh``, which orders the devices by the hardware
  topology (on TPU and GPU hosts) so neighbouring mesh positions are
  neighbouring devices.

  Args:
    data: size of the data-parallel axis ``'data'``.
    stage: size of the pipeline axis ``'stage'``.
    tensor: size of the tensor-parallel axis ``'tensor'``.
    devices: devices to use, ``len(devices) == data * stage * tensor``;
      defaults to all of ``jax.devices()``.

  Returns:
    ``jax.sharding.Mesh`` with axis names ``('data', 'stage', 'tensor')``.

  Raises:
    TypeError: a size that is not an int (``True`` is not an int here).
    ValueError: a size below 1, or sizes whose product is not the number of
      devices.

  Example:
    >>> import jax, jaxpar
    >>> mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)   # 8 devices
    >>> dict(mesh.shape)
    {'data': 2, 'stage': 2, 'tensor': 2}
    >>> jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4]).devices.shape
    (1, 1, 4)
  """
  for name, size in (('data', data), ('stage', stage), ('tensor', tensor)):
    check_int(name, size, where='make_mesh')
  data, stage, tensor = int(data), int(stage), int(tensor)
  n = data * stage * tensor
  call = f'make_mesh(data={data}, stage={stage}, tensor={tensor})'
  if devices is None:
    have = jax.device_count()
    if n != have:
      raise ValueError(
          f'{call} needs {n} devices but jax.device_count() is {have}. Choose '
          f'sizes that multiply to {have}, or pass '
          f'devices=jax.devices()[:{n}].')
    devices = jax.devices()
  devices = list(devices)
  if len(devices) != n:
    raise ValueError(
        f'{call} needs {n} devices but got len(devices)={len(devices)}; pass '
        f'devices=jax.devices()[:{n}].')
  return jax.make_mesh((data, stage, tensor), AXES,
                       axis_types=(AxisType.Explicit,) * 3, devices=devices)


def axis_size(mesh: Mesh, axis: str) -> int:
  """Size of ``axis`` in ``mesh``; ``ValueError`` naming the axes if absent."""
  if not isinstance(mesh, Mesh):
    raise TypeError(f'mesh must be a jax.sharding.Mesh (see jaxpar.make_mesh), '
                    f'got {type(mesh).__name__}.')
  if axis not in mesh.shape:
    raise ValueError(
        f'mesh has no axis {axis!r}; its axes are {tuple(mesh.axis_names)}. '
        "Build it with jaxpar.make_mesh or pass axis=<one of those names>.")
  return mesh.shape[axis]
