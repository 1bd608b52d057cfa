"""The batch as microbatches, and the call of a user function on one.

``microbatched`` splits the step's batch into the ``m`` microbatches the
tick table names; ``with_key`` gives the trailing arguments of a stage, loss
or embedding function called on one microbatch (its key, when the step has
one), ``with_state`` a stateful stage's last one (its state).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

PyTree = Any


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


def with_key(key: Any) -> tuple:
  """The trailing arguments of a user function: ``(key,)``, or ``()``."""
  return () if key is None else (key,)


def with_state(state: PyTree, pick: Any) -> tuple:
  """A stateful stage's last argument, ``(pick(state),)`` (its stage's
  part of ``state``), or ``()`` without a state."""
  return () if state is None else (pick(state),)


def row(tree: PyTree, j: Any) -> PyTree:
  """Row ``j`` of every leaf (``None`` stays ``None``): one microbatch, or
  one local stage of stacked ``[v, ...]`` params."""
  return jax.tree.map(lambda a: a[j], tree)
