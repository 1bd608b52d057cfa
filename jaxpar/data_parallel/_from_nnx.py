"""``DataParallelModel``: a user's own Flax NNX model as the DP trainer takes it.

``from_nnx(model, loss=lambda m, batch: ...)`` splits the model once into
its trained params (``nnx.Param``) and its model state (every other
``nnx.Variable`` the forward reads or updates: ``nnx.BatchStat`` running
statistics, counters), both nested dicts by attribute path, and gives the
loss as a pure function of them::

  loss_fn(params, batch, *, state, key=None) -> (loss, new_model_state)

which merges the values into a copy of the model inside the step, calls
``loss(m, batch)`` and reads the model state back: the user writes no
``nnx.split``/``nnx.merge`` plumbing. ``jaxpar.data_parallel.model_trainer``
trains the ``DataParallelModel`` and carries the
model state in ``TrainState.model_state``; ``update`` writes both back into
the model. It is ``jaxpar.parallel.from_nnx``'s counterpart for data
parallelism (same ``params``, ``to_state``, ``from_state``, ``update``).

RNG streams (``nnx.Rngs``) are neither params nor model state, as in
``jaxpar.parallel.from_nnx``: ``loss`` sees the model's own streams, and
with the trainer's ``key=`` each stream is reseeded from the key of the
microbatch, so the draws are those of one device on the same microbatches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
from flax import nnx
from flax import traverse_util

PyTree = Any

# What the model state holds: every variable but the params and RNG streams.
MODEL_STATE = nnx.All(nnx.Not(nnx.Param), nnx.Not(nnx.RngState))


class DataParallelModel(NamedTuple):
  """A Flax NNX model as ``jaxpar.data_parallel.model_trainer`` takes it.

  Attributes:
    params: the model's ``nnx.Param`` values, nested dicts by attribute path
      (``nnx.to_pure_dict``), e.g. ``{'linear': {'kernel': [d_in, d_out],
      'bias': [d_out]}}``.
    model_state: its other variables but RNG streams (``nnx.BatchStat``'s
      ``mean`` and ``var``, counters), nested the same way; ``{}`` if none.
    loss_fn: ``loss_fn(params, batch, *, state, key=None) -> (out,
      new_model_state)``, ``out`` what ``loss(m, batch)`` returns (a scalar,
      or ``(scalar, aux)``): the user's loss on the model holding these
      values, ``state`` the model state (``key``: its RNG streams reseeded
      from it).
    to_state: ``to_state(params, model_state=None) -> nnx.State`` of the
      model (its params and model state; RNG streams as in the model), for
      ``nnx.update`` and checkpoints of the model itself.
    from_state: its inverse, ``from_state(state) -> (params, model_state)``
      of an ``nnx.state(model)``.
  """
  params: PyTree
  model_state: PyTree
  loss_fn: Callable[..., Any]
  to_state: Callable[..., nnx.State]
  from_state: Callable[[nnx.State], tuple[PyTree, PyTree]]

  def update(self, model: nnx.Module, params: PyTree,
             model_state: PyTree = None) -> None:
    """Writes ``params`` (``trainer.params(state)``) and ``model_state``
    (``state.model_state``) into ``model``."""
    nnx.update(model, self.to_state(params, model_state))


class _Split(NamedTuple):
  """The model taken apart once: its graphdef and flat state by path."""
  graphdef: Any
  template: dict[tuple, nnx.Variable]
  params: frozenset[tuple]
  model_state: frozenset[tuple]


def from_nnx(model: nnx.Module, *,
             loss: Callable[[nnx.Module, Any], Any]) -> DataParallelModel:
  """``model`` and ``loss`` as ``data_parallel.model_trainer`` takes them.

  The model state after a step: each device threads it through its
  microbatches in order (running statistics updated once per microbatch),
  then entries every device computed alike come back as they are, and float
  entries that differ as their mean over ``data``. So with
  ``nnx.BatchNorm(..., axis_name='data')`` (statistics synced, as
  SyncBatchNorm) params and running statistics are those of the model on
  one device on the global batch (microbatch ``i`` of a step: every
  device's ``i``-th together); without it each device normalises its own
  shard, the running mean comes back as the global batch's and the running
  variance as the mean of the shards' variances.

  Args:
    model: a Flax NNX module, e.g. one with ``nnx.BatchNorm`` layers (in
      training mode: ``use_running_average=False``); see above for
      ``axis_name='data'``.
    loss: ``loss(m, batch) -> scalar`` (``(scalar, aux)`` with
      ``model_trainer``'s ``has_aux=True``), the mean loss of ``batch``
      written against the model in training mode; what it updates of the
      model's state (running statistics) is carried by the step.

  Returns:
    a ``DataParallelModel``: ``model_trainer(m, optimizer, mesh=...)``
    trains it, ``trainer.init(m.params, m.model_state)`` gives the first
    state and ``m.update(model, trainer.params(state), state.model_state)``
    writes the trained values back.

  Example:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> from flax import nnx
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.linear = nnx.Linear(4, 2, rngs=rngs)
    ...     self.bn = nnx.BatchNorm(2, axis_name='data', rngs=rngs)
    ...   def __call__(self, x):
    ...     return self.bn(self.linear(x))
    >>> net = Net(nnx.Rngs(0))
    >>> m = jaxpar.data_parallel.from_nnx(
    ...     net, loss=lambda m, b: jnp.mean((m(b['x']) - b['y']) ** 2))
    >>> sorted(m.params), sorted(m.model_state['bn'])
    (['bn', 'linear'], ['mean', 'var'])
    >>> trainer = jaxpar.data_parallel.model_trainer(
    ...     m, optax.sgd(0.1), mesh=jaxpar.make_mesh(data=8), zero_stage=3)
    >>> state = trainer.init(m.params, m.model_state)
    >>> batch = {'x': np.ones((16, 4), np.float32),
    ...          'y': np.zeros((16, 2), np.float32)}
    >>> state, stats = trainer.step(state, batch)
    >>> m.update(net, trainer.params(state), state.model_state)
    >>> net.bn.mean.shape
    (2,)
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f'model must be a Flax NNX module (nnx.Module), got '
                    f'{type(model).__name__}; for a loss of a params pytree '
                    'pass the loss function to data_parallel.trainer.')
  if not callable(loss):
    raise TypeError(f'loss must be a function loss(m, batch) -> scalar of '
                    f'the model, got {loss!r}.')
  graphdef, state = nnx.split(model)
  params_state, model_state = nnx.state(model, nnx.Param, MODEL_STATE)
  if not list(nnx.to_flat_state(params_state)):
    raise ValueError(f'model ({type(model).__name__}) has no nnx.Param: '
                     'there is nothing to train.')
  split = _Split(graphdef, dict(nnx.to_flat_state(state)),
                 frozenset(dict(nnx.to_flat_state(params_state))),
                 frozenset(dict(nnx.to_flat_state(model_state))))
  return DataParallelModel(
      nnx.to_pure_dict(params_state), nnx.to_pure_dict(model_state),
      functools.partial(_loss_fn, split, loss),
      functools.partial(_to_state, split),
      functools.partial(_from_state, split))


def _values(split: _Split, params: PyTree, model_state: PyTree
            ) -> dict[tuple, Any]:
  """``{path: value}`` of the params and the model state."""
  values = traverse_util.flatten_dict(params)
  if model_state is not None:
    values.update(traverse_util.flatten_dict(model_state))
  unknown = sorted(map(str, set(values) - set(split.template)))
  if unknown:
    raise ValueError(f'{unknown} are not variables of the model from_nnx '
                     'read: pass the params and model state from_nnx gave '
                     '(or trainer.params(state) and state.model_state).')
  return values


def _to_state(split: _Split, params: PyTree,
              model_state: PyTree = None) -> nnx.State:
  """``DataParallelModel.to_state``."""
  values = _values(split, params, model_state)
  return nnx.from_flat_state([(p, v.replace(values[p]))
                              for p, v in split.template.items()
                              if p in values])


def _from_state(split: _Split, state: nnx.State) -> tuple[PyTree, PyTree]:
  """``DataParallelModel.from_state``."""
  flat = {p: v for p, v in nnx.to_flat_state(state)}
  pick = lambda paths: traverse_util.unflatten_dict(
      {p: v.get_value() for p, v in flat.items() if p in paths})
  return pick(split.params), pick(split.model_state)


def reseeded(module: nnx.Module, key: jax.Array | None) -> nnx.Module:
  """``module`` with each of its RNG streams reseeded from ``key``."""
  if key is not None:
    tags = {s.tag for _, s in nnx.iter_graph(module)
            if isinstance(s, nnx.RngStream)}
    nnx.reseed(module, **{t: key for t in tags})
  return module


def _loss_fn(split: _Split, loss: Callable[..., Any], params: PyTree,
             batch: Any, *, state: PyTree,
             key: jax.Array | None = None) -> tuple[Any, PyTree]:
  """``DataParallelModel.loss_fn``: ``loss`` on a model built from the
  values (fresh variables, inside the caller's trace), then its model
  state read back."""
  values = _values(split, params, state)
  model = nnx.merge(split.graphdef, nnx.from_flat_state(
      [(p, v.replace(values[p] if p in values else v.get_value()))
       for p, v in split.template.items()]))
  out = loss(reseeded(model, key), batch)
  return out, nnx.to_pure_dict(nnx.state(model, MODEL_STATE))
