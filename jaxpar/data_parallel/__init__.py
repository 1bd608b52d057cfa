"""Data parallelism with ZeRO: the DP trainer, ZeRO's specs and blocks, padded storage.

``trainer(loss_fn, optimizer, mesh=...)`` is single-device optax training on
the global batch, exactly, with the batch split over ``data``; ``zero_stage``
1 splits the optimizer state over ``data`` and 3 the params too (FSDP), every
leaf whatever the data size (a leaf that no dim divides is stored zero-padded,
``Padded``). The ZeRO building blocks (``data_spec``, ``gathered``,
``reduce_gradients``, ...) are what ``jaxpar.parallel`` composes with the
pipeline and tensor axes.
"""

from jaxpar.data_parallel._padding import Padded as Padded
from jaxpar.data_parallel._trainer import trainer as trainer
from jaxpar.data_parallel._zero import StateBytes as StateBytes
from jaxpar.data_parallel._zero import bytes_per_device as bytes_per_device
from jaxpar.data_parallel._zero import data_dim as data_dim
from jaxpar.data_parallel._zero import data_spec as data_spec
from jaxpar.data_parallel._zero import data_specs as data_specs
from jaxpar.data_parallel._zero import gather as gather
from jaxpar.data_parallel._zero import gathered as gathered
from jaxpar.data_parallel._zero import reduce_gradients as reduce_gradients
from jaxpar.data_parallel._zero import shard_state as shard_state
from jaxpar.data_parallel._zero import state_specs as state_specs

# jaxpar-internal (for jaxpar.parallel, jaxpar.checkpoint, the bench; not in
# __all__): batch and state checks, padded-storage plumbing.
from jaxpar.data_parallel._padding import is_padded as is_padded
from jaxpar.data_parallel._padding import logical_shapes as logical_shapes
from jaxpar.data_parallel._padding import logical_sharding as logical_sharding
from jaxpar.data_parallel._padding import pad as pad
from jaxpar.data_parallel._padding import padded_optimizer as padded_optimizer
from jaxpar.data_parallel._padding import padded_shape as padded_shape
from jaxpar.data_parallel._padding import place as place
from jaxpar.data_parallel._padding import place_like as place_like
from jaxpar.data_parallel._padding import unpadded as unpadded
from jaxpar.data_parallel._trainer import batch_size_of as batch_size_of
from jaxpar.data_parallel._trainer import check_opt_state as check_opt_state
from jaxpar.data_parallel._zero import ZERO_STAGES as ZERO_STAGES
from jaxpar.data_parallel._zero import check_zero_stage as check_zero_stage
from jaxpar.data_parallel._zero import vary as vary

__all__ = [
    'Padded', 'StateBytes', 'bytes_per_device', 'data_dim', 'data_spec',
    'data_specs', 'gather', 'gathered', 'reduce_gradients', 'shard_state',
    'state_specs', 'trainer',
]
