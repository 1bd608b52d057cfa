"""What a train step carries and reports: ``TrainState``, ``StepStats``, ``Trainer``.

Every jaxpar trainer returns a ``Trainer(init, step, params, opt_state)``
of pure functions; ``step(state, batch) -> (state, StepStats)`` carries a
``TrainState`` from one step to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jaxpar.train_state._options import check_optimizer

PyTree = Any


class TrainState(NamedTuple):
  """What a train step carries from one step to the next.

  Attributes:
    step: int32 scalar, the number of updates applied so far (skipped,
      non-finite steps do not count).
    params: the model parameters (any pytree).
    opt_state: the optax optimizer state for ``params``.
    model_state: the model's variables that are not trained params (Flax
      NNX ``nnx.BatchStat`` running statistics, counters): the
      forward pass reads them and gives their new values, which every step
      carries to the next (not differentiated, not seen by the optimizer).
      ``None`` (the default) for a model without any.
  """
  step: jax.Array
  params: PyTree
  opt_state: PyTree
  model_state: PyTree = None

  @classmethod
  def create(cls, params: PyTree, optimizer: optax.GradientTransformation,
             model_state: PyTree = None) -> 'TrainState':
    """A fresh state: ``step=0`` and ``opt_state=optimizer.init(params)``.

    Example:
      >>> import jax.numpy as jnp, optax, jaxpar
      >>> state = jaxpar.TrainState.create({'w': jnp.zeros(3)}, optax.sgd(0.1))
      >>> int(state.step), state.model_state
      (0, None)
    """
    optimizer = check_optimizer(optimizer)
    return cls(jnp.zeros((), jnp.int32), params, optimizer.init(params),
               model_state)


class StepStats(NamedTuple):
  """Statistics of one train step, as device arrays (no host sync).

  Attributes:
    loss: global mean loss over the batch, before the update.
    grad_norm: global L2 norm of the gradient over all shards, before clipping.
    skipped: bool, True when the loss or gradient was non-finite and the
      update was not applied.
    aux: the ``loss_fn`` auxiliary output (``has_aux=True``), averaged over
      microbatches and replicas; ``None`` otherwise.
  """
  loss: jax.Array
  grad_norm: jax.Array
  skipped: jax.Array
  aux: PyTree = None


def stored_opt_state(state: TrainState) -> PyTree:
  """``state.opt_state`` as stored (``Trainer.opt_state``'s default)."""
  return state.opt_state


class Trainer(NamedTuple):
  """The pure functions of a training run, the one shape of every train step.

  Returned by ``jaxpar.data_parallel.trainer`` and
  ``jaxpar.parallel.trainer``.

  Attributes:
    init: ``init(params, model_state=None) -> TrainState``, placed and
      sharded on the mesh as the step expects it (ZeRO shardings included);
      ``model_state`` (``TrainState.model_state``) is stored replicated.
    step: ``step(state, batch) -> (state, StepStats)``, jitted; accepts plain
      (numpy or unplaced) arrays and places them; ``step.lower(state, batch)``
      gives the lowered program (for ``.compile().memory_analysis()``).
    params: ``params(state)`` -> the params in model order, as global arrays
      that keep their sharding (nothing is replicated: ``np.asarray(leaf)``
      gathers one leaf to the host, a jitted function uses them in place).
    opt_state: ``opt_state(state)`` -> the optimizer state laid out like
      ``params(state)`` (model order, logical shapes, the same mesh), as
      ``optimizer.init(params(state))`` would shape it: what optax's helpers
      take with the params, e.g.
      ``optax.contrib.schedule_free_eval_params(trainer.opt_state(state),
      trainer.params(state))``. Default: ``state.opt_state`` as stored.

  Example:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> loss_fn = lambda p, b: jnp.mean((b['x'] @ p['w'] - b['y']) ** 2)
    >>> trainer = jaxpar.data_parallel.trainer(
    ...     loss_fn, optax.adam(1e-3), mesh=jaxpar.make_mesh(data=8))
    >>> state = trainer.init({'w': jnp.zeros((4, 2))})
    >>> batch = {'x': np.ones((16, 4), np.float32),
    ...          'y': np.ones((16, 2), np.float32)}
    >>> state, stats = trainer.step(state, batch)
    >>> trainer.params(state)['w'].shape, int(state.step)
    ((4, 2), 1)
    >>> trainer.opt_state(state)[0].mu['w'].shape      # Adam's first moment
    (4, 2)
  """
  init: Callable[..., TrainState]
  step: Callable[[TrainState, PyTree], tuple[TrainState, StepStats]]
  params: Callable[[TrainState], PyTree]
  opt_state: Callable[[TrainState], PyTree] = stored_opt_state
