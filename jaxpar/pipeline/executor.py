"""The pipeline executor: any lowered ``Schedule`` as one SPMD program.

``pipeline_step`` runs a training step of a pipelined model, ``pipeline_apply``
its forward pass. Both are one ``jax.shard_map`` over the pipeline axis around
one ``lax.scan`` over the ticks of the lowered schedule
(``jaxpar.pipeline.lower``). Per tick, every rank

1. reads its row of the tick table (action kind, stage, microbatch, slots);
2. reads the action's input (the batch for stage 0's ``F``, else a mailbox
   slot);
3. runs the block of its action kind and no other: ``F`` (``stage_fn``
   forward, writing the VJP residuals or, with ``remat``, the stage input to
   its stash slot in place; on the last stage also ``loss_fn`` and the loss
   cotangent), ``B`` (input and parameter cotangents), ``I`` (input
   cotangent only) or ``W`` (parameter cotangent only), each reading its
   stash slot; an idle rank computes nothing;
4. sends the block's output with one ``ppermute`` per distinct rank offset
   of the schedule (every rank takes part every tick); receivers store it
   in the mailbox slot the table names.

The dispatch on the kind is a ``lax.switch`` in spirit, written as one
zero-or-one-trip ``while_loop`` per kind (``_when``): XLA updates loop
carries in place, while a ``switch`` copies every buffer that a branch passes
through unchanged, which would copy the gradient accumulators every tick.

Buffer updates are selects or writes to a spare slot, never masks multiplied
in, so whatever a bubble produces (``bubble_fill``, NaN in the tests) never
reaches the results. Memory is the schedule's: ``num_stash_slots`` stashes and
``num_mailbox_slots + 1`` activations per rank (``O(p)`` for 1F1B whatever
the number of microbatches ``m``), plus the parameters, their gradients, the
batch and its gradient (arguments and outputs, written in place).

``pipeline_step_local`` / ``pipeline_apply_local`` are the same executor as a
function that runs *inside* a caller's ``shard_map``, so ``stage_fn`` may use
collectives over other mesh axes (tensor parallelism) and the batch may be
sharded over a data axis.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import _compat
from jaxpar.mesh import axis_size
from jaxpar.pipeline.lower import (B, F, I, W, LoweredSchedule,
                                   local_stages, lower)
from jaxpar.pipeline.schedule import Schedule

PyTree = Any
StageFn = Callable[[PyTree, jax.Array], jax.Array]
LossFn = Callable[[PyTree, jax.Array, PyTree], jax.Array]
_F_LAST = 5  # block code: forward of the last stage, with the loss


class PipelineGrads(NamedTuple):
  """Gradients of the mean batch loss from ``pipeline_step``.

  Attributes:
    stages: like ``stage_params``, stacked ``[num_stages, ...]`` in model order.
    loss: like ``loss_params``.
    inputs: like ``inputs``, ``[batch, ...]``: for a layer in front of the
      pipeline (an embedding), chain it with that layer's VJP.
  """
  stages: PyTree
  loss: PyTree
  inputs: jax.Array


# ---------------------------------------------------------------- layouts


def _stage_order(schedule: Schedule) -> np.ndarray:
  """Model-order stage index of each ``(rank, local)`` position, flattened."""
  return np.array([k for stages in local_stages(schedule) for k in stages])


def stages_to_ranks(tree: PyTree, schedule: Schedule, *,
                    out_sharding: NamedSharding | None = None) -> PyTree:
  """Rearranges a ``[num_stages, ...]`` stack into the ``[p, v, ...]`` rank layout.

  Row ``[r, j]`` holds the ``j``-th stage (ascending) that ``schedule.placement``
  puts on rank ``r``; ``v = num_stages // p``. Shard dim 0 over the pipeline
  axis to give every rank its own stages.

  Args:
    tree: pytree of ``[num_stages, ...]`` arrays, in model order.
    schedule: the ``Schedule`` whose placement to follow.
    out_sharding: sharding of the ``[num_stages, ...]`` rows after
      reordering, before the reshape (needed under ``jit`` with explicit mesh
      axes, e.g. ``NamedSharding(mesh, P('stage'))``).

  Returns:
    The pytree with leaves ``[p, v, ...]``.

  Example:
    >>> s = jaxpar.pipeline.interleaved_1f1b(2, 4, 2)   # placement (0, 1, 0, 1)
    >>> jaxpar.pipeline.stages_to_ranks(np.arange(4), s).tolist()
    [[0, 2], [1, 3]]
  """
  return _permute(tree, _stage_order(schedule), schedule.num_ranks,
                  out_sharding, to_ranks=True)


def ranks_to_stages(tree: PyTree, schedule: Schedule, *,
                    out_sharding: NamedSharding | None = None) -> PyTree:
  """Inverse of ``stages_to_ranks``: ``[p, v, ...]`` back to ``[num_stages, ...]``.

  Example:
    >>> s = jaxpar.pipeline.zbv(2, 2)   # placement (0, 1, 1, 0)
    >>> jaxpar.pipeline.ranks_to_stages(np.array([[0, 3], [1, 2]]), s).tolist()
    [0, 1, 2, 3]
  """
  return _permute(tree, np.argsort(_stage_order(schedule)), schedule.num_ranks,
                  out_sharding, to_ranks=False)


def _permute(tree, order, p, out_sharding, *, to_ranks):
  """Rows of each leaf in ``order`` (skipped when it is the identity)."""
  identity = np.array_equal(order, np.arange(len(order)))

  def one(a):
    if not to_ranks:
      a = a.reshape((-1,) + a.shape[2:])
    if not identity:
      a = jnp.asarray(a).at[order].get(out_sharding=out_sharding)
    return a.reshape((p, -1) + a.shape[1:]) if to_ranks else a
  return jax.tree.map(one, tree)


# ---------------------------------------------------------------- typing


def _vma(tree: PyTree) -> frozenset[str]:
  """Mesh axes over which any leaf of ``tree`` varies (inside ``shard_map``)."""
  out = frozenset()
  for leaf in jax.tree.leaves(tree):
    out |= _compat.varying_axes(leaf)
  return out


def _vary(tree: PyTree, axes: frozenset[str]) -> PyTree:
  """Casts every leaf to varying over ``axes`` (a no-op where it already is)."""
  def one(x):
    missing = tuple(sorted(frozenset(axes) - _vma(x)))
    return jax.lax.pcast(x, missing, to='varying') if missing else x
  return jax.tree.map(one, tree)


def _like(tree: PyTree, avals: PyTree) -> PyTree:
  """Casts each leaf of ``tree`` to the varying axes of the matching aval."""
  return jax.tree.map(lambda x, a: _vary(x, _vma(a)), tree, avals)


def _full(avals: PyTree, fill: float, n: int | None = None) -> PyTree:
  """Arrays like ``avals`` (``[n, *shape]`` if ``n``) holding ``fill``.

  Non-float leaves hold 0; the varying axes are those of the avals.
  """
  def one(a):
    value = fill if jnp.issubdtype(a.dtype, jnp.inexact) else 0
    shape = a.shape if n is None else (n,) + a.shape
    return _vary(jnp.full(shape, value, a.dtype), _vma(a))
  return jax.tree.map(one, avals)


# ---------------------------------------------------------------- the stage


class _Stage:
  """``stage_fn`` split into the forward and backward halves the blocks run.

  Without remat, ``F`` stashes the leaves of the ``jax.vjp`` closure except
  the stage's own parameters (which ``B`` reads from the parameter buffer
  again, so they are never copied per microbatch); with remat it stashes the
  stage input and ``B`` recomputes the forward.
  """

  def __init__(self, stage_fn: StageFn, remat: bool):
    self.stage_fn = stage_fn
    self.remat = remat
    self.treedef = None      # of the VJP closure, set by ``trace``
    self.param_index = None  # per closure leaf: index of a param leaf or None

  def _split(self, params, x):
    y, vjp = jax.vjp(self.stage_fn, params, x)
    leaves, treedef = jax.tree.flatten(vjp)
    p_leaves = jax.tree.leaves(params)
    index = tuple(next((k for k, q in enumerate(p_leaves) if q is leaf), None)
                  for leaf in leaves)
    return y, [l for l, k in zip(leaves, index) if k is None], treedef, index

  def trace(self, params, x):
    """Records the closure structure; returns ``(y, stash)`` avals."""
    if self.remat:
      return jax.eval_shape(self.stage_fn, params, x), jax.typeof(x)
    out = {}

    def probe(params, x):
      y, stash, out['treedef'], out['index'] = self._split(params, x)
      return y, stash
    y, stash = jax.eval_shape(probe, params, x)
    self.treedef, self.param_index = out['treedef'], out['index']
    return y, stash

  def forward(self, params, x):
    """``(y, stash)`` for the ``F`` block."""
    if self.remat:
      return self.stage_fn(params, x), x
    y, stash, _, index = self._split(params, x)
    if index != self.param_index:
      raise RuntimeError('stage_fn traced to a different VJP structure twice; '
                         'it must be a pure function of (params, x).')
    return y, stash

  def backward(self, params, stash, dy):
    """``(dparams, dx)`` from the stash and the output cotangent ``dy``."""
    if self.remat:
      _, vjp = jax.vjp(self.stage_fn, params, stash)
    else:
      p_leaves, rest = jax.tree.leaves(params), iter(stash)
      vjp = jax.tree.unflatten(self.treedef, [
          next(rest) if k is None else p_leaves[k] for k in self.param_index])
    return vjp(dy)


# ---------------------------------------------------------------- executor


def _run(stage_fn: StageFn, loss_fn: LossFn | None, lowered: LoweredSchedule,
         local_params: PyTree, loss_params: PyTree, inputs: jax.Array,
         targets: PyTree, *, axis: str, remat: bool, bubble_fill: float):
  """The scan over ticks on one rank (inside ``shard_map``); see module doc.

  Args are one rank's view: ``local_params`` ``[v, ...]``, ``inputs``
  ``[m, mb, ...]``, ``targets`` leaves ``[m, mb, ...]``.

  Returns:
    Training (``loss_fn`` given): ``(loss, dlocal_params, dloss_params,
    dinputs)``, the loss and gradients of the mean over the ``m``
    microbatches; forward-only: the last stage's outputs ``[m, mb, ...]``.
    Everything but ``dlocal_params`` is reduced over ``axis``.
  """
  schedule = lowered.schedule
  p, m = schedule.num_ranks, schedule.num_microbatches
  last = schedule.num_stages - 1
  train = loss_fn is not None
  stage = _Stage(stage_fn, remat or not train)
  rank = jax.lax.axis_index(axis)
  v = schedule.num_stages // p

  # Every value the blocks touch varies over the pipeline axis and over
  # what the batch varies over (e.g. 'data'): no gradient is then psum-ed
  # implicitly inside a block that only some ranks run.
  base = _vma(inputs) | {axis}
  local_params = _vary(local_params, base)
  loss_params = _vary(loss_params, base)
  one_params = jax.tree.map(lambda a: a[0], local_params)

  def seed(lp, y, target):
    """This microbatch's share of the mean loss, and its grad w.r.t. (lp, y)."""
    fn = lambda lp, y: loss_fn(lp, y, target) / m
    return jax.value_and_grad(fn, argnums=(0, 1))(lp, y)

  # Types of everything the blocks produce. The activations' varying axes
  # are a fixed point of x -> y (-> loss cotangent -> dx) -> x.
  act_vma = base
  while True:
    x = _vary(jnp.zeros(inputs.shape[1:], inputs.dtype), act_vma)
    y_aval, stash_aval = stage.trace(one_params, x)
    new = act_vma | _vma(y_aval)
    if train:
      y = _vary(jnp.zeros_like(x), _vma(y_aval))
      loss_aval, (dlp_aval, dy_aval) = jax.eval_shape(
          seed, loss_params, y, jax.tree.map(lambda t: t[0], targets))
      dy = _vary(jnp.zeros_like(x), new | _vma(dy_aval))
      dp_aval, dx_aval = jax.eval_shape(
          stage.backward, one_params, _full(stash_aval, 0), dy)
      new |= _vma(dy_aval) | _vma(dx_aval)
    if new == act_vma:
      break
    act_vma = new
  act_aval = jax.typeof(x)

  def params_of(j):
    return jax.tree.map(lambda a: a[j], local_params)

  def put(buf, index, value):
    """``buf[index] = value`` (in place), cast to the buffer's varying axes."""
    return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(
        b, _like(v, b[0]), index, 0), buf, value)

  def add_grads(grads, j, dp):
    """``grads[j] += dp``, in place."""
    return jax.tree.map(lambda g, d: g.at[j].add(_like(d, g[j])), grads, dp)

  # One block per action kind; each runs in a ``_when`` and updates the tick
  # state (payload, grads, loss, dloss_params) in place. The writers (``F``)
  # also carry the stash and write their slot in place; the readers (``B``,
  # ``I``, ``W``) run inside one loop that reads the stash entry (two loops
  # reading the stash would each copy it). No tick copies a stash buffer.
  def fwd(state, stash, j, slot, x, target):
    del target
    if not train:
      return (_like(stage_fn(params_of(j), x), act_aval),), None
    y, new = stage.forward(params_of(j), x)
    return (_like(y, act_aval), *state[1:]), put(stash, slot, new)

  def fwd_last(state, stash, j, slot, x, target):
    _, grads, loss, dlp = state
    y, new = stage.forward(params_of(j), x)
    l, (dl, dy) = seed(loss_params, y, target)
    return (_like(dy, act_aval), grads, loss + _like(l, loss),
            jax.tree.map(lambda a, d: a + _like(d, a), dlp, dl)
            ), put(stash, slot, new)

  def bwd(state, st, j, dy):
    _, grads, *acc = state
    dp, dx = stage.backward(params_of(j), st, dy)
    return (_like(dx, act_aval), add_grads(grads, j, dp), *acc)

  def bwd_input(state, st, j, dy):
    dx = stage.backward(params_of(j), st, dy)[1]
    return (_like(dx, act_aval), *state[1:])

  def bwd_weight(state, st, j, dy):
    payload, grads, *acc = state
    dp = stage.backward(params_of(j), st, dy)[0]
    return (payload, add_grads(grads, j, dp), *acc)

  writers = {F: fwd, _F_LAST: fwd_last} if train else {F: fwd}
  readers = {B: bwd, I: bwd_input, W: bwd_weight} if train else {}
  present = set(np.unique(lowered.kind).tolist()) | {_F_LAST}
  readers, writers = ({code: block for code, block in blocks.items()
                       if code in present} for blocks in (readers, writers))

  # The batch-sized result (input cotangents, or the outputs when not
  # training) is produced on one rank, one microbatch at a time. It is kept
  # replicated over ``axis`` by a psum of that microbatch on the ticks that
  # produce one (the same ticks on every rank), so that the scan writes the
  # output buffer in place: no O(m) temporary, no O(m) psum at the end.
  edge_kinds, edge_stage = ((B, I), 0) if train else ((F,), last)
  produces = np.isin(lowered.kind, edge_kinds) & (lowered.stage == edge_stage)
  edge_rows = (produces.any(1),
               np.where(produces, lowered.microbatch, 0).max(1))
  edge_vma = act_vma - {axis}

  def tick(carry, row):
    mailbox, stash, grads, loss, dlp, edge = carry
    row, (edge_now, edge_mb) = row
    kind, stg, mb, j, read, slot, recv = (a[rank] for a in row)
    mb, j, slot = jnp.maximum(mb, 0), jnp.maximum(j, 0), jnp.maximum(slot, 0)
    x = jnp.where(read >= 0, mailbox[jnp.maximum(read, 0)], inputs[mb])
    target = jax.tree.map(lambda t: t[mb], targets)
    branch = kind
    if train:
      branch = jnp.where((kind == F) & (stg == last), _F_LAST, kind)
    state = (_full(act_aval, bubble_fill), grads, loss, dlp)
    if not train:
      state = state[:1]
    if readers:
      # One loop reads the stash (several would each copy it); it reads the
      # entry, then runs the block of this tick's kind.
      def read(state):
        st = jax.tree.map(lambda b: b[slot], stash)
        for code, block in readers.items():
          state = _when(branch == code, lambda s, block=block: block(
              s, st, j, x), state)
        return state
      state = _when(jnp.isin(branch, np.array(list(readers))), read, state)
    for code, block in writers.items():
      state, stash = _when(branch == code, lambda c, block=block: block(
          *c, j, slot, x, target), (state, stash))
    payload = state[0]
    if train:
      _, grads, loss, dlp = state
    mine = jnp.isin(kind, jnp.array(edge_kinds)) & (stg == edge_stage)
    edge = _when(edge_now, lambda e: jax.lax.dynamic_update_index_in_dim(
        e, jax.lax.psum(jnp.where(mine, payload, 0), axis), edge_mb, 0), edge)
    for k, offset in enumerate(lowered.offsets):
      msg = payload if offset == 0 else jax.lax.ppermute(
          payload, axis, [(r, (r + offset) % p) for r in range(p)])
      # No message: write into the spare last slot, which nothing reads.
      mailbox = put(mailbox, jnp.where(recv[k] >= 0, recv[k], spare), msg)
    return (mailbox, stash, grads, loss, dlp, edge), None

  stash = grads = loss = dlp = None
  if train:
    grads = _full(dp_aval, 0, v)
    loss, dlp = _full(loss_aval, 0), _full(dlp_aval, 0)
    stash = _full(stash_aval, bubble_fill, lowered.num_stash_slots)
  spare = lowered.num_mailbox_slots
  mailbox = _full(act_aval, bubble_fill, spare + 1)
  edge = _vary(jnp.zeros((m,) + act_aval.shape, act_aval.dtype), edge_vma)
  rows = (lowered.kind, lowered.stage, lowered.microbatch, lowered.local_stage,
          lowered.read_slot, lowered.stash_slot, lowered.recv_slot)
  (_, _, grads, loss, dlp, edge), _ = jax.lax.scan(
      tick, (mailbox, stash, grads, loss, dlp, edge), (rows, edge_rows))
  if not train:
    return edge
  return jax.lax.psum(loss, axis), grads, jax.lax.psum(dlp, axis), edge


def _when(pred: jax.Array, fn: Callable[[PyTree], PyTree],
          state: PyTree) -> PyTree:
  """``fn(state)`` if ``pred`` else ``state``, updating buffers in place.

  A ``while_loop`` of zero or one trip. XLA keeps while-loop carries in
  place, whereas a ``lax.cond``/``lax.switch`` copies every buffer that a
  branch passes through unchanged: with a branch per action kind that would
  copy the gradient accumulators and stash on every tick.
  """
  return jax.lax.while_loop(
      lambda c: c[0], lambda c: (c[0] & False, fn(c[1])), (pred, state))[1]


# ---------------------------------------------------------------- checks


def _check_fn(fn: Any, name: str) -> None:
  if not callable(fn):
    raise TypeError(f'{name} must be callable, got {type(fn).__name__}: '
                    f'{fn!r}.')


def _check_float(tree: PyTree, name: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    if not jnp.issubdtype(jnp.result_type(leaf), jnp.inexact):
      raise TypeError(
          f'{name}{jax.tree_util.keystr(path)} has dtype '
          f'{jnp.result_type(leaf)}; the pipeline differentiates it, so it '
          'must be floating point (cast it, or close over integer data in '
          'stage_fn/loss_fn instead).')


def _check_leading(tree: PyTree, size: int, name: str, rule: str) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    shape = np.shape(leaf)
    if not shape or shape[0] != size:
      raise ValueError(
          f'{name}{jax.tree_util.keystr(path)} has shape {shape} but its '
          f'leading axis must be {rule}={size}: stack one slice per stage '
          '(e.g. jax.tree.map(lambda *a: jnp.stack(a), *per_stage)).')


def _microbatched(inputs: jax.Array, targets: PyTree, m: int):
  """``inputs`` and every ``targets`` leaf reshaped to ``[m, batch/m, ...]``."""
  if np.ndim(inputs) == 0:
    raise ValueError(f'inputs must have a leading batch axis, got shape '
                     f'{np.shape(inputs)}.')
  batch = np.shape(inputs)[0]
  if batch % m:
    raise ValueError(
        f'inputs batch size {batch} is not divisible by the schedule\'s '
        f'num_microbatches={m}: use a batch that is a multiple of {m} or a '
        f'schedule whose microbatch count divides {batch}.')
  for path, leaf in jax.tree_util.tree_leaves_with_path(targets):
    if not np.shape(leaf) or np.shape(leaf)[0] != batch:
      raise ValueError(
          f'targets{jax.tree_util.keystr(path)} has shape {np.shape(leaf)} but '
          f'inputs has batch size {batch}: inputs and targets must share the '
          'leading batch axis.')
  split = lambda a: jnp.reshape(a, (m, batch // m) + np.shape(a)[1:])
  return split(inputs), jax.tree.map(split, targets)


def _check_stage_fn(stage_fn: StageFn, params: PyTree, x: jax.Array) -> None:
  """``ValueError`` unless ``stage_fn`` keeps the activation shape and dtype."""
  out = jax.eval_shape(stage_fn, jax.tree.map(lambda a: a[0], params), x[0])
  if (not isinstance(out, jax.ShapeDtypeStruct) or out.shape != x.shape[1:]
      or out.dtype != x.dtype):
    got = (f'{out.dtype}{list(out.shape)}' if isinstance(
        out, jax.ShapeDtypeStruct) else f'a {type(out).__name__}')
    raise ValueError(
        f'stage_fn maps a microbatch {x.dtype}{list(x.shape[1:])} to {got}; '
        'a pipeline stage must return an array of the same shape and dtype '
        'as its input. Move shape-changing layers (embedding, head) out of '
        'the stages: in front of the pipeline (PipelineGrads.inputs gives '
        'their cotangent) or into loss_fn.')


def _check_axis(axis: str, schedule: Schedule) -> None:
  """Inside ``shard_map``: ``axis`` must have ``schedule.num_ranks`` ranks."""
  size = jax.lax.axis_size(axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'axis {axis!r} has size {size} but schedule {schedule.name!r} has '
        f'num_ranks={schedule.num_ranks}: lower a schedule for {size} ranks.')


def _check_lowered(lowered: Any) -> LoweredSchedule:
  if not isinstance(lowered, LoweredSchedule):
    raise TypeError(f'lowered must be a LoweredSchedule from '
                    f'jaxpar.pipeline.lower(schedule), got '
                    f'{type(lowered).__name__}.')
  return lowered


def _check_fill(bubble_fill: Any) -> float:
  if isinstance(bubble_fill, bool) or not isinstance(
      bubble_fill, (int, float, np.floating)):
    raise TypeError(f'bubble_fill={bubble_fill!r} must be a float (e.g. 0.0, '
                    "or float('nan') to check that bubbles are inert).")
  return float(bubble_fill)


def _lowered_for(schedule: Any, mesh: Mesh, axis: str,
                 training: bool) -> LoweredSchedule:
  """Lowers ``schedule`` after checking it against ``mesh`` and the mode."""
  if not isinstance(schedule, Schedule):
    raise TypeError(f'schedule must be a jaxpar.pipeline.Schedule (e.g. '
                    f'jaxpar.pipeline.one_f_one_b(p, m)), got '
                    f'{type(schedule).__name__}.')
  size = axis_size(mesh, axis)
  if size != schedule.num_ranks:
    raise ValueError(
        f'mesh axis {axis!r} has size {size} but schedule {schedule.name!r} '
        f'has num_ranks={schedule.num_ranks}: build the schedule for {size} '
        f'ranks or a mesh with {axis}={schedule.num_ranks}.')
  return lower(schedule, forward_only=not training)


# ---------------------------------------------------------------- public


def pipeline_step_local(
    stage_fn: StageFn, loss_fn: LossFn, local_params: PyTree,
    loss_params: PyTree, inputs: jax.Array, targets: PyTree, *,
    lowered: LoweredSchedule, axis: str = 'stage', remat: bool = False,
    bubble_fill: float = 0.0) -> tuple[jax.Array, PipelineGrads]:
  """One rank's share of ``pipeline_step``; call it inside ``jax.shard_map``.

  For composing pipeline parallelism with other axes: the caller's
  ``shard_map`` spans ``axis`` and maybe others; ``stage_fn`` may use
  collectives over the other axes (all devices of a group sit on the same
  pipeline rank and run the same blocks).

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss of
      one microbatch, run after the last stage.
    local_params: this rank's stages, leading axis ``v`` in the order of
      ``stages_to_ranks`` (``stages_to_ranks(params, schedule)[rank]``).
    loss_params: the loss parameters (replicated over ``axis``).
    inputs: ``[batch, ...]`` (this shard's batch, the same on every rank of
      ``axis``), split into ``m`` microbatches.
    targets: pytree of ``[batch, ...]`` leaves.
    lowered: ``lower(schedule)``.
    axis: the pipeline axis, of size ``schedule.num_ranks``.
    remat: stash only each stage's input and recompute its forward in the
      backward (and twice, in ``I`` and ``W``, for zero-bubble schedules).
    bubble_fill: value of unwritten buffer slots and of whatever idle ranks
      send; ``float('nan')`` checks that bubbles never reach the results.

  Returns:
    ``(loss, PipelineGrads(stages, loss, inputs))``: the mean loss over this
    shard's batch and its gradients; ``stages`` is this rank's ``[v, ...]``
    (varying over ``axis``), the rest is reduced over ``axis``. Nothing is
    reduced over other axes: with a batch sharded ``n`` ways over a data
    axis, ``pmean`` the loss and the parameter gradients over it and divide
    ``inputs`` (this shard's cotangent) by ``n``.

  Example:
    >>> stage_fn = lambda w, x: jnp.tanh(x @ w)
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> low = jaxpar.pipeline.lower(jaxpar.pipeline.one_f_one_b(4, 8))
    >>> def body(w, scale, x, t):   # one rank's view
    ...   loss, g = jaxpar.pipeline.pipeline_step_local(
    ...       stage_fn, loss_fn, w[0], scale, x, t, lowered=low)
    ...   return loss, g.stages[None]
    >>> step = jax.jit(jax.shard_map(
    ...     body, mesh=jaxpar.make_mesh(stage=4, data=2), axis_names={'stage'},
    ...     in_specs=(P('stage'), P(), P(), P()), out_specs=(P(), P('stage'))))
    >>> w = np.full((4, 1, 16, 16), 1 / 16, np.float32)   # [p, v, ...]
    >>> loss, dw = step(w, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> dw.shape
    (4, 1, 16, 16)
  """
  lowered = _check_lowered(lowered)
  _check_fn(stage_fn, 'stage_fn')
  _check_fn(loss_fn, 'loss_fn')
  if not lowered.training:
    raise ValueError(f'lowered schedule {lowered.schedule.name!r} has no '
                     'backward actions; use pipeline_apply_local.')
  schedule = lowered.schedule
  _check_axis(axis, schedule)
  for tree, name in ((local_params, 'local_params'),
                     (loss_params, 'loss_params'), (inputs, 'inputs')):
    _check_float(tree, name)
  _check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                 'local_params', 'num_stages // num_ranks')
  xs, ts = _microbatched(inputs, targets, schedule.num_microbatches)
  _check_stage_fn(stage_fn, local_params, xs)
  loss, grads, dlp, dx = _run(
      stage_fn, loss_fn, lowered, local_params, loss_params, xs, ts,
      axis=axis, remat=bool(remat), bubble_fill=_check_fill(bubble_fill))
  return loss, PipelineGrads(grads, dlp, dx.reshape(np.shape(inputs)))


def pipeline_apply_local(
    stage_fn: StageFn, local_params: PyTree, inputs: jax.Array, *,
    lowered: LoweredSchedule, axis: str = 'stage',
    bubble_fill: float = 0.0) -> jax.Array:
  """One rank's share of ``pipeline_apply``; call it inside ``jax.shard_map``.

  Args are those of ``pipeline_step_local``; ``lowered`` must be
  forward-only (``lower`` of a schedule with only ``F`` actions).

  Returns:
    ``[batch, ...]``, the last stage's outputs, reduced over ``axis``.
  """
  lowered = _check_lowered(lowered)
  _check_fn(stage_fn, 'stage_fn')
  if lowered.training:
    raise ValueError(f'lowered schedule {lowered.schedule.name!r} has '
                     'backward actions; lower its F actions only for '
                     'pipeline_apply_local.')
  schedule = lowered.schedule
  _check_axis(axis, schedule)
  _check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                 'local_params', 'num_stages // num_ranks')
  xs, _ = _microbatched(inputs, (), schedule.num_microbatches)
  _check_stage_fn(stage_fn, local_params, xs)
  out = _run(stage_fn, None, lowered, local_params, (), xs, (), axis=axis,
             remat=True, bubble_fill=_check_fill(bubble_fill))
  return out.reshape(np.shape(inputs))


def pipeline_step(
    stage_fn: StageFn, loss_fn: LossFn, *, schedule: Schedule, mesh: Mesh,
    axis: str = 'stage', remat: bool = False, bubble_fill: float = 0.0
) -> Callable[[PyTree, PyTree, jax.Array, PyTree],
              tuple[jax.Array, PipelineGrads]]:
  """A jitted pipelined training step: loss and gradients of the batch mean.

  The batch is split into ``m = schedule.num_microbatches`` equal
  microbatches that flow through ``S = schedule.num_stages`` logical stages
  placed on the ``p`` ranks of ``mesh.shape[axis]`` as the schedule says.
  The result equals ``jax.value_and_grad`` of the sequential model::

    loss = mean_i loss_fn(loss_params, stage_{S-1}(... stage_0(x_i)), t_i)

  Memory per rank: the parameters, the batch and its gradient, plus
  ``lower(schedule).num_stash_slots`` stashes (VJP residuals without the
  parameters; the stage input with ``remat``) and ``num_mailbox_slots``
  activations, independent of ``m`` for 1F1B, interleaved and zero-bubble.
  When the placement is not one stage per rank in order (interleaved, V),
  the model-order stage parameters and gradients are permuted to and from
  the rank layout every step, which gathers them on every device; for large
  models keep them in that layout (``stages_to_ranks``) and call
  ``pipeline_step_local`` in your own ``shard_map``.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y`` with ``y`` of ``x``'s
      shape and dtype; ``x`` is one microbatch ``[batch/m, ...]``.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss
      over one microbatch, applied to the last stage's output.
    schedule: a training ``Schedule`` (GPipe, 1F1B, interleaved, zero-bubble,
      or from CSV).
    mesh: a mesh with axis ``axis`` of size ``schedule.num_ranks``.
    axis: the pipeline axis name.
    remat: stash only stage inputs and recompute the forward in the backward.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send;
      ``float('nan')`` checks that bubbles never reach the results.

  Returns:
    ``step(stage_params, loss_params, inputs, targets) -> (loss,
    PipelineGrads(stages, loss, inputs))``, jitted. ``stage_params`` is a
    pytree stacked ``[num_stages, ...]`` in model order; ``inputs`` is
    ``[batch, ...]`` and ``targets`` a pytree of ``[batch, ...]`` leaves.
    Shapes are checked when ``step`` is traced, before compiling.

  Raises:
    TypeError / ValueError: for a non-callable function, a schedule that does
      not fit the mesh or does not train; when called, for a leading axis
      other than ``num_stages``, a batch not divisible by ``m``, targets of
      another batch size or a ``stage_fn`` that changes the shape.

  Example:
    >>> stage_fn = lambda p, x: jnp.tanh(x @ p['w'] + p['b'])
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> step = jaxpar.pipeline.pipeline_step(
    ...     stage_fn, loss_fn, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> params = {'w': np.full((4, 16, 16), 1 / 16, np.float32),
    ...           'b': np.zeros((4, 16), np.float32)}    # 4 stages
    >>> loss, grads = step(params, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> grads.stages['w'].shape, grads.inputs.shape
    ((4, 16, 16), (32, 16))
  """
  _check_fn(stage_fn, 'stage_fn')
  _check_fn(loss_fn, 'loss_fn')
  lowered = _lowered_for(schedule, mesh, axis, training=True)
  bubble_fill = _check_fill(bubble_fill)

  def local(params, loss_params, inputs, targets):
    loss, grads = pipeline_step_local(
        stage_fn, loss_fn, jax.tree.map(lambda a: a[0], params), loss_params,
        inputs, targets, lowered=lowered, axis=axis, remat=remat,
        bubble_fill=bubble_fill)
    return loss, grads._replace(
        stages=jax.tree.map(lambda a: a[None], grads.stages))

  by_stage = NamedSharding(mesh, P(axis))
  sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P(axis), P(), P(), P()),
      out_specs=(P(), PipelineGrads(P(axis), P(), P())), axis_names={axis})

  @jax.jit
  def step(stage_params, loss_params, inputs, targets):
    _check_leading(stage_params, schedule.num_stages, 'stage_params',
                   'schedule.num_stages')
    # Replicated on every device (a no-op unless the caller sharded them).
    loss_params, inputs, targets = jax.reshard(
        (loss_params, inputs, targets), NamedSharding(mesh, P()))
    loss, grads = sharded(
        stages_to_ranks(stage_params, schedule, out_sharding=by_stage),
        loss_params, inputs, targets)
    return loss, grads._replace(stages=ranks_to_stages(
        grads.stages, schedule, out_sharding=by_stage))
  return step


@functools.partial(jax.jit, static_argnames=(
    'stage_fn', 'schedule', 'mesh', 'axis', 'bubble_fill'))
def _apply(stage_fn, stage_params, inputs, *, schedule, mesh, axis,
           bubble_fill):
  bubble_fill = float(bubble_fill)  # passed as a str: nan == nan for the cache
  lowered = _lowered_for(schedule, mesh, axis, training=False)
  _check_leading(stage_params, schedule.num_stages, 'stage_params',
                 'schedule.num_stages')
  local = lambda params, x: pipeline_apply_local(
      stage_fn, jax.tree.map(lambda a: a[0], params), x, lowered=lowered,
      axis=axis, bubble_fill=bubble_fill)
  params = stages_to_ranks(stage_params, schedule,
                           out_sharding=NamedSharding(mesh, P(axis)))
  inputs = jax.reshard(inputs, NamedSharding(mesh, P()))
  return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P()),
                       out_specs=P(), axis_names={axis})(params, inputs)


def pipeline_apply(stage_fn: StageFn, stage_params: PyTree,
                   inputs: jax.Array, *, schedule: Schedule, mesh: Mesh,
                   axis: str = 'stage', bubble_fill: float = 0.0) -> jax.Array:
  """The pipelined forward pass (inference): all stages on every microbatch.

  Runs the ``F`` actions of ``schedule`` (any schedule; its backward actions
  are dropped) and returns ``stage_{S-1}(... stage_0(x))`` for the whole
  batch. Compiled once per ``(stage_fn, schedule, mesh, axis)`` and shapes.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``.
    stage_params: pytree stacked ``[num_stages, ...]`` in model order.
    inputs: ``[batch, ...]`` with ``batch`` divisible by
      ``schedule.num_microbatches``.
    schedule: a ``Schedule`` whose ``num_ranks`` is ``mesh.shape[axis]``.
    mesh: the device mesh.
    axis: the pipeline axis name.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send.

  Returns:
    ``[batch, ...]``, replicated over ``axis``.

  Example:
    >>> y = jaxpar.pipeline.pipeline_apply(
    ...     lambda w, x: jnp.tanh(x @ w), np.ones((4, 16, 16), np.float32),
    ...     np.ones((32, 16), np.float32), mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> y.shape
    (32, 16)
  """
  _check_fn(stage_fn, 'stage_fn')
  return _apply(stage_fn, stage_params, inputs, schedule=schedule, mesh=mesh,
                axis=axis, bubble_fill=str(_check_fill(bubble_fill)))
