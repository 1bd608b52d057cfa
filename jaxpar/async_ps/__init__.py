"""An asynchronous parameter server: workers push stale gradients, bounded.

``AsyncParameterServer(loss_fn, optimizer, params, num_workers=,
max_staleness=)`` runs workers in threads that pull params, compute
gradients and push them; ``simulate`` replays a given staleness sequence
deterministically.
"""

from jaxpar.async_ps._server import AsyncParameterServer as AsyncParameterServer
from jaxpar.async_ps._server import AsyncResult as AsyncResult
from jaxpar.async_ps._server import simulate as simulate

__all__ = ['AsyncParameterServer', 'AsyncResult', 'simulate']
