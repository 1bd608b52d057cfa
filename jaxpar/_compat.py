"""The only place jaxpar touches JAX internals (``jax._src``, ``jax.core``).

Each helper names the public API to switch to once JAX has one; everything
else in jaxpar uses public JAX only.
"""

from __future__ import annotations

from typing import Any

import jax
from jax._src import xla_bridge  # pylint: disable=g-bad-import-order


def backends_are_initialized() -> bool:
  """Whether JAX has started its backends (device count then fixed).

  Public replacement: none yet. ``jax.config.update('jax_num_cpu_devices',
  n)`` raises once the backends run, but only after the fact and without the
  count we need to tell "already set to n" from "too late".
  """
  return xla_bridge.backends_are_initialized()


def is_abstract_array(x: Any) -> bool:
  """Whether ``x`` is already an abstract array (a ``ShapedArray``).

  Public replacement: ``isinstance(x, jax.ShapeDtypeStruct)`` does not cover
  the avals ``jax.typeof`` returns; switch when ``jax.typeof`` accepts its
  own result.
  """
  return isinstance(x, jax.core.ShapedArray)


def varying_axes(x: Any) -> frozenset[str]:
  """Manual mesh axes over which ``x`` varies inside ``jax.shard_map``.

  ``jax.typeof(x).manual_axis_type.varying``: the check_vma type, empty
  outside ``shard_map``. Public replacement: ``jax.typeof(x).vma`` was the
  public name up to jax 0.8; use the field JAX documents next.
  """
  # A ShapeDtypeStruct (eval_shape) carries its own type: jax.typeof asserts
  # on one from inside a shard_map manual over some axes only.
  aval = (x if is_abstract_array(x) or isinstance(x, jax.ShapeDtypeStruct)
          else jax.typeof(x))
  mat = getattr(aval, 'manual_axis_type', None)
  return frozenset(mat.varying) if mat is not None else frozenset()


def scan_counts(params: dict[str, Any]) -> tuple[int, int]:
  """``(num_consts, num_carry)`` of a ``scan`` equation's params.

  Up to jax 0.10 they are params of their own; jax 0.11 groups the inputs
  in a flat tree, ``ft_in.unpack() == (consts, carry, xs)``, each of whose
  ``len`` is its number of leaves. Public replacement: none (jaxpr params are
  internal); switch if ``jax.extend`` documents the scan rule.
  """
  if 'num_consts' in params:
    return params['num_consts'], params['num_carry']
  consts, carry, _ = params['ft_in'].unpack()
  return len(consts), len(carry)
