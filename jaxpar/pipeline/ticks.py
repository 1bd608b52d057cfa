"""One rank's scan over the ticks of a lowered ``Schedule`` (the executor's core).

``run`` is one ``lax.scan`` over the ticks of ``jaxpar.pipeline.lower``'s
table, inside a ``jax.shard_map`` over the pipeline axis
(``docs/executor.md`` draws a tick); ``jaxpar.pipeline.executor`` wraps it
into the public steps. Per tick, every rank

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
``while_loop`` per kind (``when``) rather than a ``lax.switch``: XLA updates
loop carries in place, while a ``switch`` copies every buffer a branch passes
through unchanged (gradient accumulators, stashes) on every tick. Each
``when`` tests one predicate. On XLA:GPU a predicate of a ``while`` is read
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

**Randomness.** With a key, stage ``k`` on microbatch ``i`` runs with
``fold_in(fold_in(key, offset + i), k)`` in its ``F``, ``I`` and ``W`` (and a
remat recompute), the loss with ``k = num_stages``: ``StageVJP`` treats the
key like the parameters, so a dropout mask is recomputed from it in the
backward, never stashed, and is the forward's mask.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.pipeline._vma import full, like, vary, vma
from jaxpar.pipeline.checks import with_key
from jaxpar.pipeline.lower import F, I, W, LoweredSchedule
from jaxpar.pipeline.stage import StageVJP

PyTree = Any
StageFn = Callable[..., jax.Array]
LossFn = Callable[..., Any]
_F_LAST = 5  # block code: forward of the last stage, with the loss


def run(stage_fn: StageFn, loss_fn: LossFn | None, lowered: LoweredSchedule,
         local_params: PyTree, loss_params: PyTree, inputs: jax.Array,
         targets: PyTree, *, axis: str, remat: bool, bubble_fill: float,
         key: jax.Array | None = None, offset: Any = 0,
         has_aux: bool = False, remat_policy: Any = None):
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
  stage = StageVJP(stage_fn, remat or not train,
                   remat_policy if train else None)
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

  # One block per action kind; each runs in a ``when`` and updates the tick
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
      state, stash = when(branch == code, lambda c, block=block: block(
          *c, at, slot, x, target), (state, stash))
    if readers:
      def read(carry):
        st = jax.tree.map(lambda b: b[slot], stash)
        for code, block in readers.items():
          carry = when(branch == code, lambda c, block=block: block(
              c, st, at, wslot, x), carry)
        return carry
      state, wstash = when(jnp.isin(branch, np.array(list(readers))), read,
                            (state, wstash))
    payload = state[0]
    if train:
      _, grads, out, dlp = state
    edge = when((kind == edge_kind) & (stg == edge_stage),
                 lambda e: put(e, mb, payload), edge)
    for k, offset in enumerate(lowered.offsets):
      def deliver(mailbox, k=k, offset=offset):
        msg = payload if offset == 0 else jax.lax.ppermute(
            payload, axis, [(r, (r + offset) % p) for r in range(p)])
        # No message for this rank: the spare last slot, which nothing reads.
        return put(mailbox, jnp.where(recv[k] >= 0, recv[k], spare), msg)
      mailbox = when(send[k], deliver, mailbox)
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


def when(pred: jax.Array, fn: Callable[[PyTree], PyTree],
          state: PyTree) -> PyTree:
  """``fn(state)`` if ``pred`` else ``state``, updating buffers in place.

  A ``while_loop`` of zero or one trip. XLA keeps while-loop carries in
  place, whereas a ``lax.cond``/``lax.switch`` copies every buffer that a
  branch passes through unchanged: with a branch per action kind that would
  copy the gradient accumulators and stash on every tick.
  """
  return jax.lax.while_loop(
      lambda c: c[0], lambda c: (c[0] & False, fn(c[1])), (pred, state))[1]
