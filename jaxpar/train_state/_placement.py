"""Placing a ``TrainState`` on a mesh: shardings, a jitted ``init``, ``auto_view``.

``placed_init`` builds a trainer's ``init``: one jitted program per params
signature that stores the params as the step expects them and creates the
optimizer state already sharded. ``auto_view`` gives the arrays of a state
with the same shards on ``Auto`` mesh axes, as ``Trainer.params`` returns
them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.train_state._state import TrainState

PyTree = Any


def shardings(mesh: Mesh, specs: PyTree) -> PyTree:
  """``NamedSharding(mesh, spec)`` for every ``PartitionSpec`` of ``specs``."""
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                      is_leaf=lambda s: isinstance(s, P))


def auto_view(tree: PyTree) -> PyTree:
  """``tree``'s arrays with the same shards on their mesh's ``Auto``-axes twin.

  Arrays on ``Explicit`` axes carry their sharding in their type, and
  ``jnp`` code that slices a sharded dim must then say where the result
  goes. The same shards on ``Auto`` axes let any code run (XLA's
  partitioner decides), and nothing is replicated: this is what
  ``Trainer.params`` returns for evaluation and checkpoints.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> from jaxpar.train_state import internal
    >>> x = jax.device_put(jnp.arange(8.0), jax.sharding.NamedSharding(
    ...     jaxpar.make_mesh(data=8), P('data')))
    >>> y = internal.auto_view(x)
    >>> y.sharding.spec, float(y[3])
    (P('data',), 3.0)
  """
  def one(x):
    sharding = getattr(x, 'sharding', None)
    if not isinstance(sharding, NamedSharding):
      return x
    return jax.device_put(x, NamedSharding(_auto(sharding.mesh),
                                           sharding.spec))
  return jax.tree.map(one, tree)


def _auto(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis ``Auto``."""
  return Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def signature(tree: PyTree) -> tuple:
  """What a tree's shardings and programs depend on: its structure, shapes and
  dtypes (a cache key; the values do not enter it)."""
  return (jax.tree.structure(tree),
          tuple((np.shape(x), x.dtype if hasattr(x, 'dtype')
                 else np.result_type(x)) for x in jax.tree.leaves(tree)))


def _on_mesh(x: Any, mesh: Mesh) -> Any:
  """``x`` as an input of a program on ``mesh``.

  Host values stay as they are (the program copies each device its part);
  an array elsewhere (one device, another mesh) is copied whole to every
  device of ``mesh``: a copy needs no program, while moving it into a split
  sharding compiles one per shape (``jax.device_put``'s ``_multi_slice``).
  """
  if isinstance(x, jax.Array) and not (
      isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh):
    return jax.device_put(x, NamedSharding(mesh, P()))
  return x


def _init_program(prepare: Callable[[PyTree], PyTree],
                  optimizer: optax.GradientTransformation, specs: TrainState,
                  mesh: Mesh) -> Callable[[PyTree, PyTree], TrainState]:
  """One jitted ``(params, model_state) -> TrainState``: ``prepare``, then
  the params split as stored (``specs.params``), then ``optimizer.init`` on
  the sharded params (the optimizer state is born sharded), the state placed
  by ``specs``."""
  out = shardings(mesh, specs)

  def create(params, model_state):
    state = TrainState(jnp.zeros((), jnp.int32), params,
                       optimizer.init(params), model_state)
    return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype),
                        state)  # not weakly typed, as the step's output

  def placed(params, model_state):
    params = jax.device_put(prepare(params), out.params)
    return jax.sharding.auto_axes(create, out_sharding=out)(params,
                                                            model_state)
  return jax.jit(placed)


def replicated_specs(tree: PyTree) -> PyTree:
  """``P()`` for every leaf of ``tree`` (how ``model_state`` is stored)."""
  return jax.tree.map(lambda _: P(), tree)


def placed_init(
    storage: Callable[[PyTree], tuple[Callable[[PyTree], PyTree],
                                      optax.GradientTransformation,
                                      TrainState]],
    *, mesh: Mesh) -> Callable[..., TrainState]:
  """``init(params, model_state=None) -> TrainState``: a fresh state on ``mesh``.

  ``storage(params) -> (prepare, optimizer, specs)`` (called once per params
  signature, on shapes): ``prepare`` (pure ``jnp``) turns the params as given
  into the params as stored (e.g. padded, in rank order), ``optimizer``
  inits them and ``specs`` are the state's ``PartitionSpec``s. The
  ``model_state`` is stored replicated. Each signature is one jitted program
  (``_init_program``), compiled once per trainer: no per-leaf eager op
  compiles.
  """
  programs = {}

  def init(params: PyTree, model_state: PyTree = None) -> TrainState:
    key = signature((params, model_state))
    if key not in programs:
      prepare, optimizer, specs = storage(params)
      specs = specs._replace(model_state=replicated_specs(model_state))
      programs[key] = _init_program(prepare, optimizer, specs, mesh)
    params, model_state = jax.tree.map(lambda x: _on_mesh(x, mesh),
                                       (params, model_state))
    with jax.set_mesh(mesh):
      return programs[key](params, model_state)
  return init
