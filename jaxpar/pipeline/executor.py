"""The pipeline executor: any lowered ``Schedule`` as one SPMD program.

``pipeline_value_and_grad`` (alias ``pipeline_step``) computes the loss and
gradients of a pipelined model, ``pipeline_apply`` its forward pass. Both are one ``jax.shard_map`` over the pipeline axis around
one ``lax.scan`` over the ticks of the lowered schedule
(``jaxpar.pipeline.lower``; ``docs/executor.md`` draws a tick). Per tick,
every rank

1. reads its row of the tick table (action kind, stage, microbatch, slots);
2. reads the action's input: the batch for stage 0's ``F``, else a mailbox
   slot (the activation for ``F``, the output cotangent for ``I`` and ``W``);
3. runs the block of its action kind and no other (``StageVJP``):

   * ``F``: ``stage_fn`` forward, writing the activations its backward needs
     (never the parameters or values computed from them alone) to its stash
     slot in place; on the last stage also ``loss_fn`` and the loss
     cotangent;
   * ``I``: the input cotangent, keeping what ``W`` needs (the cotangents at
     the parameter-consuming operations) in a weight-stash slot;
   * ``W``: the parameter cotangent from what ``I`` kept, added to the
     gradient accumulator in place. ``I`` and ``W`` together do the FLOPs of
     one backward; a schedule's ``B`` runs as an ``I`` and the ``W`` after it.

   An idle rank computes nothing;
4. sends the block's output (``W`` sends the input cotangent its ``I``
   computed, as a ``B`` would when it ends) with one ``ppermute`` per distinct
   rank offset of the schedule (every rank takes part every tick); receivers
   store it in the mailbox slot the table names; a tick on which no rank
   sends over an offset skips that ``ppermute`` (the table says so, the same
   on every rank). No other collective runs inside the scan: the rank of
   stage 0 writes each microbatch's input cotangent (forward only: the last
   stage its output) into a batch-sized buffer, which one ``psum`` over the
   pipeline axis hands to every rank after the scan. (A ``psum`` per
   microbatch would keep that buffer in place, but an all-reduce couples all
   ranks and, over gloo, costs several times a ``ppermute``.)

**Dispatch.** The block of a tick is chosen by a zero-or-one-trip
``while_loop`` per kind (``_when``) rather than a ``lax.switch``: XLA updates
loop carries in place, while a ``switch`` copies every buffer a branch passes
through unchanged (gradient accumulators, stashes) on every tick. Each
``_when`` tests one predicate. On XLA:GPU a predicate of a ``while`` is read
back to the host, so a training tick costs ``6 + K`` host round-trips:
``F``, the last stage's ``F`` with the loss, the stash read shared by ``I``
and ``W``, ``I`` and ``W`` inside it, one per message offset ``K`` (one for
``p = 2``, two for 1F1B on more ranks) and the result write; a forward-only
tick costs ``2 + K``.

Buffer updates are selects or writes to a spare slot, never masks multiplied
in, so whatever a bubble produces (``bubble_fill``, NaN in the tests) never
reaches the results. Memory is the schedule's: ``num_stash_slots`` stashes,
``num_weight_slots`` weight stashes and ``num_mailbox_slots + 1`` activations
per rank (``O(p)`` for 1F1B whatever the number of microbatches ``m``), plus
the parameters, their gradients, the batch and its gradient.

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
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.pipeline._vma import full, like, vary, vma
from jaxpar.pipeline.checks import (check_axis, check_compute_dtype,
                                    check_fill, check_float, check_fn,
                                    check_key, check_leading, check_loss_fn,
                                    check_lowered, check_offset, check_stage_fn,
                                    lowered_for, microbatched, with_key)
from jaxpar.pipeline.layout import ranks_to_stages, stages_to_ranks
from jaxpar.pipeline.lower import F, I, W, LoweredSchedule
from jaxpar.pipeline.schedule import Schedule
from jaxpar.pipeline.stage import StageVJP

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


def _run(stage_fn: StageFn, loss_fn: LossFn | None, lowered: LoweredSchedule,
         local_params: PyTree, loss_params: PyTree, inputs: jax.Array,
         targets: PyTree, *, axis: str, remat: bool, bubble_fill: float,
         key: jax.Array | None = None, offset: Any = 0,
         has_aux: bool = False):
  """The scan over ticks on one rank (inside ``shard_map``); see module doc.

  Args are one rank's view: ``local_params`` ``[v, ...]``, ``inputs``
  ``[m, mb, ...]``, ``targets`` leaves ``[m, mb, ...]``; ``key`` the step's
  key, ``offset`` the global index of this shard's first microbatch.

  Returns:
    Training (``loss_fn`` given): ``((loss, aux), dlocal_params,
    dloss_params, dinputs)``, the loss (``aux``: ``()`` without ``has_aux``)
    and gradients of the mean over the ``m`` microbatches; forward-only: the
    last stage's outputs ``[m, mb, ...]``. Everything but ``dlocal_params``
    is reduced over ``axis``.
  """
  schedule = lowered.schedule
  p, m = schedule.num_ranks, schedule.num_microbatches
  last = schedule.num_stages - 1
  train = loss_fn is not None
  stage = StageVJP(stage_fn, remat or not train)
  rank = jax.lax.axis_index(axis)
  v = schedule.num_stages // p

  # Every value the blocks touch varies over the pipeline axis and over
  # what the batch varies over (e.g. 'data'): no gradient is then psum-ed
  # implicitly inside a block that only some ranks run.
  base = vma(inputs) | {axis}
  local_params = vary(local_params, base)
  loss_params = vary(loss_params, base)
  one_params = jax.tree.map(lambda a: a[0], local_params)

  def key_of(stg, mb):
    """The key of (logical stage ``stg``, microbatch ``mb``); the loss of
    microbatch ``mb`` has ``stg = num_stages``. A function of the global
    microbatch index, so of the batch rows, not of the schedule or mesh."""
    if key is None:
      return None
    return jax.random.fold_in(jax.random.fold_in(key, offset + mb), stg)

  def seed(lp, y, target, k):
    """This microbatch's share of the mean loss (and aux, at least float32),
    and the loss's grad w.r.t. (lp, y)."""
    def fn(lp, y):
      out = loss_fn(lp, y, target, *with_key(k))
      loss, aux = out if has_aux else (out, ())
      return jax.tree.map(lambda a: a.astype(jnp.promote_types(
          a.dtype, jnp.float32)) / m, (loss, aux))
    return jax.value_and_grad(fn, argnums=(0, 1), has_aux=True)(lp, y)

  # Types of everything the blocks produce. The activations' varying axes
  # are a fixed point of x -> y (-> loss cotangent -> dx) -> x. The key is
  # built as in a tick (its microbatch comes from the rank's table row).
  k0 = key_of(rank * 0, rank * 0)
  act_vma = base
  while True:
    x = vary(jnp.zeros(inputs.shape[1:], inputs.dtype), act_vma)
    y_aval, stash_aval = stage.trace(one_params, x, k0)
    new = act_vma | vma(y_aval)
    if train:
      y = vary(jnp.zeros_like(x), vma(y_aval))
      out_aval, (dlp_aval, dy_aval) = jax.eval_shape(
          seed, loss_params, y, jax.tree.map(lambda t: t[0], targets), k0)
      dy = vary(jnp.zeros_like(x), new | vma(dy_aval))
      dp_aval, dx_aval = jax.eval_shape(
          stage.backward, one_params, full(stash_aval, 0), dy, k0)
      new |= vma(dy_aval) | vma(dx_aval)
    if new == act_vma:
      break
    act_vma = new
  act_aval = jax.typeof(x)
  if train:
    kept_aval = stage.split(one_params, full(stash_aval, 0), dy, k0)

  def params_of(j):
    return jax.tree.map(lambda a: a[j], local_params)

  def put(buf, index, value):
    """``buf[index] = value`` (in place), cast to the buffer's varying axes."""
    return jax.tree.map(lambda b, v: jax.lax.dynamic_update_index_in_dim(
        b, like(v, b[0]), index, 0), buf, value)

  # One block per action kind; each runs in a ``_when`` and updates the tick
  # state (payload, grads, (loss, aux), dloss_params) in place. ``F`` also
  # carries the stash and writes its slot in place; ``I`` and ``W`` run
  # inside one loop that reads the stash entry once and carries the weight
  # stash. ``at`` is the tick's (local stage j, logical stage, microbatch).
  def fwd(state, stash, at, slot, x, target):
    del target
    j, stg, mb = at
    if not train:
      return (like(stage_fn(params_of(j), x), act_aval),), None
    y, new = stage.forward(params_of(j), x, key_of(stg, mb))
    return (like(y, act_aval), *state[1:]), put(stash, slot, new)

  def fwd_last(state, stash, at, slot, x, target):
    _, grads, out, dlp = state
    j, stg, mb = at
    y, new = stage.forward(params_of(j), x, key_of(stg, mb))
    o, (dl, dy) = seed(loss_params, y, target, key_of(last + 1, mb))
    add = lambda acc, d: jax.tree.map(lambda a, d: a + like(d, a), acc, d)
    return (like(dy, act_aval), grads, add(out, o), add(dlp, dl)
            ), put(stash, slot, new)

  def bwd_input(carry, st, at, wslot, dy):
    state, wstash = carry
    j, stg, mb = at
    dx, kept = stage.input_grad(params_of(j), st, dy, key_of(stg, mb))
    dx = like(dx, act_aval)
    return (dx, *state[1:]), put(wstash, wslot, (kept, dx))

  def bwd_weight(carry, st, at, wslot, dy):
    (_, grads, *acc), wstash = carry
    j, stg, mb = at
    kept, dx = jax.tree.map(lambda b: b[wslot], wstash)
    dp = stage.weight_grad(params_of(j), st, dy, kept, key_of(stg, mb))
    grads = jax.tree.map(lambda g, d: g.at[j].add(like(d, g[j])), grads, dp)
    return (dx, grads, *acc), wstash

  present = set(np.unique(lowered.kind).tolist())
  writers = {F: fwd, _F_LAST: fwd_last} if train else {F: fwd}
  readers = {code: block for code, block in ((I, bwd_input), (W, bwd_weight))
             if code in present}

  # The batch-sized result (input cotangents, or the outputs when not
  # training) is produced on one rank, one microbatch at a time, into that
  # rank's buffer (zeros elsewhere); one psum after the scan replicates it.
  edge_kind, edge_stage = (I, 0) if train else (F, last)
  # Whether any rank receives over offset k at tick t: ticks without a
  # message skip that ppermute (the same on every rank, from the table).
  sends = (lowered.recv_slot >= 0).any(1)

  def tick(carry, row):
    mailbox, stash, wstash, grads, out, dlp, edge = carry
    row, send = row
    kind, stg, mb, j, read, slot, wslot, recv = (a[rank] for a in row)
    mb, j = jnp.maximum(mb, 0), jnp.maximum(j, 0)
    slot, wslot = jnp.maximum(slot, 0), jnp.maximum(wslot, 0)
    at = (j, stg, mb)
    x = jnp.where(read >= 0, mailbox[jnp.maximum(read, 0)], inputs[mb])
    target = jax.tree.map(lambda t: t[mb], targets)
    branch = kind
    if train:
      branch = jnp.where((kind == F) & (stg == last), _F_LAST, kind)
    state = (full(act_aval, bubble_fill), grads, out, dlp)
    if not train:
      state = state[:1]
    for code, block in writers.items():
      state, stash = _when(branch == code, lambda c, block=block: block(
          *c, at, slot, x, target), (state, stash))
    if readers:
      def read(carry):
        st = jax.tree.map(lambda b: b[slot], stash)
        for code, block in readers.items():
          carry = _when(branch == code, lambda c, block=block: block(
              c, st, at, wslot, x), carry)
        return carry
      state, wstash = _when(jnp.isin(branch, np.array(list(readers))), read,
                            (state, wstash))
    payload = state[0]
    if train:
      _, grads, out, dlp = state
    edge = _when((kind == edge_kind) & (stg == edge_stage),
                 lambda e: put(e, mb, payload), edge)
    for k, offset in enumerate(lowered.offsets):
      def deliver(mailbox, k=k, offset=offset):
        msg = payload if offset == 0 else jax.lax.ppermute(
            payload, axis, [(r, (r + offset) % p) for r in range(p)])
        # No message for this rank: the spare last slot, which nothing reads.
        return put(mailbox, jnp.where(recv[k] >= 0, recv[k], spare), msg)
      mailbox = _when(send[k], deliver, mailbox)
    return (mailbox, stash, wstash, grads, out, dlp, edge), None

  stash = wstash = grads = out = dlp = None
  if train:
    grads = full(dp_aval, 0, v)
    out, dlp = full(out_aval, 0), full(dlp_aval, 0)
    stash = full(stash_aval, bubble_fill, lowered.num_stash_slots)
    wstash = full((kept_aval, act_aval), bubble_fill,
                  max(lowered.num_weight_slots, 1))
  spare = lowered.num_mailbox_slots
  mailbox = full(act_aval, bubble_fill, spare + 1)
  edge = vary(jnp.zeros((m,) + act_aval.shape, act_aval.dtype), act_vma)
  rows = (lowered.kind, lowered.stage, lowered.microbatch, lowered.local_stage,
          lowered.read_slot, lowered.stash_slot, lowered.weight_slot,
          lowered.recv_slot)
  (_, _, _, grads, out, dlp, edge), _ = jax.lax.scan(
      tick, (mailbox, stash, wstash, grads, out, dlp, edge),
      (rows, sends))
  if not train:
    return jax.lax.psum(edge, axis)
  out, dlp, edge = jax.lax.psum((out, dlp, edge), axis)  # one collective
  return out, grads, dlp, edge


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


# ---------------------------------------------------------------- public


def pipeline_step_local(
    stage_fn: StageFn, loss_fn: LossFn, local_params: PyTree,
    loss_params: PyTree, inputs: jax.Array, targets: PyTree, *,
    lowered: LoweredSchedule, axis: str = 'stage', remat: bool = False,
    bubble_fill: float = 0.0, key: jax.Array | None = None,
    microbatch_offset: Any = 0, has_aux: bool = False,
    compute_dtype: Any = None) -> tuple[Any, PipelineGrads]:
  """One rank's share of ``pipeline_step``; call it inside ``jax.shard_map``.

  For composing pipeline parallelism with other axes: the caller's
  ``shard_map`` spans ``axis`` and maybe others; ``stage_fn`` may use
  collectives over the other axes (all devices of a group sit on the same
  pipeline rank and run the same blocks).

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``;
      ``stage_fn(one_stage_params, x, key)`` when ``key`` is given.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss of
      one microbatch, run after the last stage (``(scalar, aux)`` with
      ``has_aux``; a trailing ``key`` argument when ``key`` is given).
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
    key: the step's PRNG key, or ``None``. Stage ``k`` on microbatch ``i``
      gets ``fold_in(fold_in(key, microbatch_offset + i), k)``, the loss
      ``k = num_stages``: its forward, backward and recompute see one key.
    microbatch_offset: global index of this shard's first microbatch (with a
      batch sharded over a data axis: ``axis_index(data) * m``), so that the
      keys follow the batch rows, not the mesh.
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` (float leaves) is
      averaged over the microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: the stages and the loss run on
      params cast to it (inside the stage, so the stash never holds a cast
      copy of them) and on inputs cast to it; activations, stashes and
      messages are in it. Loss, aux and gradients stay in their dtypes
      (float32). ``None``: the dtypes given.

  Returns:
    ``(loss, PipelineGrads(stages, loss, inputs))`` (``((loss, aux), ...)``
    with ``has_aux``): the mean loss over this shard's batch and its
    gradients; ``stages`` is this rank's ``[v, ...]`` (varying over
    ``axis``), the rest is reduced over ``axis``. Nothing is reduced over
    other axes: with a batch sharded ``n`` ways over a data axis, ``pmean``
    the loss and the parameter gradients over it and divide ``inputs`` (this
    shard's cotangent) by ``n``.

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
  lowered = check_lowered(lowered)
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  if not lowered.training:
    raise ValueError(f'lowered schedule {lowered.schedule.name!r} has no '
                     'backward actions; use pipeline_apply_local.')
  schedule = lowered.schedule
  check_axis(axis, schedule)
  for tree, name in ((local_params, 'local_params'),
                     (loss_params, 'loss_params'), (inputs, 'inputs')):
    check_float(tree, name)
  check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                'local_params', 'num_stages // num_ranks')
  check_key(key)
  check_offset(microbatch_offset)
  dtype = check_compute_dtype(compute_dtype)
  if dtype is not None:
    stage_fn, loss_fn = _cast_params(stage_fn, dtype), _cast_params(
        loss_fn, dtype)
    inputs_dtype, inputs = jnp.result_type(inputs), jnp.asarray(inputs, dtype)
  xs, ts = microbatched(inputs, targets, schedule.num_microbatches)
  check_stage_fn(stage_fn, local_params, xs, key)
  check_loss_fn(loss_fn, loss_params, xs[0], jax.tree.map(lambda t: t[0], ts),
                key, has_aux)
  out, grads, dlp, dx = _run(
      stage_fn, loss_fn, lowered, local_params, loss_params, xs, ts,
      axis=axis, remat=bool(remat), bubble_fill=check_fill(bubble_fill),
      key=key, offset=microbatch_offset, has_aux=has_aux)
  dx = dx.reshape(np.shape(inputs))
  if dtype is not None:
    dx = dx.astype(inputs_dtype)
  return (out if has_aux else out[0]), PipelineGrads(grads, dlp, dx)


def _cast_params(fn: Callable[..., Any], dtype: Any) -> Callable[..., Any]:
  """``fn`` on its first argument (the params) cast to ``dtype``.

  The cast is part of the stage, so ``StageVJP`` finds the cast params to
  depend on the params alone and recomputes them rather than stash them;
  its transpose casts the params' cotangents back to their dtype.
  """
  return lambda params, *args: fn(optax.tree.cast(params, dtype), *args)


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
  lowered = check_lowered(lowered)
  check_fn(stage_fn, 'stage_fn')
  if lowered.training:
    raise ValueError(f'lowered schedule {lowered.schedule.name!r} has '
                     'backward actions; lower its F actions only for '
                     'pipeline_apply_local.')
  schedule = lowered.schedule
  check_axis(axis, schedule)
  check_leading(local_params, schedule.num_stages // schedule.num_ranks,
                'local_params', 'num_stages // num_ranks')
  xs, _ = microbatched(inputs, (), schedule.num_microbatches)
  check_stage_fn(stage_fn, local_params, xs)
  out = _run(stage_fn, None, lowered, local_params, (), xs, (), axis=axis,
             remat=True, bubble_fill=check_fill(bubble_fill))
  return out.reshape(np.shape(inputs))


def pipeline_value_and_grad(
    stage_fn: StageFn, loss_fn: LossFn, *, schedule: Schedule, mesh: Mesh,
    axis: str = 'stage', remat: bool = False, bubble_fill: float = 0.0,
    has_aux: bool = False, compute_dtype: Any = None
) -> Callable[..., tuple[Any, PipelineGrads]]:
  """A jitted pipelined step: the loss and gradients of the batch mean.

  Like ``jax.value_and_grad`` of the sequential model (no optimizer: plug
  the gradients into optax, or use ``jaxpar.parallel.train_step``).
  ``pipeline_step`` is the same function under its first name.

  The batch is split into ``m = schedule.num_microbatches`` equal
  microbatches that flow through ``S = schedule.num_stages`` logical stages
  placed on the ``p`` ranks of ``mesh.shape[axis]`` as the schedule says.
  The result equals ``jax.value_and_grad`` of the sequential model::

    loss = mean_i loss_fn(loss_params, stage_{S-1}(... stage_0(x_i)), t_i)

  With a ``key`` (dropout), stage ``k`` runs as ``stage_fn(params_k, x,
  k_ik)`` with ``k_ik = fold_in(fold_in(key, i), k)`` and the loss gets
  ``k_iS``: the same masks in the forward, the backward and a recompute, and
  the same result for every schedule of ``S`` stages.

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
      shape and dtype; ``x`` is one microbatch ``[batch/m, ...]``. Called
      as ``stage_fn(one_stage_params, x, key)`` when the step gets a key.
    loss_fn: ``loss_fn(loss_params, y, target) -> scalar``, the mean loss
      over one microbatch, applied to the last stage's output (``-> (scalar,
      aux)`` with ``has_aux``; a trailing ``key`` when the step gets one).
    schedule: a training ``Schedule`` (GPipe, 1F1B, interleaved, zero-bubble,
      or from CSV).
    mesh: a mesh with axis ``axis`` of size ``schedule.num_ranks``.
    axis: the pipeline axis name.
    remat: stash only stage inputs and recompute the forward in the backward.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send;
      ``float('nan')`` checks that bubbles never reach the results.
    has_aux: ``loss_fn`` returns ``(loss, aux)``, aux a pytree of floats
      averaged over microbatches like the loss.
    compute_dtype: e.g. ``jnp.bfloat16``: stages and loss compute on params
      and inputs cast to it, so activations, stashes and messages are in it;
      the loss, aux and all gradients keep their dtypes (float32).

  Returns:
    ``step(stage_params, loss_params, inputs, targets, key=None) -> (loss,
    PipelineGrads(stages, loss, inputs))`` (``((loss, aux), grads)`` with
    ``has_aux``), jitted. ``stage_params`` is a pytree stacked
    ``[num_stages, ...]`` in model order; ``inputs`` is ``[batch, ...]`` and
    ``targets`` a pytree of ``[batch, ...]`` leaves; ``key`` a PRNG key for
    the functions (``jax.random.key(seed)``; fold in the step number to
    draw new masks each step). Shapes are checked when ``step`` is traced,
    before compiling.

  Raises:
    TypeError / ValueError: for a non-callable function, a schedule that does
      not fit the mesh or does not train, a ``compute_dtype`` that is not a
      float dtype; when called, for a leading axis other than
      ``num_stages``, a batch not divisible by ``m``, targets of another
      batch size, a ``stage_fn`` that changes the shape, a ``loss_fn`` whose
      output is not a float scalar (or ``(scalar, floats)`` with
      ``has_aux``), or a ``key`` that is not one PRNG key.

  Example:
    >>> stage_fn = lambda p, x: jnp.tanh(x @ p['w'] + p['b'])
    >>> loss_fn = lambda scale, y, t: jnp.mean((scale * y - t) ** 2)
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     stage_fn, loss_fn, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> params = {'w': np.full((4, 16, 16), 1 / 16, np.float32),
    ...           'b': np.zeros((4, 16), np.float32)}    # 4 stages
    >>> loss, grads = step(params, 2.0, np.ones((32, 16)), np.zeros((32, 16)))
    >>> grads.stages['w'].shape, grads.inputs.shape
    ((4, 16, 16), (32, 16))

    Dropout (a key), an auxiliary metric and bfloat16 compute:

    >>> def dropout_fn(p, x, key):
    ...   keep = jax.random.bernoulli(key, 0.9, x.shape)
    ...   return jnp.where(keep, stage_fn(p, x) / 0.9, 0)
    >>> def loss_and_mean(scale, y, t, key):
    ...   return loss_fn(scale, y, t), {'mean_y': jnp.mean(y).astype(float)}
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     dropout_fn, loss_and_mean, mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8), has_aux=True,
    ...     compute_dtype=jnp.bfloat16)
    >>> (loss, aux), grads = step(params, 2.0, np.ones((32, 16)),
    ...                           np.zeros((32, 16)), key=jax.random.key(0))
    >>> loss.dtype, sorted(aux), grads.stages['w'].dtype
    (dtype('float32'), ['mean_y'], dtype('float32'))
  """
  check_fn(stage_fn, 'stage_fn')
  check_fn(loss_fn, 'loss_fn')
  lowered = lowered_for(schedule, mesh, axis, training=True)
  bubble_fill = check_fill(bubble_fill)
  check_compute_dtype(compute_dtype)

  def local(params, loss_params, inputs, targets, key):
    out, grads = pipeline_step_local(
        stage_fn, loss_fn, jax.tree.map(lambda a: a[0], params), loss_params,
        inputs, targets, lowered=lowered, axis=axis, remat=remat,
        bubble_fill=bubble_fill, key=key, has_aux=has_aux,
        compute_dtype=compute_dtype)
    return out, grads._replace(
        stages=jax.tree.map(lambda a: a[None], grads.stages))

  by_stage = NamedSharding(mesh, P(axis))
  # Manual over every mesh axis (replicated over the others): XLA:CPU 0.10
  # aborts on a bfloat16 all-reduce in a partly manual shard_map.
  sharded = jax.shard_map(
      local, mesh=mesh, in_specs=(P(axis), P(), P(), P(), P()),
      out_specs=(P(), PipelineGrads(P(axis), P(), P())))

  @jax.jit
  def step(stage_params, loss_params, inputs, targets, key=None):
    check_leading(stage_params, schedule.num_stages, 'stage_params',
                  'schedule.num_stages')
    check_key(key)
    # Replicated on every device (a no-op unless the caller sharded them).
    loss_params, inputs, targets, key = jax.reshard(
        (loss_params, inputs, targets, key), NamedSharding(mesh, P()))
    out, grads = sharded(jax.reshard(stages_to_ranks(
        stage_params, schedule, out_sharding=by_stage), by_stage),
                         loss_params, inputs, targets, key)
    return out, grads._replace(stages=ranks_to_stages(
        grads.stages, schedule, out_sharding=by_stage))
  return step


@functools.partial(jax.jit, static_argnames=(
    'stage_fn', 'schedule', 'mesh', 'axis', 'bubble_fill'))
def _apply(stage_fn, stage_params, inputs, *, schedule, mesh, axis,
           bubble_fill):
  bubble_fill = float(bubble_fill)  # passed as a str: nan == nan for the cache
  lowered = lowered_for(schedule, mesh, axis, training=False)
  check_leading(stage_params, schedule.num_stages, 'stage_params',
                'schedule.num_stages')
  local = lambda params, x: pipeline_apply_local(
      stage_fn, jax.tree.map(lambda a: a[0], params), x, lowered=lowered,
      axis=axis, bubble_fill=bubble_fill)
  params = stages_to_ranks(stage_params, schedule,
                           out_sharding=NamedSharding(mesh, P(axis)))
  inputs = jax.reshard(inputs, NamedSharding(mesh, P()))
  return jax.shard_map(local, mesh=mesh, in_specs=(P(axis), P()),
                       out_specs=P(), axis_names={axis})(params, inputs)


def pipeline_apply(stage_fn: StageFn, stage_params: PyTree | None = None,
                   inputs: jax.Array | None = None, *, schedule: Schedule,
                   mesh: Mesh, axis: str = 'stage', bubble_fill: float = 0.0):
  """The pipelined forward pass (inference): all stages on every microbatch.

  Runs the ``F`` actions of ``schedule`` (any schedule; its backward actions
  are dropped) and computes ``stage_{S-1}(... stage_0(x))`` for the whole
  batch. Compiled once per ``(stage_fn, schedule, mesh, axis)`` and shapes.

  Args:
    stage_fn: ``stage_fn(one_stage_params, x) -> y``, ``y`` like ``x``.
    stage_params: pytree stacked ``[num_stages, ...]`` in model order; give it
      with ``inputs`` to run at once (the first call form).
    inputs: ``[batch, ...]`` with ``batch`` divisible by
      ``schedule.num_microbatches``.
    schedule: a ``Schedule`` whose ``num_ranks`` is ``mesh.shape[axis]``.
    mesh: the device mesh.
    axis: the pipeline axis name.
    bubble_fill: value of unwritten buffer slots and of what idle ranks send.

  Returns:
    Without ``stage_params`` and ``inputs``: ``apply(stage_params, inputs) ->
    [batch, ...]``, like every other step; with them, that result directly.
    Outputs are replicated over ``axis``.

  Example:
    >>> apply = jaxpar.pipeline.pipeline_apply(
    ...     lambda w, x: jnp.tanh(x @ w), mesh=jaxpar.make_mesh(stage=4, data=2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(4, 8))
    >>> apply(np.ones((4, 16, 16), np.float32), np.ones((32, 16), np.float32)).shape
    (32, 16)
  """
  check_fn(stage_fn, 'stage_fn')
  fill = str(check_fill(bubble_fill))  # a str: nan == nan for the jit cache
  lowered_for(schedule, mesh, axis, training=False)

  def apply(stage_params: PyTree, inputs: jax.Array) -> jax.Array:
    return _apply(stage_fn, stage_params, inputs, schedule=schedule,
                  mesh=mesh, axis=axis, bubble_fill=fill)
  if stage_params is None and inputs is None:
    return apply
  if stage_params is None or inputs is None:
    raise TypeError('pipeline_apply takes stage_params and inputs together '
                    '(to run now) or neither (to get apply(stage_params, '
                    'inputs)).')
  return apply(stage_params, inputs)


pipeline_step = pipeline_value_and_grad
