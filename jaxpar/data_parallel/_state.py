"""A ZeRO state from outside ``jit``: placed on a mesh, and measured.

``shard_state`` stores a ``TrainState`` in the layout a ZeRO stage's step
keeps (``state_specs`` with the data axis added, ``Padded`` where no dim
divides); ``bytes_per_device`` reads what the fullest device holds of it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.data_parallel._padding import logical_shapes, place
from jaxpar.data_parallel._specs import check_zero_stage, data_specs, state_specs
from jaxpar.train_state import TrainState
from jaxpar.train_state.internal import PyTree


def _check_train_state(state: Any, fn: str) -> None:
  if not isinstance(state, TrainState):
    raise TypeError(f'{fn} needs a jaxpar.TrainState (see TrainState.create), '
                    f'got {type(state).__name__}.')


def shard_state(state: TrainState, *, mesh: Mesh, data_axis: str = 'data',
                zero_stage: int = 1) -> TrainState:
  """``state`` placed on ``mesh`` in the ZeRO layout of ``zero_stage``.

  The state ``jaxpar.data_parallel.trainer(..., zero_stage=zero_stage).step``
  keeps (the step also places any state itself; this is for looking at the
  layout, or placing once ahead of time). Works on any state: plain, or in
  another stage's or mesh's layout; ``zero_stage=0`` gives it replicated
  over ``mesh``, at its logical shapes.

  Args:
    state: a ``TrainState`` (e.g. from ``TrainState.create``).
    mesh: the mesh the step runs on.
    data_axis: the mesh axis to split over, size ``N``.
    zero_stage: 0, 1 or 3.

  Returns:
    the ``TrainState`` sharded as ``state_specs`` says (``pad=True``): each
    device holds ``1/N`` of every split leaf
    (``x.sharding.shard_shape(x.shape)``), or ``ceil(d/N)`` of the ``d``
    rows of a ``Padded`` one.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((16, 3))},
    ...                                  optax.adam(0.1))
    >>> state = jaxpar.data_parallel.shard_state(
    ...     state, mesh=jaxpar.make_mesh(data=8), zero_stage=1)
    >>> mu = state.opt_state[0].mu['w']
    >>> mu.shape, mu.sharding.shard_shape(mu.shape)
    ((16, 3), (2, 3))
  """
  _check_train_state(state, 'jaxpar.data_parallel.shard_state')
  zero_stage = check_zero_stage(zero_stage)
  logical = logical_shapes(state)
  base = jax.tree.map(lambda _: P(), logical.params)
  specs = state_specs(logical, zero_stage=zero_stage, param_specs=base,
                      zero_specs=data_specs(logical.params, mesh=mesh,
                                            data_axis=data_axis, pad=True))
  return place(state, specs, mesh=mesh)


class StateBytes(NamedTuple):
  """Bytes one device holds of a state: the max over devices of each part.

  Attributes:
    params: of ``state.params``.
    opt_state: of ``state.opt_state`` (with ``step``).
  """
  params: int
  opt_state: int


def _max_device_bytes(tree: PyTree) -> int:
  held: dict[Any, int] = {}
  for x in jax.tree.leaves(tree):
    for shard in getattr(x, 'addressable_shards', ()):
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return max(held.values(), default=0)


def bytes_per_device(state: TrainState) -> StateBytes:
  """Bytes of ``state``'s params and optimizer state on the fullest device.

  Read from the arrays' addressable shards (``Padded`` leaves with their
  padding; host numpy leaves count 0). Plain DP holds everything on every
  device; ZeRO-1 ``~1/N`` of the optimizer state, ZeRO-3 of the params too.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> state = jaxpar.TrainState.create({'w': jnp.ones((16, 3))},
    ...                                  optax.adam(0.1))
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> jaxpar.data_parallel.bytes_per_device(
    ...     jaxpar.data_parallel.shard_state(state, mesh=mesh, zero_stage=1))
    StateBytes(params=192, opt_state=56)
  """
  _check_train_state(state, 'jaxpar.data_parallel.bytes_per_device')
  return StateBytes(_max_device_bytes(state.params),
                    _max_device_bytes((state.step, state.opt_state)))
