"""Test fixtures; the devices are set up by the root conftest.py."""

import jax
import pytest


@pytest.fixture
def x64():
  """Run the test with float64 enabled (``jax.enable_x64``)."""
  with jax.enable_x64(True):
    yield
