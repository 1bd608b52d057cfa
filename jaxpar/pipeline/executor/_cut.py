"""The ``I``/``W`` cut of a stage's backward jaxpr, ``lax.scan`` bodies too.

``cut(closed, num_params)`` takes the backward ``(params..., rest...) ->
(dparams..., dx)`` (calls inlined by ``_jaxpr.flatten``) and returns the
input-gradient program ``I: args -> (dx, *kept)`` and the weight-gradient
program ``W: (args, *kept) -> dparams``. ``I`` runs the operations ``dx``
needs; ``W`` runs the rest of what ``dparams`` needs and reads the values of
``I`` it would otherwise recompute from ``kept``; values that depend on the
parameters alone (the first ``num_params`` inputs), and elementwise functions
of what ``W`` reads anyway (an activation from a stashed product), are
recomputed in ``W`` instead of kept. Each other operation runs once
(``I + W = B`` in FLOPs, up to that elementwise work).
``cut(closed, num_params, keep=False)`` keeps nothing (``w_recompute``):
``W`` then runs everything ``dparams`` needs from the arguments alone, the
cotangent chain through the layers included, so ``I + W`` costs a backward
plus ``I``'s matrix products (less the first layer's ``dx``) and ``I``
hands ``W`` nothing to hold.

A ``lax.scan`` (a stage's layers, its transposed backward) is cut the same
way, body by body, instead of being unrolled: ``I`` runs a scan of the body's
``I`` half, carrying the carries that half reads (the cotangent flowing
through the layers), and stacks per iteration the body values ``W`` needs
(``kept`` gains them, ``[length, ...]``); ``W`` runs a scan of the body's
``W`` half over those, carrying the rest (a weight's summed cotangent), or,
when it carries nothing (each layer its own weights), ``jax.vmap`` of it. The
programs are then as long as one layer's, whatever the scan's length.
Their arguments may be ``Row``s of slot buffers (``_microbatches.rows``: the
executor's stash and weight-stash slots): a scan reads a ``Row`` one entry
per iteration from its buffer, where the row read first would be a copy of
every layer's entry.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from jaxpar.pipeline.executor import _cut, _jaxpr
  >>> layer = lambda h, w: (h + jnp.tanh(h @ w), None)
  >>> stage = lambda w, x: jax.lax.scan(layer, x, w)[0]
  >>> w, x = jnp.ones((6, 3, 3)) / 9, jnp.ones((2, 3))
  >>> def backward(w, x, dy):
  ...   return list(jax.vjp(stage, w, x)[1](dy))
  >>> program = _cut.cut(_jaxpr.flatten(backward, w, x, x), 1)
  >>> dx, *kept = program.input_grad(w, x, x)
  >>> dw, = program.weight_grad(w, x, x, *kept)
  >>> want_dw, want_dx = jax.vjp(stage, w, x)[1](x)
  >>> bool(jnp.allclose(dw, want_dw) and jnp.allclose(dx, want_dx))
  True
  >>> [a.shape for a in kept]   # per layer: its input, the tanh's cotangent
  [(6, 2, 3), (6, 2, 3)]
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend.core as jex
import jax.numpy as jnp

from jaxpar.pipeline.executor import _jaxpr
from jaxpar.pipeline.executor._microbatches import Row, read
from jaxpar.vma import varying_axes

is_var = _jaxpr.is_var


class Programs(NamedTuple):
  """The backward cut in two: ``input_grad(*args) -> [dx, *kept]`` and
  ``weight_grad(*args, *kept) -> dparams`` (flat lists)."""
  input_grad: Callable[..., list]
  weight_grad: Callable[..., list]


def cut(closed: jex.ClosedJaxpr, num_params: int, *,
        keep: bool = True, num_dx: int = 1) -> Programs:
  """``closed: (params..., rest...) -> (dparams..., dx...)`` (``num_dx``
  leaves of ``dx``: an activation may be a pytree) cut into ``I`` and
  ``W``; ``keep=False``: ``kept`` is empty and ``W`` recomputes what it
  would read from it. See the module doc."""
  jaxpr = closed.jaxpr
  dparams, dx = (jaxpr.outvars[:len(jaxpr.outvars) - num_dx],
                 jaxpr.outvars[len(jaxpr.outvars) - num_dx:])
  level = _Level(jaxpr, jaxpr.invars[:num_params], jaxpr.invars)
  input_items = level.input_pass(dx)
  if keep:
    weight_items, kept = level.weight_pass(dparams)
  else:   # the whole backward of dparams, scans whole
    weight_items, kept = [jaxpr.eqns[k] for k in _jaxpr.needed(
        jaxpr, dparams)], []
  consts = dict(zip(jaxpr.constvars, closed.consts))

  def input_grad(*args):
    env = {**consts, **dict(zip(jaxpr.invars, args))}
    _run(input_items, env)
    return [read(_read(env, v)) for v in [*dx, *kept]]

  def weight_grad(*args):
    env = {**consts, **dict(zip([*jaxpr.invars, *kept], args))}
    _run(weight_items, env)
    return [read(_read(env, v)) for v in dparams]
  return Programs(input_grad, weight_grad)


# Elementwise and layout primitives: ``W`` recomputes their outputs from
# what it reads anyway rather than keep them (``_Level.cheap``).
_ELEMENTWISE = frozenset((
    'abs', 'acos', 'acosh', 'add', 'add_any', 'and', 'asin', 'asinh', 'atan',
    'atan2', 'atanh', 'broadcast_in_dim', 'cbrt', 'ceil', 'clamp',
    'convert_element_type', 'copy', 'copy_p', 'cos', 'cosh', 'div', 'eq',
    'erf', 'erf_inv', 'erfc', 'exp', 'exp2', 'expand_dims', 'expm1', 'floor',
    'ge', 'gt', 'integer_pow', 'is_finite', 'le', 'log', 'log1p', 'logistic',
    'lt', 'max', 'min', 'mul', 'ne', 'neg', 'not', 'or', 'pow', 'reshape',
    'round', 'rsqrt', 'select_n', 'sign', 'sin', 'sinh', 'sqrt', 'square',
    'squeeze', 'sub', 'tan', 'tanh', 'transpose', 'xor'))


# Gathers over devices: ``W`` re-gathers a value (a stash leaf stored
# split) rather than keep it whole for a deferred ``W``.
_GATHERS = frozenset(('all_gather', 'all_gather_invariant'))


# An item of a program: an eqn of the jaxpr, or one half of a cut scan.
Item = Any


def _read(env: dict, v: Any) -> Any:
  return v.val if not is_var(v) else env[v]


def _run(items: Sequence[Item], env: dict) -> None:
  """Runs ``items`` in order (under a trace), their outputs into ``env``.

  An item holding collectives reads its inputs after the previous such
  item's outputs (``_after``): two halves of a cut scan may not depend on
  each other, and XLA:CPU would run their loops of collectives side by side,
  in a different order on each device (``jaxpar.hlo.unordered_collectives``).
  """
  last = []   # the outputs of the last item that communicates
  for item in items:
    talks = _communicates([item])
    scope = _after(item, env, last) if talks and last else env
    if isinstance(item, _ScanHalf):
      item.run(scope)
    else:
      scope.update(zip(item.outvars, _jaxpr.bind(
          item, [read(_read(scope, v)) for v in item.invars])))
    env.update((v, scope[v]) for v in item.outvars if is_var(v))
    if talks:
      last = [env[v] for v in item.outvars if is_var(v)]


def _after(item: Item, env: dict, last: list) -> dict:
  """``env`` with one of ``item``'s array inputs passed through an
  ``optimization_barrier`` with one of ``last`` that varies over no more
  mesh axes (the barrier's outputs vary over all of its operands' axes):
  the input, so the item, exists only once ``last`` does."""
  for v in dict.fromkeys(item.invars):
    x = env.get(v) if is_var(v) else None
    if x is None or isinstance(x, Row):
      continue
    y = next((y for y in last if varying_axes(y) <= varying_axes(x)), None)
    if y is not None:
      x, _ = jax.lax.optimization_barrier((x, y))
      return {**env, v: x}
  return env


def _reads(items: Sequence[Item], targets: Iterable[Any] = ()) -> set:
  """The variables ``items`` read, and the ``targets``."""
  found = {v for v in targets if is_var(v)}
  for item in items:
    found.update(v for v in item.invars if is_var(v))
  return found


class _Level:
  """A jaxpr (the backward or a scan's body) and its two passes.

  ``params_only``: the variables computed from ``params_invars`` (and
  constants) alone: ``W`` recomputes them rather than keep them.
  ``cheap``: the variables ``W`` reads without ``kept`` (``free_invars``,
  ``params_only``) and those elementwise functions of them compute (the
  policy's recomputed activation ``tanh(x @ w)`` from the stashed product):
  ``W`` recomputes them too, so ``kept`` holds what only ``I``'s products
  and cotangents give.
  ``from_input``: after ``input_pass``, the values ``I`` computes (and
  ``blocked``: the body's ``I`` carries), which ``W`` reads from ``kept``.
  """

  def __init__(self, jaxpr: jex.Jaxpr, params_invars: Iterable[Any],
               free_invars: Iterable[Any]):
    self.jaxpr = jaxpr
    self.params_only = set(jaxpr.constvars) | set(params_invars)
    self.cheap = self.params_only | set(free_invars)
    self.bodies = {}    # id(scan eqn) -> _Level of its body
    self.scans = {}     # id(scan eqn) -> _ScanCut, after input_pass
    self.from_input = set()
    for eqn in jaxpr.eqns:
      ins = [v for v in eqn.invars if is_var(v)]
      if all(v in self.params_only for v in ins):
        self.params_only.update(eqn.outvars)
        self.cheap.update(eqn.outvars)
      elif eqn.primitive.name == 'scan':
        self._body(eqn)
      elif ((eqn.primitive.name in _ELEMENTWISE
             or eqn.primitive.name in _GATHERS)
            and all(v in self.cheap for v in ins)):
        self.cheap.update(eqn.outvars)

  def _body(self, eqn: jex.JaxprEqn) -> None:
    """The body's level; its stacked outputs from the parameters alone (a
    layer's weight, transposed), or cheap in the body (a recomputed
    activation), are such outside too."""
    body = eqn.params['jaxpr'].jaxpr
    consts, _, xs = _jaxpr.scan_parts(eqn.params, eqn.invars)
    inner_consts, inner_carry, inner_xs = _jaxpr.scan_parts(eqn.params,
                                                            body.invars)
    outside = list(zip(inner_consts + inner_xs, consts + xs))
    level = _Level(
        body, [i for i, o in outside if not is_var(o) or o in self.params_only],
        [i for i, o in outside if not is_var(o) or o in self.cheap])
    self.bodies[id(eqn)] = level
    num_carry = len(inner_carry)
    self.params_only.update(
        out for out, inner in zip(eqn.outvars[num_carry:],
                                  body.outvars[num_carry:])
        if not is_var(inner) or inner in level.params_only)
    self.cheap.update(
        out for out, inner in zip(eqn.outvars[num_carry:],
                                  body.outvars[num_carry:])
        if not is_var(inner) or inner in level.cheap)

  def input_pass(self, targets: Sequence[Any],
                 blocked: Iterable[Any] = ()) -> list[Item]:
    """The items that compute ``targets``: ``I``'s program at this level."""
    need = {v for v in targets if is_var(v)}
    items, self.scans = [], {}
    for eqn in reversed(self.jaxpr.eqns):
      outs = [o for o in eqn.outvars if o in need]
      if not outs:
        continue
      item = eqn
      if id(eqn) in self.bodies:
        self.scans[id(eqn)] = scan = _ScanCut(eqn, self, outs)
        item = scan.input_half
      items.append(item)
      need.update(v for v in item.invars if is_var(v))
    items.reverse()
    self.from_input = set(blocked) | {
        o for item in items for o in item.outvars if o not in self.params_only}
    return items

  def weight_pass(self, targets: Sequence[Any]) -> tuple[list[Item], list]:
    """``W``'s items for ``targets`` after ``input_pass``, and the values of
    ``I`` they read (``kept``); ``W`` recomputes the ``cheap`` ones."""
    # Read (late: a cut scan's stacks join ``from_input`` as it is met).
    stop = lambda v: v in self.from_input and v not in self.cheap
    need = {v for v in targets if is_var(v) and not stop(v)}
    items = []
    for eqn in reversed(self.jaxpr.eqns):
      outs = [o for o in eqn.outvars if o in need]
      if not outs:
        continue
      item = (self.scans[id(eqn)].weight_half(outs) if id(eqn) in self.scans
              else eqn)
      items.append(item)
      need.update(v for v in item.invars if is_var(v) and not stop(v))
    items.reverse()
    kept = [v for v in [*(v for item in items for v in item.invars), *targets]
            if is_var(v) and stop(v)]
    return items, list(dict.fromkeys(kept))


class _Stacked:
  """``I``'s per-iteration copies of a body value, stacked (an outer var)."""

  def __init__(self, inner: Any):
    self.inner = inner


class _ScanCut:
  """A scan eqn cut in two: ``input_half`` computes the outputs ``I``
  needs; ``weight_half(outs)`` the others, reading what the input half
  stacks for it (``stacked``: body var -> outer ``_Stacked``)."""

  def __init__(self, eqn: jex.JaxprEqn, outer: _Level, outs: Sequence[Any]):
    self.eqn, self.outer, self.body = eqn, outer, outer.bodies[id(eqn)]
    jaxpr = self.body.jaxpr
    _, self.carry_in, _ = _jaxpr.scan_parts(eqn.params, jaxpr.invars)
    self.num_carry = len(self.carry_in)
    self.carry_out = jaxpr.outvars[:self.num_carry]
    self.stacked = {}
    carry, ys = self._slots(outs)
    while True:   # I carries what its own body reads
      items = self.body.input_pass(
          self.targets(carry, ys), [self.carry_in[s] for s in carry])
      more = self._carries_read(items, carry, ys)
      if not more:
        break
      carry = sorted(carry + more)
    self.input_carry = carry
    self.input_half = _ScanHalf(self, items, carry, ys, self.stacked, ())

  def _slots(self, outs: Sequence[Any]) -> tuple[list[int], list[int]]:
    index = {o: k for k, o in enumerate(self.eqn.outvars)}
    slots = sorted(index[o] for o in outs)
    return ([k for k in slots if k < self.num_carry],
            [k - self.num_carry for k in slots if k >= self.num_carry])

  def targets(self, carry: Sequence[int], ys: Sequence[int]) -> list:
    outvars = self.body.jaxpr.outvars
    return ([self.carry_out[s] for s in carry]
            + [outvars[self.num_carry + j] for j in ys])

  def _carries_read(self, items: Sequence[Item], carry: Sequence[int],
                    ys: Sequence[int], taken: Sequence[int] = ()) -> list[int]:
    """The carries ``items`` (or the outputs) read, beyond ``carry``."""
    read = _reads(items, self.targets(carry, ys))
    return [s for s, v in enumerate(self.carry_in)
            if v in read and s not in carry and s not in taken]

  def weight_half(self, outs: Sequence[Any]) -> _ScanHalf:
    """The scan of the body's ``W`` half for ``outs``; the input half stacks
    the body values it reads."""
    carry, ys = self._slots(outs)
    while True:   # W carries the rest of what its body reads
      items, kept = self.body.weight_pass(self.targets(carry, ys))
      more = self._carries_read(items, carry, ys, self.input_carry)
      if not more:
        break
      carry = sorted(carry + more)
    for v in kept:
      if v not in self.stacked:
        self.stacked[v] = _Stacked(v)
        self.outer.from_input.add(self.stacked[v])
    return _ScanHalf(self, items, carry, ys, {}, [
        (v, self.stacked[v]) for v in kept])


class _ScanHalf:
  """One half of a cut scan: ``lax.scan`` of ``items`` over the scan's
  iterations, carrying the ``carry`` slots, producing the ``ys`` outputs
  (and ``stack``'s body values, stacked); ``given`` pairs a body value with
  the outer stack it reads per iteration."""

  def __init__(self, scan: _ScanCut, items: list[Item], carry: list[int],
               ys: list[int], stack: dict, given: Sequence[tuple[Any, Any]]):
    self.scan, self.items, self.carry, self.ys = scan, items, carry, ys
    self.stack, self.given = stack, list(given)
    eqn, body = scan.eqn, scan.body.jaxpr
    read = _reads(items, scan.targets(carry, ys))
    consts, carry_ops, xs = _jaxpr.scan_parts(eqn.params, eqn.invars)
    inner_consts, _, inner_xs = _jaxpr.scan_parts(eqn.params, body.invars)
    self.consts = [(i, o) for i, o in zip(inner_consts, consts) if i in read]
    self.xs = [(i, o) for i, o in zip(inner_xs, xs) if i in read] + self.given
    self.init = [carry_ops[s] for s in carry]

  @property
  def invars(self) -> list:
    return ([o for _, o in self.consts] + self.init + [o for _, o in self.xs])

  @property
  def outvars(self) -> list:
    outs = self.scan.eqn.outvars
    return ([outs[s] for s in self.carry]
            + [outs[self.scan.num_carry + j] for j in self.ys]
            + list(self.stack.values()))

  def run(self, env: dict) -> None:
    scan, body = self.scan, self.scan.body.jaxpr
    consts = {i: read(_read(env, o)) for i, o in self.consts}
    consts.update(zip(body.constvars, scan.eqn.params['jaxpr'].consts))
    carry_in = [scan.carry_in[s] for s in self.carry]
    targets = scan.targets(self.carry, self.ys) + list(self.stack)
    num_carry = len(self.carry)

    def step(carry, xs):
      inner = {**consts, **dict(zip(carry_in, carry))}
      inner.update(zip([i for i, _ in self.xs], xs))
      _run(self.items, inner)
      outs = [_literal(v) if not is_var(v) else inner[v] for v in targets]
      return outs[:num_carry], outs[num_carry:]
    params, xs = scan.eqn.params, [_read(env, o) for _, o in self.xs]
    if not self.carry and not self.stack and xs and not _communicates(
        self.items):
      # W of independent layers is a map: batched, it reads the kept stacks
      # in place (a loop's operands would be copies) and runs one batched
      # matmul per weight instead of a loop of small ones. Not with a
      # collective (ZeRO-3's per-layer gather and reduce-scatter): batched,
      # it would gather every layer's weights at once.
      env.update(zip(self.outvars, jax.vmap(lambda *x: step([], x)[1])(
          *[read(x) for x in xs])))
      return
    step, xs = _per_entry(step, xs, params['length'])
    carry, ys = jax.lax.scan(
        step, [read(_read(env, o)) for o in self.init], xs,
        length=params['length'], reverse=params['reverse'],
        unroll=params['unroll'])
    env.update(zip(self.outvars, [*carry, *ys]))


def _per_entry(step: Callable[..., Any], xs: list,
               length: int) -> tuple[Callable[..., Any], list]:
  """A scan's ``step`` and ``xs`` with each ``Row`` of ``xs`` read one entry
  per iteration from its buffer (the scan's operand is the buffer, not a
  copy of the row)."""
  if not any(isinstance(x, Row) for x in xs):
    return step, xs

  def entries(carry, given):
    i, arrays = given
    arrays = iter(arrays)
    return step(carry, [x.entry(i) if isinstance(x, Row) else next(arrays)
                        for x in xs])
  return entries, [jnp.arange(length),
                   [x for x in xs if not isinstance(x, Row)]]


# Primitives that communicate over mesh axes.
_COLLECTIVES = frozenset((
    'all_gather', 'all_gather_invariant', 'all_to_all', 'ppermute', 'psum',
    'psum_invariant', 'reduce_scatter'))


def _communicates(items: Sequence[Item]) -> bool:
  """Whether ``items`` (their scan bodies too) hold a collective."""
  for item in items:
    if isinstance(item, _ScanHalf):
      found = _communicates(item.items)
    else:
      inner = item.params.get('jaxpr')
      found = item.primitive.name in _COLLECTIVES or (
          inner is not None and _communicates(getattr(inner, 'eqns', None)
                                              or inner.jaxpr.eqns))
    if found:
      return True
  return False


def _literal(v: jex.Literal) -> jax.Array:
  return jnp.asarray(v.val, v.aval.dtype)
