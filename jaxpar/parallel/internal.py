"""The 3D trainer's parts that jaxpar's other packages build on.

For jaxpar's other packages (``jaxpar.checkpoint`` moves whole states
between rank order and model order with it); not API: these names may
change in any release. ``model_sharding`` is the sharding of a rank-order
leaf ``[p, v, ...]`` once laid out in model order ``[p*v, ...]``.

Example:
  >>> import jax, jax.numpy as jnp, jaxpar
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> from jaxpar.parallel import internal
  >>> mesh = jaxpar.make_mesh(stage=4, devices=jax.devices()[:4])
  >>> leaf = jax.device_put(jnp.zeros((4, 2, 3)),
  ...                       NamedSharding(mesh, P('stage')))
  >>> internal.model_sharding(leaf).spec
  P('stage', None)
"""

from jaxpar.parallel._placement import model_sharding as model_sharding

__all__ = ['model_sharding']
