"""Buffers typed like the values they will hold, inside ``jax.shard_map``.

With ``check_vma``, every value carries the mesh axes over which it varies;
scan carries, loop carries and buffer writes must agree on them. ``like``
and ``full`` make the executor's buffers agree, on top of the one pair
``jaxpar.vma.varying_axes`` / ``jaxpar.vma.vary``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.vma import vary, varying_axes

PyTree = Any


def like(tree: PyTree, avals: PyTree) -> PyTree:
  """Casts each leaf of ``tree`` to the varying axes of the matching aval."""
  return jax.tree.map(lambda x, a: vary(x, varying_axes(a)), tree, avals)


def full(avals: PyTree, fill: float, n: int | None = None) -> PyTree:
  """Arrays like ``avals`` (``[n, *shape]`` if ``n``) holding ``fill``.

  Non-float leaves hold 0; the varying axes are those of the avals.
  """
  def one(a):
    value = fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
    shape = a.shape if n is None else (n,) + a.shape
    return vary(jnp.full(shape, value, a.dtype), varying_axes(a))
  return jax.tree.map(one, avals)
