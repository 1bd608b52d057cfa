"""The executor's parts that jaxpar's other packages build on.

For jaxpar's other packages (``jaxpar.parallel``'s trainer and
``from_nnx``, the benchmarks); not API: these names may change in any
release. The checks of a user's functions and stage trees, the jaxpr
helpers that find which inputs a function reads, evaluate a jaxpr and
re-bind an equation (``data_parallel``'s per-layer ZeRO-3 gathering), a
remat policy applied
layer by layer (``remat_layers``), and the messages of a tick table.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxpar.pipeline.executor import internal
  >>> jaxpr = jax.make_jaxpr(lambda a, b: [jnp.sin(a), jnp.cos(b)][0])(
  ...     1.0, 2.0).jaxpr
  >>> internal.jaxpr_needed(jaxpr, jaxpr.outvars)   # the sin, not the cos
  [0]
"""

from jaxpar.pipeline.executor._checks import check_bool as check_bool
from jaxpar.pipeline.executor._checks import check_fn as check_fn
from jaxpar.pipeline.executor._checks import check_leading as check_leading
from jaxpar.pipeline.executor._jaxpr import bind as bind_eqn
from jaxpar.pipeline.executor._jaxpr import evaluate as evaluate_jaxpr
from jaxpar.pipeline.executor._jaxpr import is_var as is_jaxpr_var
from jaxpar.pipeline.executor._jaxpr import needed as jaxpr_needed
from jaxpar.pipeline.executor._jaxpr import scan_parts as scan_parts
from jaxpar.pipeline.executor._remat import remat_layers as remat_layers
from jaxpar.pipeline.executor._tick_rows import messages as tick_messages

__all__ = ['bind_eqn', 'check_bool', 'check_fn', 'check_leading',
           'evaluate_jaxpr', 'is_jaxpr_var', 'jaxpr_needed', 'remat_layers', 'scan_parts',
           'tick_messages']
