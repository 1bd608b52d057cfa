"""jaxpar.mesh: the (data, stage, tensor) mesh, simulated CPU devices."""

import jax
import pytest

import jaxpar


def test_make_mesh_errors_name_both_counts():
  with pytest.raises(ValueError, match=r'needs 4 devices but jax.device_count\(\) '
                     r'is 8.*devices=jax.devices\(\)\[:4\]'):
    jaxpar.make_mesh(data=2, tensor=2)
  mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
  assert mesh.axis_names == ('data', 'stage', 'tensor')
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)


def test_simulate_cpu_devices_after_start():
  jaxpar.simulate_cpu_devices(8)  # same count: fine
  with pytest.raises(RuntimeError, match='before any JAX operation'):
    jaxpar.simulate_cpu_devices(4)


def test_axis_size_names_the_axes():
  mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
  assert jaxpar.mesh.axis_size(mesh, 'stage') == 2
  with pytest.raises(ValueError, match=r"no axis 'pipe'; its axes are "
                     r"\('data', 'stage', 'tensor'\)"):
    jaxpar.mesh.axis_size(mesh, 'pipe')
  with pytest.raises(TypeError, match='mesh must be a jax.sharding.Mesh'):
    jaxpar.mesh.axis_size(None, 'stage')
