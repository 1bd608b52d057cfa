"""The training state's parts that jaxpar's trainers build on.

For jaxpar's other packages (``data_parallel``, ``parallel``, the pipeline
executor, ``checkpoint``, ``async_ps``, the benchmarks); not API: these
names may change in any release. The option checks every trainer runs
(``check_optimizer``, ``check_max_grad_norm``, ``check_key``,
``check_compute_dtype``), a state placed on a mesh (``shardings``,
``placed_init``, ``replicated_specs``, ``signature``, ``auto_view``) and
the ``PyTree`` annotation.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxpar.train_state import internal
  >>> internal.replicated_specs({'mean': jnp.zeros(3), 'count': 0})
  {'count': P(), 'mean': P()}
"""

from jaxpar.train_state._options import (
    check_compute_dtype as check_compute_dtype)
from jaxpar.train_state._options import check_key as check_key
from jaxpar.train_state._options import (
    check_max_grad_norm as check_max_grad_norm)
from jaxpar.train_state._options import check_optimizer as check_optimizer
from jaxpar.train_state._placement import auto_view as auto_view
from jaxpar.train_state._placement import placed_init as placed_init
from jaxpar.train_state._placement import replicated_specs as replicated_specs
from jaxpar.train_state._placement import shardings as shardings
from jaxpar.train_state._placement import signature as signature
from jaxpar.train_state._state import PyTree as PyTree

__all__ = [
    'PyTree', 'auto_view', 'check_compute_dtype', 'check_key',
    'check_max_grad_norm', 'check_optimizer', 'placed_init',
    'replicated_specs', 'shardings', 'signature',
]
