"""The tensor-parallel checks that jaxpar's other packages build on.

For jaxpar's other packages (``jaxpar.parallel``'s 3D trainer checks a
split with them); not API: these names may change in any release.
``check_divisible`` refuses params whose split dims the mesh does not
divide; ``check_axis_used`` refuses a ``tensor`` axis no param is split
over; ``resharding_permutes`` counts the ``collective-permute`` s XLA puts
into a function partitioned over Auto axes (``parallel.from_nnx`` refuses
them in pipelined blocks).

Example:
  >>> import jax, jax.numpy as jnp, jaxpar
  >>> from jaxpar.tensor_parallel import internal
  >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
  >>> internal.check_divisible({'w': jnp.ones((8, 12))}, mesh=mesh,
  ...                          rules={'w': (None, 'tensor')})   # 12 % 4 == 0
"""

from jaxpar.tensor_parallel._checks import (
    resharding_permutes as resharding_permutes)
from jaxpar.tensor_parallel._rules import check_axis_used as check_axis_used
from jaxpar.tensor_parallel._rules import check_divisible as check_divisible

__all__ = ['check_axis_used', 'check_divisible', 'resharding_permutes']
