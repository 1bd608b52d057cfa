"""Dataflow over jaxprs: what depends on what, slices, flattening.

The pipeline executor cuts a stage's backward into its input-gradient and
weight-gradient halves at the level of single operations (``StageVJP``).
These helpers work on ``jax.extend.core`` jaxprs (JAX's public API for
them); ``flatten`` also reads the parameters of the ``scan`` and call
primitives, the one place jaxpar depends on their layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxpar import _compat

# Primitives whose body ``flatten`` inlines: jit, remat (``jax.checkpoint``
# binds 'remat2': a stash policy's recompute, a user's or ZeRO-3's
# checkpoint), custom rules (in a VJP these are already differentiated,
# their bodies are the maths).
_CALLS = ('pjit', 'jit', 'closed_call', 'core_call', 'remat', 'remat2',
          'checkpoint', 'custom_jvp_call', 'custom_vjp_call',
          'custom_vjp_call_jaxpr')


def is_var(v: Any) -> bool:
  """Whether ``v`` (an eqn input or jaxpr output) is a variable, not a literal."""
  return not isinstance(v, jex.Literal)


def depends_on(jaxpr: jex.Jaxpr, sources: Sequence[Any]) -> set:
  """The variables of ``jaxpr`` computed (transitively) from ``sources``."""
  found = set(sources)
  for eqn in jaxpr.eqns:
    if any(is_var(v) and v in found for v in eqn.invars):
      found.update(eqn.outvars)
  return found


def needed(jaxpr: jex.Jaxpr, targets: Sequence[Any],
           stop: set = frozenset()) -> list[int]:
  """Indices of the eqns ``targets`` need, not looking past ``stop`` vars."""
  need = {v for v in targets if is_var(v) and v not in stop}
  keep = []
  for k in reversed(range(len(jaxpr.eqns))):
    eqn = jaxpr.eqns[k]
    if any(o in need for o in eqn.outvars):
      keep.append(k)
      need.update(v for v in eqn.invars if is_var(v) and v not in stop)
  return keep[::-1]


def subfunction(closed: jex.ClosedJaxpr, eqns: Sequence[int],
                invars: Sequence[Any], outvars: Sequence[Any]
                ) -> Callable[..., list]:
  """The computation of ``closed``'s ``eqns`` from ``invars`` to ``outvars``."""
  jaxpr = closed.jaxpr
  sub = jex.Jaxpr(jaxpr.constvars, list(invars), list(outvars),
                  [jaxpr.eqns[k] for k in eqns], jaxpr.effects,
                  jaxpr.debug_info)
  return jex.jaxpr_as_fun(jex.ClosedJaxpr(sub, closed.consts))


def _inner(params: dict) -> jex.ClosedJaxpr:
  inner = params.get('jaxpr', params.get('call_jaxpr', params.get('fun_jaxpr')))
  return inner if isinstance(inner, jex.ClosedJaxpr) else jex.ClosedJaxpr(
      inner, ())


def _evaluate(jaxpr: jex.Jaxpr, consts: Sequence[Any], *args) -> list:
  """``jaxpr(*args)`` with calls inlined and scans unrolled (under a trace)."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if not is_var(v) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    name = eqn.primitive.name
    if name in _CALLS:
      inner = _inner(eqn.params)
      outs = _evaluate(inner.jaxpr, inner.consts, *ins)
    elif name == 'scan':
      outs = _unrolled_scan(eqn.params, ins)
    else:
      outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(
          eqn.params))
      outs = outs if eqn.primitive.multiple_results else [outs]
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in jaxpr.outvars]


def _unrolled_scan(params: dict, ins: list) -> list:
  body, length = params['jaxpr'], params['length']
  num_consts, num_carry = _compat.scan_counts(params)
  consts = ins[:num_consts]
  carry = ins[num_consts:num_consts + num_carry]
  xs = ins[num_consts + num_carry:]
  steps = range(length - 1, -1, -1) if params['reverse'] else range(length)
  ys = {}
  for i in steps:
    outs = _evaluate(body.jaxpr, body.consts, *consts, *carry,
                     *[x[i] for x in xs])
    carry, ys[i] = outs[:len(carry)], outs[len(carry):]
  stacked = [jnp.stack([ys[i][k] for i in range(length)])
             for k in range(len(body.jaxpr.outvars) - len(carry))]
  return list(carry) + stacked


def flatten(fn: Callable[..., Any], *args) -> jex.ClosedJaxpr:
  """``jax.make_jaxpr(fn)(*args)`` with jit calls inlined, scans unrolled.

  Every operation then stands alone in the jaxpr, so slices of it can keep
  or drop each one (the layers of a ``lax.scan`` become separate layers).
  """
  closed = jax.make_jaxpr(fn)(*args)
  return jax.make_jaxpr(lambda *a: _evaluate(closed.jaxpr, closed.consts, *a))(
      *args)
