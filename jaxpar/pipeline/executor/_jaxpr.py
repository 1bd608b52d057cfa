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


def _inner(params: dict) -> jex.ClosedJaxpr:
  inner = params.get('jaxpr', params.get('call_jaxpr', params.get('fun_jaxpr')))
  return inner if isinstance(inner, jex.ClosedJaxpr) else jex.ClosedJaxpr(
      inner, ())


def bind(eqn: jex.JaxprEqn, ins: Sequence[Any]) -> list:
  """``eqn``'s primitive applied to ``ins`` (under a trace): its outputs."""
  outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
  return outs if eqn.primitive.multiple_results else [outs]


def scan_parts(params: dict, ins: Sequence[Any]) -> tuple[list, list, list]:
  """A ``scan`` eqn's operands (or body invars) as ``(consts, carry, xs)``,
  from its ``params``."""
  num_consts, num_carry = _compat.scan_counts(params)
  ins = list(ins)
  return (ins[:num_consts], ins[num_consts:num_consts + num_carry],
          ins[num_consts + num_carry:])


def evaluate(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
             run: Callable[[jex.JaxprEqn, list], list] = bind) -> list:
  """``jaxpr(*args)`` (under a trace), each eqn run by ``run(eqn, ins)``
  (default: bound as it is) in its own context, as ``jax.core.eval_jaxpr``
  does. The one interpreter of jaxpar's jaxpr passes (``flatten``,
  ``_remat``, ``data_parallel``'s per-layer gathering), which differ in
  ``run``."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  read = lambda v: v.val if not is_var(v) else env[v]
  for eqn in jaxpr.eqns:
    ins = [read(v) for v in eqn.invars]
    with eqn.ctx.manager:
      env.update(zip(eqn.outvars, run(eqn, ins)))
  return [read(v) for v in jaxpr.outvars]


def rebind_scan(eqn: jex.JaxprEqn, ins: Sequence[Any],
                body: Callable[[list], list],
                wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
                = lambda step: step) -> list:
  """A ``scan`` eqn re-bound by ``lax.scan``, its body ``body(invars) ->
  outvars`` (``wrap``: applied to the step, e.g. a ``jax.checkpoint``)."""
  params = eqn.params
  consts, carry, xs = scan_parts(params, ins)
  num_carry = len(carry)

  def step(carry, xs):
    outs = body([*consts, *carry, *xs])
    return outs[:num_carry], outs[num_carry:]
  carry, ys = jax.lax.scan(wrap(step), carry, xs, length=params['length'],
                           reverse=params['reverse'], unroll=params['unroll'])
  return [*carry, *ys]


def _inlined(eqn: jex.JaxprEqn, ins: list) -> list:
  """``flatten``'s ``run``: calls inlined, in scan bodies too."""
  if eqn.primitive.name in _CALLS:
    inner = _inner(eqn.params)
    return evaluate(inner.jaxpr, inner.consts, ins, _inlined)
  if eqn.primitive.name == 'scan':
    body = eqn.params['jaxpr']
    return rebind_scan(eqn, ins, lambda args: evaluate(
        body.jaxpr, body.consts, args, _inlined))
  return bind(eqn, ins)


def flatten(fn: Callable[..., Any], *args) -> jex.ClosedJaxpr:
  """``jax.make_jaxpr(fn)(*args)`` with jit and remat calls inlined.

  Every operation then stands alone in the jaxpr, so slices of it can keep
  or drop each one; a ``lax.scan`` stays one (its body flattened in turn),
  so the jaxpr does not grow with the number of iterations.
  """
  closed = jax.make_jaxpr(fn)(*args)
  return jax.make_jaxpr(lambda *a: evaluate(closed.jaxpr, closed.consts, a,
                                            _inlined))(*args)
