"""Stage parameters between model order ``[S, ...]`` and rank order ``[p, v, ...]``."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from jaxpar.pipeline.schedules import Schedule, local_stages

PyTree = Any


def _stage_order(schedule: Schedule) -> np.ndarray:
  """Model-order stage index of each ``(rank, local)`` position, flattened."""
  return np.array([k for stages in local_stages(schedule) for k in stages])


def stages_to_ranks(tree: PyTree, schedule: Schedule, *,
                    out_sharding: NamedSharding | None = None) -> PyTree:
  """Rearranges a ``[num_stages, ...]`` stack into rank order ``[p, v, ...]``.

  Row ``[r, j]`` holds the ``j``-th stage (ascending) that ``schedule.placement``
  puts on rank ``r``; ``v = num_stages // p``. Shard dim 0 over the pipeline
  axis to give every rank its own stages.

  Args:
    tree: pytree of ``[num_stages, ...]`` arrays, in model order.
    schedule: the ``Schedule`` whose placement to follow.
    out_sharding: sharding of the ``[num_stages, ...]`` rows after
      reordering, before the reshape (needed under ``jit`` with explicit mesh
      axes, e.g. ``NamedSharding(mesh, P('stage'))``).

  Returns:
    The pytree with leaves ``[p, v, ...]``.

  Example:
    >>> import numpy as np, jaxpar
    >>> s = jaxpar.pipeline.interleaved_one_f_one_b(2, 4, 2)   # placement (0, 1, 0, 1)
    >>> jaxpar.pipeline.stages_to_ranks(np.arange(4), s).tolist()
    [[0, 2], [1, 3]]
  """
  return _permute(tree, _stage_order(schedule), schedule.num_ranks,
                  out_sharding, to_ranks=True)


def ranks_to_stages(tree: PyTree, schedule: Schedule, *,
                    out_sharding: NamedSharding | None = None) -> PyTree:
  """Inverse of ``stages_to_ranks``: ``[p, v, ...]`` back to ``[num_stages, ...]``.

  Example:
    >>> import numpy as np, jaxpar
    >>> s = jaxpar.pipeline.zero_bubble_v(2, 2)   # placement (0, 1, 1, 0)
    >>> jaxpar.pipeline.ranks_to_stages(np.array([[0, 3], [1, 2]]), s).tolist()
    [0, 1, 2, 3]
  """
  return _permute(tree, np.argsort(_stage_order(schedule)), schedule.num_ranks,
                  out_sharding, to_ranks=False)


def _permute(tree, order, p, out_sharding, *, to_ranks):
  """Rows of each leaf in ``order`` (skipped when it is the identity).

  The shapes are spelled out from the stage count rather than inferred
  with ``-1``: a zero-size leaf (``[S, 0]``) leaves ``-1`` undetermined.
  """
  num_stages = len(order)
  identity = np.array_equal(order, np.arange(num_stages))

  def one(a):
    if not to_ranks:
      a = a.reshape((num_stages,) + a.shape[2:])
    if not identity:
      a = jnp.asarray(a).at[order].get(out_sharding=out_sharding)
    return (a.reshape((p, num_stages // p) + a.shape[1:]) if to_ranks
            else a)
  return jax.tree.map(one, tree)
