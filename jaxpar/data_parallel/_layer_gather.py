"""ZeRO-3's gathers at each param's first use: one layer at a time in a scan.

``at_first_use(fn, params, *args, data_axis=...)`` runs ``fn(params,
*args)`` inside ``shard_map`` with the split params held as this device's
slices (``Slice``: the slice and the dim of the full value it splits). It
traces ``fn`` on the full params' types and evaluates the jaxpr with each
split param held as its slice, gathering it where it is used:

* an elementwise operation of a slice alone (with scalars: a cast to the
  compute dtype, a scale) that does not widen its dtype runs on the slice,
  so ``compute_dtype=bfloat16`` gathers bf16;
* a ``slice`` / ``squeeze`` / ``transpose`` that keeps the split dim whole
  (``w[j]``: layer ``j`` of a stacked leaf, in an unrolled loop) runs on the
  slice too;
* a ``lax.scan`` that reads a slice as ``xs`` (a stacked ``[L, ...]`` leaf
  split on a dim after the layer dim) takes it sliced, and each iteration
  gathers its own layer inside the body: the forward holds one layer's
  params at a time, and the gather's transpose (a reduce-scatter) runs per
  layer in the backward's body (``nnx.scan`` binds one too). ``jit`` calls
  are inlined and ``jax.checkpoint`` calls (a remat policy's) keep their
  policy, their bodies evaluated the same way;
* any other use all-gathers there (``all_gather(..., to='varying')``: its
  transpose sums the gradient over ``data`` and keeps this device's slice).
  The use and its gathers run under ``jax.checkpoint`` with a policy that
  keeps every residual but the gathered params (``_not_gathers``): the
  backward pass gathers them again instead of holding them.

A stacked leaf split over its layer dim (its layer count is its largest dim)
is gathered whole where the scan reads it. A ``Padded`` leaf's gather is cut
to its logical size; under a policy that keeps everything, the cut copy is
what the backward keeps of it.

Example (inside ``shard_map``, as ``data_parallel.gathered`` calls it):
  >>> import jax, jax.numpy as jnp, jaxpar
  >>> from jax.sharding import PartitionSpec as P
  >>> from jaxpar.data_parallel import _layer_gather
  >>> def loss(w, x):                       # w [L, d, d], scanned
  ...   return jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, w)[0].sum()
  >>> def local(w, x):                      # w: this device's [L, d, d/2]
  ...   run = lambda w, x: _layer_gather.at_first_use(
  ...       loss, _layer_gather.Slice(w, dim=2), x, data_axis='data')
  ...   return jax.grad(run)(w, x)
  >>> mesh = jaxpar.make_mesh(data=2, devices=jax.devices()[:2])
  >>> w, x = jnp.ones((3, 4, 4)) / 4, jnp.ones((2, 4))
  >>> put = lambda a, *s: jax.device_put(a, jax.NamedSharding(mesh, P(*s)))
  >>> grad = jax.jit(jax.shard_map(
  ...     local, mesh=mesh, in_specs=(P(None, None, 'data'), P('data')),
  ...     out_specs=P(None, None, 'data')))(put(w, None, None, 'data'),
  ...                                       put(x, 'data'))
  >>> bool(jnp.allclose(grad, jax.grad(loss)(w, x)))   # summed over data
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp
import numpy as np

from jaxpar import vma
from jaxpar._compat import is_pvary
from jaxpar.pipeline.executor.internal import (bind_eqn, evaluate_jaxpr,
                                                scan_parts)

# Elementwise primitives that run on a slice when their other operands are
# scalars: the gather then moves their output (a cast: the compute dtype).
_ON_SLICE = frozenset((
    'abs', 'add', 'convert_element_type', 'copy', 'copy_p', 'div', 'exp',
    'integer_pow', 'log', 'logistic', 'max', 'min', 'mul', 'neg',
    'reduce_precision', 'rsqrt', 'sign', 'sqrt', 'square', 'sub', 'tanh'))

# Layout primitives that run on a slice when they keep its split dim whole.
_LAYOUT = frozenset(('dynamic_slice', 'slice', 'squeeze', 'transpose'))

# Calls whose body is evaluated in place (a ``jit`` boundary inside a traced
# function changes nothing).
_INLINED = ('pjit', 'jit', 'closed_call', 'core_call')


class Slice(NamedTuple):
  """A value this device holds a slice of: ``all_gather`` of ``value``
  along ``dim`` (over the data axis), cut to ``size`` along it when the
  leaf is stored padded (``None``: not padded), cast to ``dtype`` first
  (``None``: no cast)."""
  value: jax.Array
  dim: int
  size: int | None = None
  dtype: np.dtype | None = None

  def cast(self) -> Slice:
    """The cast applied to the slice's value."""
    if self.dtype is None:
      return self
    return self._replace(value=self.value.astype(self.dtype), dtype=None)


def full_type(s: Slice, n: int) -> Any:
  """The type of the gathered value (``n``: the data axis size)."""
  aval = jax.typeof(s.value)
  shape = list(aval.shape)
  shape[s.dim] = s.size if s.size is not None else shape[s.dim] * n
  return aval.update(shape=tuple(shape))


def gather_slice(s: Slice, *, data_axis: str) -> jax.Array:
  """The full value of ``s``, typed varying: the transpose of the gather is
  a reduce-scatter, the sum over ``data_axis`` of this device's slice (in
  the slice's own dtype when the gather casts: float32 gradients of
  bfloat16 gathers are summed in float32)."""
  if s.dtype is None:
    full = jax.lax.all_gather(s.value, data_axis, axis=s.dim, tiled=True,
                              to='varying')
  else:
    full = _cast_gather(s.value, s.dtype, s.dim, data_axis)
  if s.size is not None:
    full = jax.lax.slice_in_dim(full, 0, s.size, axis=s.dim)
  return full


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _cast_gather(x: jax.Array, dtype: np.dtype, dim: int,
                 data_axis: str) -> jax.Array:
  """``all_gather(x.astype(dtype))`` whose transpose reduce-scatters in
  ``x``'s dtype."""
  return jax.lax.all_gather(x.astype(dtype), data_axis, axis=dim, tiled=True,
                            to='varying')


def _cast_gather_fwd(x, dtype, dim, data_axis):
  # The residual: a scalar of x's dtype (the cotangent's dtype).
  return _cast_gather(x, dtype, dim, data_axis), jnp.zeros((), x.dtype)


def _cast_gather_bwd(dtype, dim, data_axis, like, ct):
  del dtype
  return (jax.lax.psum_scatter(ct.astype(like.dtype), data_axis,
                               scatter_dimension=dim, tiled=True),)


_cast_gather.defvjp(_cast_gather_fwd, _cast_gather_bwd)


def at_first_use(fn: Callable[..., Any], params: Any, *args,
                 data_axis: str, **kwargs) -> Any:
  """``fn(params, *args, **kwargs)`` with each ``Slice`` leaf of ``params``
  gathered at its first use (see the module doc); other leaves are used as
  they are."""
  leaves, treedef = jax.tree.flatten(
      params, is_leaf=lambda x: isinstance(x, Slice))
  n = jax.lax.axis_size(data_axis)
  types = [full_type(x, n) if isinstance(x, Slice) else x for x in leaves]
  rest, rest_def = jax.tree.flatten((args, kwargs))

  def flat_fn(params, *rest):
    args, kwargs = jax.tree.unflatten(rest_def, rest)
    return fn(jax.tree.unflatten(treedef, params), *args, **kwargs)
  closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(types,
                                                                 *rest)
  run = _Gathering(data_axis, in_scan=False)
  outs = run.evaluate(closed.jaxpr, closed.consts, [*leaves, *rest])
  return jax.tree.unflatten(jax.tree.structure(out_shape),
                            [run.whole(x) for x in outs])


def _not_gathers(data_axis: str) -> Callable[..., bool]:
  """A ``jax.checkpoint`` policy: keep every residual but a gather over
  ``data_axis`` (an ``all_gather``, or a custom-VJP call whose primal is one:
  ``_cast_gather``)."""
  def gathers(prim, params) -> bool:
    if prim.name == 'all_gather':
      names = params['axis_name']
      return data_axis in (names if isinstance(names, tuple) else (names,))
    if prim.name == 'custom_vjp_call':
      inner = params['call_jaxpr']
      return any(gathers(e.primitive, e.params) for e in inner.jaxpr.eqns)
    return False
  return lambda prim, *_, **params: not gathers(prim, params)


def _itemsize(x: Any) -> int:
  if isinstance(x, Slice):
    return np.dtype(x.dtype or x.value.dtype).itemsize
  return np.dtype(x.aval.dtype).itemsize


def _is_scalar(x: Any) -> bool:
  return not isinstance(x, Slice) and np.ndim(x) == 0


class _Gathering:
  """The evaluator: a jaxpr's values, ``Slice``s where the params are held
  sliced; ``in_scan``: inside a scan body (no CSE to prevent across the
  forward and backward bodies)."""

  def __init__(self, data_axis: str, *, in_scan: bool):
    self.data_axis, self.in_scan = data_axis, in_scan

  def whole(self, x: Any) -> Any:
    return gather_slice(x, data_axis=self.data_axis) if isinstance(
        x, Slice) else x

  def evaluate(self, jaxpr: jex.Jaxpr, consts: Sequence[Any],
               args: Sequence[Any]) -> list:
    return evaluate_jaxpr(jaxpr, consts, args, self._eqn)

  def _eqn(self, eqn: jex.JaxprEqn, ins: list) -> list:
    slices = [x for x in ins if isinstance(x, Slice)]
    name = eqn.primitive.name
    if not slices:
      return bind_eqn(eqn, ins)
    if name in _INLINED:
      inner = eqn.params.get('jaxpr', eqn.params.get('call_jaxpr'))
      if isinstance(inner, jex.ClosedJaxpr):
        return self.evaluate(inner.jaxpr, inner.consts, ins)
      return self.evaluate(inner, (), ins)
    if name == 'remat2':
      return self._remat(eqn, ins)
    if name == 'scan':
      return self._scan(eqn, ins)
    if is_pvary(eqn.primitive) and len(ins) == 1:
      s = ins[0]
      return [s._replace(value=vma.vary(s.value, eqn.params['axes']))]
    if (name in _ON_SLICE and len(slices) == 1 and len(eqn.outvars) == 1
        and all(isinstance(x, Slice) or _is_scalar(x) for x in ins)
        and _itemsize(eqn.outvars[0]) <= _itemsize(slices[0])):
      s = slices[0]
      if name == 'convert_element_type' and s.dtype is None:
        return [s._replace(dtype=eqn.params['new_dtype'])]
      s = s.cast()
      value, = bind_eqn(eqn, [s.value if isinstance(x, Slice) else x
                              for x in ins])
      return [s._replace(value=value)]
    if name in _LAYOUT and isinstance(ins[0], Slice) and len(slices) == 1:
      moved = self._layout(eqn, ins)
      if moved is not None:
        return [moved]
    return self._use(eqn, ins)

  def _layout(self, eqn: jex.JaxprEqn, ins: list) -> Slice | None:
    """A ``slice``, ``dynamic_slice``, ``squeeze`` or ``transpose`` of a
    slice that keeps its split dim whole (a layer indexed out of a stacked
    leaf), run on the slice; ``None`` for one that cuts it."""
    s, p, name = ins[0], eqn.params, eqn.primitive.name
    local = s.value.shape[s.dim]
    full = eqn.invars[0].aval.shape[s.dim]
    if name == 'transpose':
      perm = p['permutation']
      return s._replace(value=jax.lax.transpose(s.value, perm),
                        dim=perm.index(s.dim))
    if name == 'squeeze':
      dims = p['dimensions']
      return s._replace(value=jax.lax.squeeze(s.value, dims),
                        dim=s.dim - sum(d < s.dim for d in dims))
    if name == 'slice':
      start, limit, strides = p['start_indices'], p['limit_indices'], (
          p['strides'] or (1,) * len(p['start_indices']))
      if (start[s.dim], limit[s.dim], strides[s.dim]) != (0, full, 1):
        return None
      limit = list(limit)
      limit[s.dim] = local
      return s._replace(value=jax.lax.slice(s.value, start, limit,
                                            p['strides']))
    sizes = list(p['slice_sizes'])   # dynamic_slice
    if sizes[s.dim] != full:
      return None
    sizes[s.dim] = local
    return s._replace(value=jax.lax.dynamic_slice(s.value, ins[1:], sizes))

  def _use(self, eqn: jex.JaxprEqn, ins: list) -> list:
    """``eqn`` on its operands gathered, gather and use in one
    ``jax.checkpoint`` that keeps no gathered param for the backward."""
    at = [k for k, x in enumerate(ins) if isinstance(x, Slice)]

    def use(*values):
      full = list(ins)
      for k, value in zip(at, values):
        full[k] = self.whole(ins[k]._replace(value=value))
      return bind_eqn(eqn, full)
    return jax.checkpoint(use, policy=_not_gathers(self.data_axis),
                          prevent_cse=not self.in_scan)(
                              *[ins[k].value for k in at])

  def _remat(self, eqn: jex.JaxprEqn, ins: list) -> list:
    """A ``jax.checkpoint`` call, kept with its policy: its body evaluated
    on ``ins`` (``Slice``s passed as their values), any ``Slice`` it
    returns gathered."""
    p = eqn.params
    run = _Gathering(self.data_axis, in_scan=self.in_scan)

    def body(*values):
      args = [x._replace(value=v) if isinstance(x, Slice) else v
              for x, v in zip(ins, values)]
      return [run.whole(x) for x in run.evaluate(p['jaxpr'], (), args)]
    return jax.checkpoint(body, policy=p['policy'],
                          prevent_cse=p['prevent_cse'])(
                              *[x.value if isinstance(x, Slice) else x
                                for x in ins])

  def _scan(self, eqn: jex.JaxprEqn, ins: list) -> list:
    """The scan re-bound with ``lax.scan``: ``xs`` slices split after their
    first dim stay sliced (each iteration gathers its layer), other slices
    are gathered before it."""
    p = eqn.params
    body = p['jaxpr']
    consts, carry, xs = scan_parts(p, ins)
    consts = [self.whole(x) for x in consts]
    carry = [self.whole(x) for x in carry]
    xs = [x if isinstance(x, Slice) and x.dim > 0 else self.whole(x)
          for x in xs]
    layer = [x._replace(dim=x.dim - 1) if isinstance(x, Slice) else x
             for x in xs]
    num_carry = len(carry)
    ys_slices = []   # per ys output: its Slice in the body, or None

    def step(carry, x_values):
      args = [s._replace(value=v) if isinstance(s, Slice) else v
              for s, v in zip(layer, x_values)]
      run = _Gathering(self.data_axis, in_scan=True)
      outs = run.evaluate(body.jaxpr, body.consts, [*consts, *carry, *args])
      ys = outs[num_carry:]
      ys_slices[:] = [y if isinstance(y, Slice) else None for y in ys]
      return ([run.whole(c) for c in outs[:num_carry]],
              [y.value if isinstance(y, Slice) else y for y in ys])
    carry, ys = jax.lax.scan(
        step, carry, [x.value if isinstance(x, Slice) else x for x in xs],
        length=p['length'], reverse=p['reverse'], unroll=p['unroll'],
        _split_transpose=p.get('_split_transpose', False))
    # A body that returns its layer's slice (nnx.scan returns the params it
    # scans over) stacks slices: the stack is a slice after its first dim.
    ys = [y if s is None else s._replace(value=y, dim=s.dim + 1)
          for y, s in zip(ys, ys_slices)]
    return [*carry, *ys]
