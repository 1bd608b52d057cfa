"""Varying-axis typing helpers for values inside ``jax.shard_map``.

With ``check_vma``, every value carries the mesh axes over which it varies;
scan carries, loop carries and buffer writes must agree on them. These
helpers cast values up to the axes a buffer or block expects.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jaxpar import _compat

PyTree = Any


def vma(tree: PyTree) -> frozenset[str]:
  """Mesh axes over which any leaf of ``tree`` varies (inside ``shard_map``)."""
  out = frozenset()
  for leaf in jax.tree.leaves(tree):
    out |= _compat.varying_axes(leaf)
  return out


def vary(tree: PyTree, axes: frozenset[str]) -> PyTree:
  """Casts every leaf to varying over ``axes`` (a no-op where it already is)."""
  def one(x):
    missing = tuple(sorted(frozenset(axes) - vma(x)))
    return jax.lax.pcast(x, missing, to='varying') if missing else x
  return jax.tree.map(one, tree)


def like(tree: PyTree, avals: PyTree) -> PyTree:
  """Casts each leaf of ``tree`` to the varying axes of the matching aval."""
  return jax.tree.map(lambda x, a: vary(x, vma(a)), tree, avals)


def full(avals: PyTree, fill: float, n: int | None = None) -> PyTree:
  """Arrays like ``avals`` (``[n, *shape]`` if ``n``) holding ``fill``.

  Non-float leaves hold 0; the varying axes are those of the avals.
  """
  def one(a):
    value = fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
    shape = a.shape if n is None else (n,) + a.shape
    return vary(jnp.full(shape, value, a.dtype), vma(a))
  return jax.tree.map(one, avals)
