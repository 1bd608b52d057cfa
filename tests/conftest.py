"""Eight simulated CPU devices, set before JAX starts; float64 on request."""

import os

os.environ.setdefault('XLA_FLAGS', '')  # no GPU flags leak into CPU tests
import jax  # noqa: E402

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')

import pytest  # noqa: E402

if jax.device_count() < 8:
  raise RuntimeError(
      f'jaxpar tests need 8 simulated CPU devices, got {jax.device_count()}: '
      'something started JAX before tests/conftest.py ran.')


@pytest.fixture
def x64():
  """Run the test with float64 enabled (``jax.enable_x64``)."""
  with jax.enable_x64(True):
    yield
