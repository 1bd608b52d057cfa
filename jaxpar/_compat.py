"""The only place jaxpar touches JAX internals (``jax._src``, ``jax.core``).

Each helper names the public API to switch to once JAX has one; everything
else in jaxpar uses public JAX only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
# pylint: disable=g-bad-import-order
from jax._src import config, core, custom_derivatives, xla_bridge
from jax._src import linear_util as lu
from jax._src.interpreters import ad


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


def without_varying(x: Any, axes: frozenset[str]) -> Any:
  """The abstract value of ``x`` typed as not varying over ``axes``.

  For tracing a function as if its inputs were the same on every device of
  ``axes`` (``jaxpar.vma.lift``). Public replacement: none; a
  ``jax.ShapeDtypeStruct(..., vma=...)`` argument would do.
  """
  aval = x if is_abstract_array(x) else jax.typeof(x)
  mat = getattr(aval, 'manual_axis_type', None)
  if mat is None or not mat.varying & axes:
    return aval
  return aval.update(manual_axis_type=mat.update(varying=mat.varying - axes))


def is_pvary(primitive: Any) -> bool:
  """Whether ``primitive`` is the cast ``lax.pcast(..., to='varying')`` binds.

  Public replacement: ``jax.extend.core.primitives`` has no ``pvary_p``.
  """
  return primitive is core.pvary_p


def bind_custom_rule(eqn: Any, args: list, evaluate: Callable[..., list]
                     ) -> list:
  """Re-binds a ``custom_jvp_call`` / ``custom_vjp_call`` equation on ``args``.

  The primal function and the JVP (or forward) rule are ``evaluate(jaxpr,
  consts, operands)`` of their jaxprs instead of ``core.eval_jaxpr``; the
  backward rule is kept. Mirrors ``custom_derivatives.lift_jvp`` /
  ``lift_fwd`` of jax 0.10. Public replacement: none (rebuild the rule with
  ``jax.custom_jvp``/``custom_vjp`` if jaxpr params become public).
  """
  params = eqn.primitive.get_bind_params(eqn.params)
  call_jaxpr = eqn.params['call_jaxpr']
  num_consts = eqn.params['num_consts']
  fun = lu.wrap_init(lambda *a: evaluate(call_jaxpr.jaxpr, call_jaxpr.consts,
                                         a),
                     debug_info=call_jaxpr.jaxpr.debug_info)
  if eqn.primitive is custom_derivatives.custom_jvp_call_p:
    jvp_jaxpr_fun = eqn.params['jvp_jaxpr_fun']

    def jvp(*xs):
      n = len(xs) // 2
      primals, tangents = xs[num_consts:n], xs[n + num_consts:]
      zero = [type(t) is custom_derivatives.SymbolicZero for t in tangents]
      jaxpr, consts, out_zeros = jvp_jaxpr_fun.call_wrapped(*zero)
      out = evaluate(jaxpr, consts, [*primals, *(
          t for t, z in zip(tangents, zero) if not z)])
      out_primals, nz = out[:len(out_zeros)], iter(out[len(out_zeros):])
      return [*out_primals, *(
          custom_derivatives.SymbolicZero(jax.typeof(p).to_tangent_aval())
          if z else next(nz) for p, z in zip(out_primals, out_zeros))]

    params['subfuns'] = (fun, lu.wrap_init(
        jvp, debug_info=jvp_jaxpr_fun.debug_info))
  else:
    fwd_jaxpr_thunk = eqn.params['fwd_jaxpr_thunk']

    def fwd(*xs):
      vals, nonzeros = xs[::2], xs[1::2]
      if any(nonzeros[:num_consts]):
        raise ad.CustomVJPException()
      jaxpr, consts = fwd_jaxpr_thunk.call_wrapped(*nonzeros[num_consts:])
      return evaluate(jaxpr, consts, vals[num_consts:])

    bwd = params['subfuns'][2]

    def unchecked_bwd(*xs):  # its input types were recorded without `axes`
      with config.disable_bwd_checks(True):
        return bwd.call_wrapped(*xs)

    params['subfuns'] = (
        fun, lu.wrap_init(fwd, debug_info=fwd_jaxpr_thunk.debug_info),
        lu.wrap_init(unchecked_bwd, debug_info=bwd.debug_info))
  return eqn.primitive.bind(*args, **params)
