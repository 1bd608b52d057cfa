"""The batch as microbatches, and the call of a user function on one.

``microbatched`` splits the step's batch into the ``m`` microbatches the
tick table names. ``extras`` gives jaxpar's extra arguments of a user
function called on one microbatch, by keyword: every stage, loss and
embedding function takes its data positionally and ``key=`` (when the step
has a key) and ``state=`` (a stateful stage) by keyword::

  stage_fn(params, x)                      # no key, no state
  stage_fn(params, x, key=k)               # a step with a key
  stage_fn(params, x, state=s) -> (y, s)   # a stage with model state
  loss_fn(loss_params, y, target, key=k)
  embed_fn(embed_params, raw, key=k)
"""

from __future__ import annotations

from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


class StageFn(Protocol):
  """A pipeline stage: ``stage_fn(params, x) -> y``, ``y`` like ``x``.

  ``params`` is one stage's slice of the stacked stage parameters and ``x``
  one microbatch's activation. With a step key it is called
  ``stage_fn(params, x, key=k)``; with model state (``stage_state``)
  ``stage_fn(params, x, state=s)`` and returns ``(y, new_state)``.
  """

  def __call__(self, params: PyTree, x: jax.Array, /, **extras: Any) -> Any:
    ...


class LossFn(Protocol):
  """The loss after the last stage: ``loss_fn(loss_params, y, target)``.

  Returns one microbatch's mean loss, a float scalar (``(loss, aux)`` with
  ``has_aux``); called ``loss_fn(loss_params, y, target, key=k)`` with a
  step key.
  """

  def __call__(self, loss_params: PyTree, y: jax.Array, target: PyTree, /,
               **extras: Any) -> Any:
    ...


def microbatched(inputs: jax.Array, targets: PyTree, m: int):
  """``inputs`` and every ``targets`` leaf reshaped to ``[m, batch/m, ...]``."""
  if np.ndim(inputs) == 0:
    raise ValueError(f'inputs must have a leading batch axis, got shape '
                     f'{np.shape(inputs)}.')
  batch = np.shape(inputs)[0]
  if batch % m:
    raise ValueError(
        f'inputs batch size {batch} is not divisible by the schedule\'s '
        f'num_microbatches={m}: use a batch that is a multiple of {m} or a '
        f'schedule whose microbatch count divides {batch}.')
  for path, leaf in jax.tree_util.tree_leaves_with_path(targets):
    if not np.shape(leaf) or np.shape(leaf)[0] != batch:
      raise ValueError(
          f'targets{jax.tree_util.keystr(path)} has shape {np.shape(leaf)} but '
          f'inputs has batch size {batch}: inputs and targets must share the '
          'leading batch axis.')
  split = lambda a: jnp.reshape(a, (m, batch // m) + np.shape(a)[1:])
  return split(inputs), jax.tree.map(split, targets)


def extras(key: Any = None, state: PyTree = None) -> dict[str, Any]:
  """The keyword arguments jaxpar adds to a user function's data: ``key``
  and ``state`` where they are not ``None``.

  Example:
    >>> from jaxpar.pipeline.executor._microbatches import extras
    >>> extras(), extras(key=1), extras(state={'n': 0})
    ({}, {'key': 1}, {'state': {'n': 0}})
  """
  return {name: value for name, value in (('key', key), ('state', state))
          if value is not None}


def row(tree: PyTree, j: Any) -> PyTree:
  """Row ``j`` of every leaf (``None`` stays ``None``): one microbatch, or
  one local stage of stacked ``[v, ...]`` params."""
  return jax.tree.map(lambda a: a[j], tree)
