"""Ordinary JAX inside jaxpar's ``shard_map``: constants meet varying values.

Inside ``jax.shard_map`` (``check_vma=True``) every value is typed with the
mesh axes it varies over. Everything computed from a data shard or from a
pipeline rank's params varies over ``'data'`` / ``'stage'``, while a
constant made inside the user's function does not. Arithmetic mixes them
freely (JAX inserts the cast), but control flow does not: a ``lax.scan`` or
``while_loop`` carry that starts as ``jnp.zeros`` and comes back varying, or
a ``lax.cond`` branch that returns ``0.``, is a ``TypeError`` -- in code that
runs on one device and that never saw the mesh.

``lift(fn, axes=...)`` runs ``fn`` as it runs on one device:

1. ``fn`` is traced to a jaxpr with its inputs typed as *not* varying over
   ``axes`` (the axes the caller's ``shard_map`` splits and ``fn`` never
   names), so every loop and branch in it type-checks as on one device;
   its other axes (e.g. ``'tensor'``, which tensor-parallel layers reduce
   over) keep their types;
2. the jaxpr is evaluated on the real inputs. Each operation first casts
   its operands to vary over the union of their ``axes`` (what JAX does
   for arithmetic); each ``scan`` / ``while`` / ``cond`` is rebuilt with
   ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` with its carries and
   branch outputs cast to the ``axes`` its operands vary over. ``jit``
   calls are inlined; ``checkpoint`` (remat), ``custom_jvp`` and
   ``custom_vjp`` keep their rules, their bodies evaluated the same way.

The casts are ``lax.pcast(x, a, to='varying')``: the identity on every
device, whose transpose is a ``psum`` over ``a`` -- exactly the gradient
JAX gives a value that every device uses (a constant has none). Values and
gradients are those of ``fn`` itself; collectives over the other axes keep
their ``check_vma`` meaning.

Every jaxpar step applies ``lift`` to the user's functions (the DP loss,
the pipeline's ``stage_fn`` / ``loss_fn``, the 3D trainer's three
functions), so users never write ``pcast``. Call it yourself only for a
``shard_map`` of your own.

Two helpers read and raise these types, for values that jaxpar's own loops
carry and for a ``shard_map`` of your own: ``varying_axes(tree)`` (the mesh
axes over which any leaf varies) and ``vary(tree, axes)`` (every leaf cast
up to vary over ``axes``). They are the one place jaxpar reads the type
(``_compat.varying_axes`` holds the JAX internals it needs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
import jax.extend.core.primitives as prims
import numpy as np

from jaxpar import _compat

__all__ = ['lift', 'vary', 'varying_axes']

PyTree = Any


def varying_axes(tree: PyTree) -> frozenset[str]:
  """The mesh axes over which any leaf of ``tree`` varies.

  Inside ``jax.shard_map`` (``check_vma=True``) each value is typed with the
  manual mesh axes over which it may differ between devices; this is the
  union of those types over the leaves. Leaves may be arrays or abstract
  values (``jax.eval_shape``'s ``ShapeDtypeStruct``s); other leaves (Python
  numbers, strings) and every value outside ``shard_map`` vary over nothing.

  Args:
    tree: any pytree.

  Returns:
    A ``frozenset`` of mesh axis names, empty outside ``shard_map``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> def f(x):
    ...   c = jnp.zeros(2)                  # the same on every device
    ...   print(sorted(jaxpar.vma.varying_axes(x)),
    ...         sorted(jaxpar.vma.varying_axes(c)),
    ...         sorted(jaxpar.vma.varying_axes({'x': x, 'c': c})))
    ...   return x + c
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> x = jax.device_put(jnp.ones(16), jax.NamedSharding(mesh, P('data')))
    >>> y = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P('data'),
    ...                           out_specs=P('data')))(x)
    ['data'] [] ['data']
  """
  return frozenset().union(*(_compat.varying_axes(x)
                             for x in jax.tree.leaves(tree) if _is_typed(x)))


def vary(tree: PyTree, axes: str | Iterable[str]) -> PyTree:
  """``tree`` with every leaf typed as varying over ``axes`` too.

  Each array leaf is cast with ``jax.lax.pcast(x, missing, to='varying')``
  over the axes of ``axes`` it does not yet vary over (a leaf that already
  does is returned as it is). The cast is the identity on every device; its
  transpose is a ``psum`` over the added axes. Use it where types must agree:
  a ``lax.scan`` carry that starts as a constant and comes back varying, a
  buffer written with values that vary. Non-array leaves pass unchanged.

  Args:
    tree: any pytree, inside ``jax.shard_map``.
    axes: a mesh axis name or several (e.g. ``varying_axes(other)``).

  Returns:
    ``tree`` with the same values, each array leaf varying over ``axes``
    (and over whatever it varied over before).

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> def f(x):
    ...   def body(total, row):             # carry: constant in, varying out
    ...     return total + row, None
    ...   start = jaxpar.vma.vary(jnp.zeros(2), jaxpar.vma.varying_axes(x))
    ...   total, _ = jax.lax.scan(body, start, x)
    ...   return total[None]                # this device's sum of 2 rows
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> xs = jax.device_put(jnp.ones((16, 2)),
    ...                     jax.NamedSharding(mesh, P('data')))
    >>> out = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P('data'),
    ...                             out_specs=P('data')))(xs)
    >>> out.shape, out.tolist()[0]
    ((8, 2), [2.0, 2.0])
  """
  axes = frozenset((axes,) if isinstance(axes, str) else axes)

  def one(x):
    if not isinstance(x, _VALUES):
      return x
    missing = tuple(sorted(axes - varying_axes(x)))
    return jax.lax.pcast(x, missing, to='varying') if missing else x
  return jax.tree.map(one, tree)


# What ``vary`` casts, and what carries a type ``varying_axes`` reads.
_VALUES = (jax.Array, np.ndarray, np.generic, bool, int, float, complex)


def _is_typed(x: Any) -> bool:
  return isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) or (
      _compat.is_abstract_array(x))


def lift(fn: Callable[..., Any], *, axes: Iterable[str]) -> Callable[..., Any]:
  """``fn`` runnable inside ``shard_map`` as it runs on one device.

  Args:
    fn: any JAX function of arrays (pytrees; non-array leaves are passed
      through as constants). It may use ``lax.scan``, ``fori_loop``,
      ``while_loop``, ``cond`` and ``switch`` with constant initial values
      or branches, ``jit``, ``checkpoint``, ``custom_jvp`` / ``custom_vjp``,
      flax ``nnx.scan`` / ``nnx.vmap``, and collectives over mesh axes that
      are not in ``axes``.
    axes: the manual mesh axes ``fn`` never names (e.g. ``('data',)``):
      its inputs may vary over them, constants made inside it do not.

  Returns:
    ``g`` with ``g(*args) == fn(*args)`` (values and gradients); outside
    ``shard_map`` it is ``fn``. Lifting a lifted function adds the axes.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> def rnn_loss(w, xs):                     # [T, B, D] -> scalar
    ...   h0 = jnp.zeros((xs.shape[1], w.shape[1]))
    ...   h, _ = jax.lax.scan(lambda h, x: (jnp.tanh(h @ w + x), None), h0, xs)
    ...   return jnp.mean(h ** 2)
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> loss = jax.shard_map(
    ...     lambda w, xs: jax.lax.pmean(
    ...         jaxpar.vma.lift(rnn_loss, axes=('data',))(w, xs), 'data'),
    ...     mesh=mesh, in_specs=(P(), P(None, 'data')), out_specs=P())
    >>> w, xs = jnp.eye(4) / 2, jnp.ones((3, 16, 4))
    >>> with jax.set_mesh(mesh):
    ...   sharded = jax.jit(jax.grad(loss))(w, jax.device_put(
    ...       xs, jax.NamedSharding(mesh, P(None, 'data'))))
    >>> bool(jnp.allclose(sharded, jax.grad(rnn_loss)(w, xs), atol=1e-6))
    True
  """
  if not callable(fn):
    raise TypeError(f'lift needs a callable, got {fn!r}.')
  axes = frozenset((axes,) if isinstance(axes, str) else axes)
  if isinstance(fn, _Lifted):
    return _Lifted(fn.fn, fn.axes | axes)
  return _Lifted(fn, axes)


class _Lifted:
  """``fn`` traced without ``axes`` and evaluated with casts (see module)."""

  def __init__(self, fn: Callable[..., Any], axes: frozenset[str]):
    self.fn, self.axes = fn, axes
    functools.update_wrapper(self, fn, updated=())

  def __call__(self, *args, **kwargs):
    leaves, tree = jax.tree.flatten((args, kwargs))
    if not _union(leaves, self.axes):   # outside shard_map, or nothing varies
      return self.fn(*args, **kwargs)
    arrays = [k for k, x in enumerate(leaves) if _is_array(x)]

    def flat_fn(*xs):
      full = list(leaves)
      for k, x in zip(arrays, xs):
        full[k] = x
      args, kwargs = jax.tree.unflatten(tree, full)
      return self.fn(*args, **kwargs)

    avals = [_compat.without_varying(leaves[k], self.axes) for k in arrays]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
    outs = _evaluate(closed.jaxpr, closed.consts,
                     [leaves[k] for k in arrays], self.axes)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _is_array(x: Any) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _union(xs: Sequence[Any], axes: frozenset[str]) -> frozenset[str]:
  """The axes of ``axes`` over which any of ``xs`` varies."""
  return varying_axes(list(xs)) & axes


def _cast_all(xs: Sequence[Any], target: frozenset[str]) -> list:
  return list(vary(list(xs), target))


def _read(env: dict, v: Any) -> Any:
  if isinstance(v, jex.Literal):
    return np.asarray(v.val, v.aval.dtype)
  return env[v]


def _evaluate(jaxpr: jex.Jaxpr, consts: Sequence[Any], args: Sequence[Any],
              axes: frozenset[str]) -> list:
  """``jaxpr(*args)``, casting operands, carries and branches over ``axes``."""
  env = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))
  for eqn in jaxpr.eqns:
    ins = [_read(env, v) for v in eqn.invars]
    rule = _RULES.get(eqn.primitive, _generic)
    with eqn.ctx.manager:
      outs = rule(eqn, ins, axes)
    env.update(zip(eqn.outvars, outs))
  return [_read(env, v) for v in jaxpr.outvars]


def _closed(closed: jex.ClosedJaxpr, axes: frozenset[str], target=None):
  """``closed`` as a function of a list, outputs cast to ``target``."""
  def run(*args):
    outs = _evaluate(closed.jaxpr, closed.consts, args, axes)
    return outs if target is None else _cast_all(outs, target)
  return run


def _generic(eqn: jex.JaxprEqn, ins: list, axes: frozenset[str]) -> list:
  prim = eqn.primitive
  if _compat.is_pvary(prim):  # only the axes the operand lacks
    return _cast_all(ins, frozenset(eqn.params['axes']))
  params = prim.get_bind_params(eqn.params)
  try:
    out = prim.bind(*_cast_all(ins, _union(ins, axes)), **params)
  except (TypeError, ValueError) as e:
    if not any(isinstance(p, (jex.Jaxpr, jex.ClosedJaxpr))
               for p in eqn.params.values()):
      raise
    raise TypeError(
        f'jaxpar cannot run `{prim.name}` inside a parallel step when its '
        f'operands vary over {sorted(axes)} ({e}). Write this part with '
        'lax.scan, lax.fori_loop, lax.while_loop, lax.cond/switch, jax.jit, '
        'jax.checkpoint, jax.custom_jvp or jax.custom_vjp, which jaxpar '
        'runs as on one device.') from e
  return list(out) if prim.multiple_results else [out]


def _call(eqn, ins, axes):
  inner = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
  if isinstance(inner, jex.ClosedJaxpr):
    return _evaluate(inner.jaxpr, inner.consts, ins, axes)
  return _evaluate(inner, (), ins, axes)


def _remat(eqn, ins, axes):
  p = eqn.params
  fn = lambda *a: _evaluate(p['jaxpr'], (), a, axes)
  return jax.checkpoint(fn, prevent_cse=p['prevent_cse'],
                        policy=p['policy'])(*ins)


def _scan(eqn, ins, axes):
  p = eqn.params
  num_consts, num_carry = _compat.scan_counts(p)
  consts, init = ins[:num_consts], ins[num_consts:num_consts + num_carry]
  xs = ins[num_consts + num_carry:]
  target = _union(ins, axes)
  body = _closed(p['jaxpr'], axes)

  def step(carry, x):
    outs = body(*consts, *carry, *x)
    return _cast_all(outs[:num_carry], target), outs[num_carry:]

  carry, ys = jax.lax.scan(step, _cast_all(init, target), xs,
                           length=p['length'], reverse=p['reverse'],
                           unroll=p['unroll'],
                           _split_transpose=p.get('_split_transpose', False))
  return [*carry, *ys]


def _while(eqn, ins, axes):
  p = eqn.params
  nc, nb = p['cond_nconsts'], p['body_nconsts']
  cconsts, bconsts, init = ins[:nc], ins[nc:nc + nb], ins[nc + nb:]
  target = _union(ins, axes)
  cond, body = _closed(p['cond_jaxpr'], axes), _closed(p['body_jaxpr'], axes)
  return jax.lax.while_loop(
      lambda c: cond(*cconsts, *c)[0],
      lambda c: _cast_all(body(*bconsts, *c), target),
      _cast_all(init, target))


def _cond(eqn, ins, axes):
  index, ops = ins[0], ins[1:]
  target = _union(ins, axes)
  branches = [_closed(b, axes, target) for b in eqn.params['branches']]
  return jax.lax.switch(index, branches, *ops)


def _custom(eqn, ins, axes):
  target = _union(ins, axes)
  evaluate = lambda jaxpr, consts, args: _cast_all(
      _evaluate(jaxpr, consts, args, axes), target)
  return _compat.bind_custom_rule(eqn, _cast_all(ins, target), evaluate)


_RULES = {
    prims.jit_p: _call, prims.closed_call_p: _call, prims.call_p: _call,
    prims.remat_p: _remat, prims.scan_p: _scan, prims.while_p: _while,
    prims.cond_p: _cond, prims.custom_jvp_call_p: _custom,
    prims.custom_vjp_call_p: _custom,
}
