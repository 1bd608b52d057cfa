"""Buffers typed like the values they will hold, inside ``jax.shard_map``.

With ``check_vma``, every value carries the mesh axes over which it varies;
scan carries, loop carries and buffer writes must agree on them. ``like``
and ``full`` make the executor's buffers agree, on top of the one pair
``jaxpar.vma.varying_axes`` / ``jaxpar.vma.vary``.

An activation may be any pytree, integer leaves too (token ids, positions
passed along with ``x``). JAX's cotangent of an integer leaf is a
``float0`` zero, which no buffer holds: a buffer holds zeros of the leaf's
own dtype instead, and ``cotangent`` / ``stored`` convert between the two
at a ``jax.vjp``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.vma import vary, varying_axes

PyTree = Any


def like(tree: PyTree, avals: PyTree) -> PyTree:
  """Casts each leaf of ``tree`` to the varying axes of the matching aval."""
  return jax.tree.map(lambda x, a: vary(x, varying_axes(a)), tree, avals)


def matched(x: jax.Array, aval: Any) -> jax.Array:
  """``x`` typed with ``aval``'s varying axes: cast up (``vary``), or, over
  an axis ``x`` varies over and ``aval`` does not, narrowed by a ``pmax``
  over it -- exact for a value that is the same on every device of the axis
  but typed varying (a replicated stash leaf passed out of and back into a
  ``shard_map`` as ``P('tensor')``)."""
  extra = varying_axes(x) - varying_axes(aval)
  if extra:
    x = jax.lax.pmax(x, tuple(sorted(extra)))
  return vary(x, varying_axes(aval))


def full(avals: PyTree, fill: float, n: int | None = None) -> PyTree:
  """Arrays like ``avals`` (``[n, *shape]`` if ``n``) holding ``fill``.

  Non-float leaves hold 0; the varying axes are those of the avals.
  """
  def one(a):
    value = fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
    shape = a.shape if n is None else (n,) + a.shape
    return vary(jnp.full(shape, value, a.dtype), varying_axes(a))
  return jax.tree.map(one, avals)


def is_float(aval: Any) -> bool:
  """Whether a leaf (an array or its aval) is differentiated: inexact."""
  return jnp.issubdtype(aval.dtype, jnp.inexact)


def cotangent(tree: PyTree, avals: PyTree) -> PyTree:
  """``tree`` as ``jax.vjp`` takes it for values like ``avals``: the
  leaves of integer avals replaced by ``float0`` zeros."""
  return jax.tree.map(lambda d, a: d if is_float(a) else np.zeros(
      a.shape, jax.dtypes.float0), tree, avals)


def stored(tree: PyTree, avals: PyTree) -> PyTree:
  """A cotangent of values like ``avals`` as a buffer holds it: the leaves
  of integer avals (``float0`` from ``jax.vjp``) as zeros of their dtype."""
  return jax.tree.map(lambda d, a: d if is_float(a) else jnp.zeros(
      a.shape, a.dtype), tree, avals)


def put(buf: PyTree, index: Any, value: PyTree) -> PyTree:
  """``buf[index] = value`` (in place), cast to the buffer's varying axes."""
  return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(
      b, like(v, b[0]), index, 0), buf, value)
