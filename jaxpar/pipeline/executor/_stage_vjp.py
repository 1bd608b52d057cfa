"""A pipeline stage cut into the blocks the executor runs: ``F``, ``I``, ``W``.

``StageVJP(stage_fn, remat_policy)`` turns ``stage_fn(params, x) -> y``
(or ``stage_fn(params, x, key=k)``: every block then takes the same ``key``)
into

* ``forward(params, x) -> (y, stash)``: the output and the VJP residuals
  that depend on ``x`` -- the **stash holds activations only**. Which
  activations is the **stash policy** (``stash_policy``): ``'everything'``
  (or ``None``) keeps every residual ``jax.vjp`` lists; ``'dots'`` (the
  default) keeps the outputs of matrix products and recomputes the
  elementwise work after them in the backward
  (``jax.checkpoint_policies.dots_saveable``); ``'nothing'``
  keeps ``x`` alone and recomputes the whole forward; any
  ``jax.checkpoint`` policy may be given. Residuals that depend on the
  parameters alone (a layer sliced out of a stacked leaf, a transposed or
  cast weight, the weights themselves) are found by a dataflow pass over the
  forward's jaxpr and recomputed from the parameters in the backward, where
  XLA keeps only the (cheap) operations that produce them. The ``key``
  counts as a parameter: a dropout mask, drawn from the key alone, is
  recomputed in the backward (the forward's mask), not stashed. The
  ``'dots'`` policies are refined so that the stash is in the compute dtype
  and replicated activations are stored split over ``tensor`` (``_stash``:
  a product wider than its operands is recomputed; the sum after a
  tensor-parallel product is stashed, not the partial products). The
  policy decides the stash of the whole stage; the backward recomputes
  what it dropped one layer at a time (``_remat.remat_layers``: each
  ``lax.scan`` body checkpointed), not every layer's residuals at once.
* ``input_grad(params, stash, dy) -> (dx, kept)`` and
  ``weight_grad(params, stash, dy, kept) -> dparams``: the backward's jaxpr
  (``(dparams, dx)`` from ``(params, stash, dy)``, with the policy's
  recomputation) cut in two. ``I`` runs the operations ``dx`` needs; ``W``
  runs the rest of what ``dparams`` needs and reads the values of ``I`` it
  would otherwise recompute -- the cotangents at the parameter-consuming
  operations -- from ``kept``. Each matrix product of the backward runs
  once (``I + W = B`` in FLOPs, up to elementwise work); values that depend
  on the parameters alone, and elementwise functions of what ``W`` reads
  anyway (the policy's recomputed ``tanh(x @ w)`` from the stashed product),
  are recomputed in ``W`` rather than kept, so ``kept`` holds the
  activation-sized cotangents only: a zero-bubble schedule holds it for
  every deferred ``W``. The cut sees through ``jax.jit`` and
  ``jax.checkpoint`` calls; a ``lax.scan`` (a stage that scans over its
  layers) is cut body by body, not unrolled (``_cut``): ``I`` and ``W`` are
  scans of one layer's halves, ``kept`` stacked per layer, so the blocks'
  programs and compile time do not grow with the number of layers.

  With ``w_recompute=True`` ``kept`` is empty: ``W`` recomputes from
  ``(params, stash, dy)`` everything ``dparams`` needs, the cotangent
  chain through the stage's layers included (one more matrix product per
  weight: ``W`` costs about ``I + W``). Between ``I`` and ``W`` a
  microbatch then holds its stash and ``dy`` only, so a V schedule's memory
  follows its activation count (``docs/executor.md``, "Stash policy").

The activation ``x`` (so ``y``, ``dy`` and ``dx``) may be any pytree, of
one structure in and out: values a stage only passes on (an encoder
output) ride along, and their cotangents flow back. An integer leaf (token
ids, positions) is not differentiated: the blocks take and return zeros of
its dtype for its cotangent (``float0`` inside ``jax.vjp``).

**Model state** that is not a parameter (BatchNorm's running statistics):
with ``state=`` given to ``trace`` and every block,
``stage_fn(params, x, state=s) -> (y, new_state)`` and ``forward`` returns
``(y, stash, new_state)``. The VJP is over ``(params, x)`` only;
``new_state`` gets no cotangent. The state counts as
``x`` in the dataflow pass: residuals that depend on it are stashed (under
``'nothing'``, the state itself), so the backward of a microbatch sees the
state of that microbatch's forward; the backward blocks read only the
state's structure, never its values.

Stash per microbatch for ``L`` residual layers ``x + gelu(x @ w_k)`` of
``[mb, d]`` activations: ``'everything'`` ``6 L`` arrays (the input, the
product and four of gelu's intermediates per layer), ``'dots'`` ``L + 1``
(the input and the ``L`` products), ``'nothing'`` one.

Example:
  >>> import jax.numpy as jnp
  >>> from jaxpar.pipeline import StageVJP
  >>> stage = StageVJP(lambda w, x: jnp.tanh(x @ w[0]) + x)
  >>> w, x = jnp.ones((2, 4, 4)), jnp.ones((3, 4))
  >>> _ = stage.trace(w, x)
  >>> y, stash = stage.forward(w, x)
  >>> [a.shape for a in stash]     # x and x @ w[0]; w[0] is not stashed
  [(3, 4), (3, 4)]
  >>> _ = stage.split(w, stash, y)
  >>> dx, kept = stage.input_grad(w, stash, jnp.ones((3, 4)))
  >>> dw = stage.weight_grad(w, stash, jnp.ones((3, 4)), kept)
  >>> dw.shape, dx.shape
  ((2, 4, 4), (3, 4))
  >>> len(StageVJP(stage.stage_fn, remat_policy='everything').trace(w, x)[1])
  3
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.executor import _cut, _jaxpr, _stash, _vma
from jaxpar.pipeline.executor._microbatches import extras, read
from jaxpar.pipeline.executor._remat import remat_layers
from jaxpar.train_state import check_remat_policy

PyTree = Any


def stash_policy(remat_policy: Any) -> Callable[..., Any] | None:
  """The ``jax.checkpoint`` policy of a stage's stash (``None``: everything).

  ``remat_policy`` means what it means in every trainer
  (``jaxpar.train_state.check_remat_policy``): a name of
  ``REMAT_POLICIES`` or a ``jax.checkpoint_policies`` policy, ``None``
  being ``'everything'`` (no recompute). ``'nothing'`` stashes the stage
  input alone and recomputes the forward. The executor's default is
  ``'dots'``: on one core it was the fastest for GPipe, 1F1B and ZB-H1
  (``docs/executor.md``, "Stash policy"), as recomputing elementwise work
  costs less than storing and reloading its intermediates.

  Example:
    >>> import jax
    >>> from jaxpar.pipeline import stash_policy
    >>> stash_policy('dots') is jax.checkpoint_policies.dots_saveable
    True
    >>> stash_policy(None) is None   # 'everything': keep every residual
    True
  """
  return check_remat_policy(remat_policy)


class StageVJP:
  """``stage_fn`` split into the forward and backward blocks; see module doc.

  Call ``trace(params, x)`` once (with the avals the blocks will see) before
  the blocks; it fixes the residual structure and the ``I``/``W`` cut.
  ``remat_policy`` chooses the stash (``stash_policy``); ``w_recompute``
  empties ``kept`` (``W`` recomputes the cotangents it would read).
  """

  def __init__(self, stage_fn: Callable[..., jax.Array],
               remat_policy: Any = 'dots', *, w_recompute: bool = False):
    self.stage_fn = stage_fn
    self.policy = stash_policy(remat_policy)
    self.w_recompute = w_recompute
    self._from_x = None      # per closure leaf: depends on x (is stashed)
    self._splits = None      # per stash leaf: stored whole or split
    self._x = None           # aval of x
    self._input = self._weight = None
    self._args_def = None

  def _fn(self, key, state):
    """``stage_fn`` of ``(params, x)`` under the policy, ``key`` and
    ``state`` bound; returns ``(y, new_state)`` (``new_state`` None
    without a state)."""
    kwargs = extras(key, state)
    fn = lambda params, x: self.stage_fn(params, x, **kwargs)
    if self.policy is not None:
      # The stash is what the policy saves of the whole stage; the backward
      # recomputes the rest one layer at a time (``remat_layers``). The
      # blocks are separate programs: no CSE across them to prevent.
      policy = _stash.rule(self.policy)
      fn = jax.checkpoint(remat_layers(fn, policy), policy=policy,
                          prevent_cse=False)
    if state is None:
      return lambda params, x: (fn(params, x), None)
    return lambda params, x: tuple(fn(params, x))

  def _closure(self, params, x, key, state=None):
    y, vjp, new_state = jax.vjp(self._fn(key, state), params, x, has_aux=True)
    leaves, treedef = jax.tree.flatten(vjp)
    return y, leaves, treedef, new_state

  def trace(self, params: PyTree, x: jax.Array, key: Any = None,
            state: PyTree = None):
    """Records the residual structure; returns ``(y, stash)`` avals."""
    self._x = jax.tree.map(jax.typeof, x)
    outputs = lambda p, x, k, s: (lambda y, leaves, _, new: (y, leaves, new))(
        *self._closure(p, x, k, s))
    closed, (y, leaves, new_state) = jax.make_jaxpr(
        outputs, return_shape=True)(params, x, key, state)
    if state is not None:
      _check_state(state, new_state)
    jaxpr = closed.jaxpr
    at = len(jax.tree.leaves(params))
    num_state = len(jax.tree.leaves(state))
    # The state counts as x: what depends on it is stashed (the backward of
    # microbatch i sees the state of i's forward, not the current one).
    num_x = len(jax.tree.leaves(x))
    from_x = _jaxpr.depends_on(
        jaxpr, jaxpr.invars[at:at + num_x] + jaxpr.invars[
            len(jaxpr.invars) - num_state:len(jaxpr.invars)])
    num_y = len(jax.tree.leaves(y))
    residuals = slice(num_y, num_y + len(leaves))
    self._from_x = tuple(_jaxpr.is_var(v) and v in from_x
                         for v in jaxpr.outvars[residuals])
    stash = [a for a, keep in zip(closed.out_avals[residuals], self._from_x)
             if keep]
    self._splits = _stash.plan(stash, params)
    return (jax.tree.unflatten(jax.tree.structure(y),
                               closed.out_avals[:num_y]),
            jax.eval_shape(lambda s: _stash.store(s, self._splits), stash))

  def forward(self, params: PyTree, x: jax.Array, key: Any = None,
              state: PyTree = None):
    """``(y, stash)`` for the ``F`` block (traced, as in the executor);
    ``(y, stash, new_state)`` with a ``state``."""
    y, leaves, _, new_state = self._closure(params, x, key, state)
    if len(leaves) != len(self._from_x):
      raise RuntimeError('stage_fn traced to a different VJP structure twice; '
                         'it must be a pure function of (params, x).')
    stash = _stash.store([a for a, keep in zip(leaves, self._from_x) if keep],
                         self._splits)
    return (y, stash) if state is None else (y, stash, new_state)

  def backward(self, params: PyTree, stash: Any, dy: jax.Array,
               key: Any = None, state: PyTree = None):
    """``(dparams, dx)`` in one piece (the ``I`` and ``W`` blocks together).

    Only the structure of ``state`` is read: what depends on its values
    comes from the stash.
    """
    zeros = _vma.full(self._x, 0.0)
    # The closure at x = 0 (and state = 0): its x-dependent parts are dead
    # code, the rest are the residuals of the parameters and the key alone
    # (a dropout mask).
    state = None if state is None else jax.tree.map(
        lambda a: _vma.full(jax.typeof(a), 0.0), state)
    _, from_params, treedef, _ = self._closure(params, zeros, key, state)
    if len(from_params) != len(self._from_x):
      raise RuntimeError('stage_fn traced to a different VJP structure twice; '
                         'call the blocks under jit, as the executor does.')
    stashed = iter(_stash.gather(jax.tree.map(read, stash), self._splits))
    # Each stash leaf typed as the residual it stands for (a leaf that
    # crossed a shard_map boundary may come back typed varying).
    leaves = [_vma.matched(next(stashed), leaf) if keep else leaf
              for leaf, keep in zip(from_params, self._from_x)]
    # Integer leaves of x: float0 cotangents in the VJP, zeros outside.
    dparams, dx = jax.tree.unflatten(treedef, leaves)(
        _vma.cotangent(dy, self._x))
    return dparams, _vma.stored(dx, self._x)

  def split(self, params: PyTree, stash: Any, dy: jax.Array,
            key: Any = None, state: PyTree = None) -> PyTree:
    """Cuts the backward into ``I`` and ``W``; returns the ``kept`` avals
    (``[]`` with ``w_recompute``).

    As in ``backward``, only the structure of ``state`` is read; the blocks
    then take it (or not) and ignore it.
    """
    args, self._args_def = jax.tree.flatten(((params, key), stash, dy))
    num_consts = len(jax.tree.leaves((params, key)))

    def flat(*args):
      (params, key), stash, dy = jax.tree.unflatten(self._args_def, args)
      dparams, dx = self.backward(params, stash, dy, key, state)
      return jax.tree.leaves(dparams) + jax.tree.leaves(dx)
    # Every operation its own eqn; scans stay scans and are cut body by body.
    num_dx = len(jax.tree.leaves(self._x))
    self._input, self._weight = _cut.cut(_jaxpr.flatten(flat, *args),
                                         num_consts, keep=not self.w_recompute,
                                         num_dx=num_dx)
    self._dparams_def = jax.tree.structure(params)
    return jax.make_jaxpr(self._input)(*args).out_avals[num_dx:]

  def input_grad(self, params: PyTree, stash: Any, dy: jax.Array,
                 key: Any = None, state: PyTree = None):
    """The ``I`` block: ``(dx, kept)`` (``state`` is not read). ``stash``
    leaves may be ``Row``s of the stash buffers (``_microbatches.rows``),
    read one layer at a time where a scan uses them."""
    del state  # what depends on it is in the stash
    out = self._input(*jax.tree.leaves(((params, key), stash, dy)))
    num_dx = len(jax.tree.leaves(self._x))
    return (jax.tree.unflatten(jax.tree.structure(self._x), out[:num_dx]),
            out[num_dx:])

  def weight_grad(self, params: PyTree, stash: Any, dy: jax.Array,
                  kept: list, key: Any = None, state: PyTree = None
                  ) -> PyTree:
    """The ``W`` block: ``dparams`` from what ``I`` kept (``state`` is not
    read); ``stash`` and ``kept`` leaves may be ``Row``s, as for
    ``input_grad``."""
    del state  # what depends on it is in the stash
    dparams = self._weight(*jax.tree.leaves(((params, key), stash, dy)),
                           *kept)
    return jax.tree.unflatten(self._dparams_def, dparams)


def _check_state(state: PyTree, new_state: PyTree) -> None:
  """``new_state`` must have the structure, shapes and dtypes of ``state``."""
  same = jax.tree.structure(state) == jax.tree.structure(new_state) and all(
      (jnp.shape(a), jnp.result_type(a)) == (b.shape, b.dtype)
      for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(new_state)))
  if not same:
    raise ValueError(
        'stage_fn(params, x, state=s) must return (y, new_state) with '
        'new_state of the same tree structure, shapes and dtypes as state; '
        f'got state {jax.tree.map(jax.typeof, state)} and new_state '
        f'{new_state}. Return the updated state in the structure it came in.')
