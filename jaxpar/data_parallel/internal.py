"""The data-parallel parts that jaxpar's other packages build on.

For jaxpar's other packages (``jaxpar.parallel``'s 3D trainer,
``jaxpar.checkpoint``, the benchmarks); not API: these names may change in
any release. ZeRO's checks (``ZERO_STAGES``, ``check_zero_stage``,
``check_opt_state``, ``batch_size_of``), ``vary_unsplit`` (the params a
device's gradient must not be summed over), the key of one microbatch
(``reseeded``) and the padded storage of leaves that no dim divides
(``pad``, ``unpadded``, ``place``, ``place_like``, ``padded_optimizer``,
``padded_shape``, ``logical_shapes``, ``logical_sharding``, ``is_padded``).

Example:
  >>> import jax, jaxpar
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxpar.data_parallel import internal
  >>> mesh = jaxpar.make_mesh(data=8)
  >>> internal.padded_shape((3, 5), P('data'), mesh=mesh)   # 3 rows -> 8
  (8, 5)
"""

from jaxpar.data_parallel._blocks import vary_unsplit as vary_unsplit
from jaxpar.data_parallel._checks import check_opt_state as check_opt_state
from jaxpar.data_parallel._from_nnx import reseeded as reseeded
from jaxpar.data_parallel._microbatches import batch_size_of as batch_size_of
from jaxpar.data_parallel._padding import is_padded as is_padded
from jaxpar.data_parallel._padding import logical_shapes as logical_shapes
from jaxpar.data_parallel._padding import logical_sharding as logical_sharding
from jaxpar.data_parallel._padding import pad as pad
from jaxpar.data_parallel._padding import padded_optimizer as padded_optimizer
from jaxpar.data_parallel._padding import padded_shape as padded_shape
from jaxpar.data_parallel._padding import place as place
from jaxpar.data_parallel._padding import place_like as place_like
from jaxpar.data_parallel._padding import unpadded as unpadded
from jaxpar.data_parallel._specs import ZERO_STAGES as ZERO_STAGES
from jaxpar.data_parallel._specs import check_zero_stage as check_zero_stage

__all__ = [
    'ZERO_STAGES', 'batch_size_of', 'check_opt_state', 'check_zero_stage',
    'is_padded', 'logical_shapes', 'logical_sharding', 'pad',
    'padded_optimizer', 'padded_shape', 'place', 'place_like', 'reseeded',
    'unpadded', 'vary_unsplit',
]
