"""One rank's scan over the ticks of a lowered ``Schedule`` (the executor's core).

``run`` is one ``lax.scan`` over the ticks of ``jaxpar.pipeline.tick_table``'s
table, inside a ``jax.shard_map`` over the pipeline axis
(``docs/executor.md`` draws a tick); ``jaxpar.pipeline.executor`` wraps it
into the public steps. Per tick, every rank

1. reads its row of the tick table (action kind, stage, microbatch, slots);
2. reads the action's input: the batch for stage 0's ``F`` (with
   ``embed_fn``: the embedded raw microbatch), else a mailbox slot (the
   activation for ``F``, the output cotangent for ``I`` and ``W``);
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
   nonzero rank offset of the schedule that carries a message this tick
   (every rank takes part; which offsets do is in the table, the same on
   every rank); receivers store it in the mailbox slot the table names. The
   batch-sized result (stage 0's input cotangents; forward only: the last
   stage's outputs) is written into the output itself, ``p`` rows at a
   time: the row stage 0's ``I`` of microbatch ``i`` ends waits in one of
   ``p`` pending slots (the cotangent on stage 0's rank, zeros elsewhere);
   when ``p`` rows wait (or the last is done) one ``psum`` over the pipeline
   axis lands them in their rows on every rank (``edge_rows``). No
   batch-sized buffer is held besides the output (``grads.inputs`` costs
   ``2p`` rows of scratch), and the result costs ``ceil(m / p)`` collectives:
   one per row cost 1F1B 15% of its step on two pinned cores over gloo.
   With ``embed_fn`` stage 0's ``F`` embeds the raw microbatch and its ``W``
   adds the embedding's VJP (recomputing the embedding) to its gradient, and
   there is no batch-sized result at all.

**Dispatch: per tick, one zero-or-one-trip ``while_loop`` per block and one
``lax.switch`` over the messages.** The blocks are ``F``, the last stage's
``F`` (with the loss), ``I`` and ``W`` (with ``embed_fn`` also stage 0's
``F`` and ``W``: 6); ``blocks`` codes them per (tick, rank) from the table.
Each runs in a ``when`` (a while loop whose carries, the stash, weight
stash and gradient accumulators, XLA updates in place). The messages of a
tick -- which offsets send, whether a row of the result is summed -- are
one of a few patterns, the same on every rank (``messages``): one
``lax.switch`` on the pattern runs its ``ppermute``s and ``psum``; its
operands are read and its results are one activation each, so it copies
nothing else. A local hand-off (the loss cotangent) and the write of a
result row are selects, no branch. On XLA:GPU each of these 5 (7 with
``embed_fn``) ops reads its predicate back to the host; it was ``6 + K``
(9 for 1F1B on 4 ranks). Fewer would need the blocks in one
``lax.switch``, which copies every buffer a branch passes through unchanged
on every tick (XLA 0.10: a scan of 64 ticks over a 384x384 accumulator and
8 activation slots holds 4.2x the temp memory and takes 1.5-1.8x the CPU
time of the same scan with whiles), or branches with small outputs and the
accumulators updated outside, which costs a parameter-sized read and write
on every tick. One stage rank (``num_ranks == 1``) runs no ticks: the
microbatches run in turn (``sequential``), as data parallelism runs them.

Buffer updates are selects or writes to a spare slot, never masks multiplied
in, so whatever a bubble produces (``bubble_fill``, NaN in the tests) never
reaches the results. Memory is the schedule's: ``num_stash_slots`` stashes,
``num_weight_slots`` weight stashes and ``num_mailbox_slots + 1`` activations
per rank (``O(p)`` for 1F1B whatever the number of microbatches ``m``), plus
the parameters, their gradients, the batch and the output.

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

from jaxpar.pipeline.executor._vma import full, like, vary, vma
from jaxpar.pipeline.executor._checks import with_key
from jaxpar.pipeline.schedules import KIND_CODES, TickTable
from jaxpar.pipeline.executor._stage_vjp import StageVJP, stash_policy

PyTree = Any
F, I, W = (KIND_CODES[k] for k in 'FIW')   # the tick table's kind codes
StageFn = Callable[..., jax.Array]
LossFn = Callable[..., Any]


def blocks(lowered: TickTable, *, loss: bool, embed: bool
           ) -> tuple[np.ndarray, tuple[tuple[int, bool, bool], ...]]:
  """The block each rank runs at each tick, as a code into a list of kinds.

  A block is ``(kind, first, last)``: ``first`` is stage 0 with an
  ``embed_fn`` (its ``F`` embeds the raw microbatch, its ``W`` adds the
  embedding's gradient), ``last`` the last stage's ``F`` with the loss.

  Returns:
    ``(code, kinds)``: int32 ``[T, p]`` (``-1`` idle) and the blocks present,
    ``kinds[code]``, in a fixed order.
  """
  kind, stage = lowered.kind, lowered.stage
  first = embed & (stage == 0) & ((kind == F) | (kind == W))
  last = loss & (stage == lowered.schedule.num_stages - 1) & (kind == F)
  keys = np.stack([kind, first, last], -1)
  present = sorted({tuple(int(v) for v in k) for k in keys.reshape(-1, 3)
                    if k[0]})
  code = np.full(kind.shape, -1, np.int32)
  for c, k in enumerate(present):
    code[(keys == k).all(-1)] = c
  return code, tuple((k, bool(f), bool(l)) for k, f, l in present)


def messages(lowered: TickTable, edge: bool
             ) -> tuple[np.ndarray, tuple[tuple[bool, ...], ...]]:
  """What is communicated at each tick, the same on every rank.

  A pattern is one flag per nonzero offset (a ``ppermute`` over it) plus,
  with ``edge``, one for the ``psum`` of the pending rows of the batch-sized
  result (``edge_rows``).

  Returns:
    ``(code, patterns)``: int32 ``[T]`` and the distinct patterns.
  """
  remote = [k for k, o in enumerate(lowered.offsets) if o]
  flags = (lowered.recv_slot[:, :, remote] >= 0).any(1)
  if edge:
    summed = (edge_rows(lowered)[1] < lowered.schedule.num_microbatches
              ).any(1)
    flags = np.concatenate([flags, summed[:, None]], 1)
  patterns = sorted({tuple(bool(f) for f in row) for row in flags})
  code = np.array([patterns.index(tuple(bool(f) for f in row))
                   for row in flags], np.int32)
  return code, tuple(patterns)


def edge_rows(lowered: TickTable) -> tuple[np.ndarray, np.ndarray]:
  """When each row of the batch-sized result is done, and when it is summed.

  A row (stage 0's input cotangent of a microbatch when training, else the
  last stage's output) is done on one rank; it waits in one of
  ``K = num_ranks`` pending slots until ``K`` rows are done (or the last
  one is), then one ``psum`` over the pipeline axis brings them to every
  rank: ``ceil(m / K)`` collectives of ``K`` rows, not ``m`` of one.

  Returns:
    ``(slot, rows)``: int32 ``[T]``, the pending slot the row done at tick
    ``t`` is written to (``K``: none, a write that is dropped); int32
    ``[T, K]``, the result row each slot holds when tick ``t`` sums them
    (``m``: none).
  """
  train = lowered.training
  kind, stage = (I, 0) if train else (F, lowered.schedule.num_stages - 1)
  at = (lowered.kind == kind) & (lowered.stage == stage)
  done = np.where(at.any(1), np.where(at, lowered.microbatch, -1).max(1), -1)
  k, m = lowered.schedule.num_ranks, lowered.schedule.num_microbatches
  slot = np.full(done.shape, k, np.int32)
  rows = np.full(done.shape + (k,), m, np.int32)
  ticks = np.flatnonzero(done >= 0)
  for n, t in enumerate(ticks):
    slot[t] = n % k
    if n % k == k - 1 or n == len(ticks) - 1:
      group = ticks[n - n % k:n + 1]
      rows[t, :len(group)] = done[group]
  return slot, rows


def run(stage_fn: StageFn, loss_fn: LossFn | None, lowered: TickTable,
        local_params: PyTree, loss_params: PyTree, inputs: PyTree,
        targets: PyTree, *, axis: str, remat: bool, bubble_fill: float,
        key: jax.Array | None = None, offset: Any = 0,
        has_aux: bool = False, embed_fn: Callable[..., jax.Array] | None = None,
        embed_params: PyTree = None, embed_key: jax.Array | None = None,
        remat_policy: Any = None):
  """The scan over ticks on one rank (inside ``shard_map``); see module doc.

  Args are one rank's view: ``local_params`` ``[v, ...]``, ``inputs``
  ``[m, mb, ...]`` (raw, for ``embed_fn``, when it is given), ``targets``
  leaves ``[m, mb, ...]``; ``key`` the step's key, ``offset`` the global index
  of this shard's first microbatch; ``embed_fn(embed_params, inputs[i])``
  (``+ (fold_in(embed_key, offset + i),)`` with an ``embed_key``) gives stage
  0's input.

  Returns:
    Training (``loss_fn`` given): ``((loss, aux), dlocal_params,
    dloss_params, dinputs, dembed_params)``, the loss (``aux``: ``()``
    without ``has_aux``) and gradients of the mean over the ``m``
    microbatches; ``dinputs`` ``[m, mb, ...]`` is ``None`` with an
    ``embed_fn`` and ``dembed_params`` ``None`` without. Forward-only: the
    last stage's outputs ``[m, mb, ...]``. Everything but ``dlocal_params``
    is reduced over ``axis``.
  """
  schedule = lowered.schedule
  p, m = schedule.num_ranks, schedule.num_microbatches
  if p == 1:
    return sequential(
        stage_fn, loss_fn, schedule, local_params, loss_params, inputs,
        targets, axis=axis, remat=remat, key=key, offset=offset,
        has_aux=has_aux, embed_fn=embed_fn, embed_params=embed_params,
        embed_key=embed_key, remat_policy=remat_policy)
  last = schedule.num_stages - 1
  train = loss_fn is not None
  embedding = embed_fn is not None
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
  embed_params = vary(embed_params, base)
  one_params = jax.tree.map(lambda a: a[0], local_params)

  def key_of(stg, mb):
    """The key of (logical stage ``stg``, microbatch ``mb``); the loss of
    microbatch ``mb`` has ``stg = num_stages``. A function of the global
    microbatch index, so of the batch rows, not of the schedule or mesh."""
    if key is None:
      return None
    return jax.random.fold_in(jax.random.fold_in(key, offset + mb), stg)

  def embedded(ep, mb):
    """Stage 0's input for microbatch ``mb``: ``embed_fn`` of its raw rows."""
    raw = jax.tree.map(lambda a: a[mb], inputs)
    k = None if embed_key is None else jax.random.fold_in(embed_key,
                                                          offset + mb)
    return embed_fn(ep, raw, *with_key(k))

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
  x0 = (jax.eval_shape(embedded, embed_params, rank * 0) if embedding
        else jax.typeof(inputs[0]))
  act_vma = base | vma(x0)
  while True:
    x = vary(jnp.zeros(x0.shape, x0.dtype), act_vma)
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

  def add(acc, d):
    return jax.tree.map(lambda a, d: a + like(d, a), acc, d)

  # One block per (kind, first, last); each runs in a ``when`` and updates
  # the tick state in place: ``(payload, grads, (loss, aux), dloss_params,
  # dembed_params)`` and its own buffer (``F`` the stash, ``I`` the weight
  # stash). ``at`` is the tick's (local stage j, logical stage, microbatch).
  def forward(first, last_stage):
    def block(carry, at, slot, x, target):
      state, stash = carry
      j, stg, mb = at
      if first:
        x = like(embedded(embed_params, mb).astype(act_aval.dtype), act_aval)
      if not train:
        return (like(stage_fn(params_of(j), x), act_aval),), stash
      y, new = stage.forward(params_of(j), x, key_of(stg, mb))
      stash = put(stash, slot, new)
      if not last_stage:
        return (like(y, act_aval), *state[1:]), stash
      payload, grads, out, dlp, de = state
      o, (dl, dy) = seed(loss_params, y, target, key_of(last + 1, mb))
      return (like(dy, act_aval), grads, add(out, o), add(dlp, dl), de), stash
    return block

  def input_grad(carry, at, slot, wslot, dy):
    (_, *rest), stash, wstash = carry
    j, stg, mb = at
    st = jax.tree.map(lambda b: b[slot], stash)
    dx, kept = stage.input_grad(params_of(j), st, dy, key_of(stg, mb))
    dx = like(dx, act_aval)
    return (dx, *rest), stash, put(wstash, wslot, (kept, dx))

  def weight_grad(first):
    def block(carry, at, slot, wslot, dy):
      (_, grads, out, dlp, de), stash, wstash = carry
      j, stg, mb = at
      st = jax.tree.map(lambda b: b[slot], stash)
      kept, dx = jax.tree.map(lambda b: b[wslot], wstash)
      dp = stage.weight_grad(params_of(j), st, dy, kept, key_of(stg, mb))
      grads = jax.tree.map(lambda g, d: g.at[j].add(like(d, g[j])), grads, dp)
      if first:
        _, vjp = jax.vjp(lambda ep: embedded(ep, mb), embed_params)
        de = add(de, vjp(dx.astype(x0.dtype))[0])
      return (dx, grads, out, dlp, de), stash, wstash
    return block

  codes, kinds = blocks(lowered, loss=train, embed=embedding)
  with_edge = not embedding
  comm, patterns = messages(lowered, with_edge)
  pend_slot, sum_rows = edge_rows(lowered)
  remote = [k for k, o in enumerate(lowered.offsets) if o]
  local = [k for k, o in enumerate(lowered.offsets) if not o]

  def exchange(pattern, payload, pending):
    """The pattern's ppermutes (a fill where it sends nothing) and psum."""
    msgs = [like(jax.lax.ppermute(payload, axis, [
        (r, (r + lowered.offsets[k]) % p) for r in range(p)]), act_aval)
            if send else full(act_aval, bubble_fill)
            for k, send in zip(remote, pattern)]
    if with_edge:
      msgs.append(jax.lax.psum(pending, axis) if pattern[-1] else
                  vary(jnp.zeros(pending.shape, pending.dtype),
                       act_vma - {axis}))
    return msgs

  def tick(carry, row):
    mailbox, stash, wstash, state, edge = carry
    row, pattern, pend, rows_summed = row
    kind, code, stg, mb, j, read, slot, wslot, recv = (a[rank] for a in row)
    mb, j = jnp.maximum(mb, 0), jnp.maximum(j, 0)
    slot, wslot = jnp.maximum(slot, 0), jnp.maximum(wslot, 0)
    at = (j, stg, mb)
    x = mailbox[jnp.maximum(read, 0)]
    if not embedding:
      x = jnp.where(read >= 0, x, inputs[mb])
    target = jax.tree.map(lambda t: t[mb], targets)
    state = (full(act_aval, bubble_fill), *state)
    for c, (block_kind, first, last_stage) in enumerate(kinds):
      if block_kind == F:
        state, stash = when(code == c, lambda s, b=forward(
            first, last_stage): b(s, at, slot, x, target), (state, stash))
      else:
        block = input_grad if block_kind == I else weight_grad(first)
        state, stash, wstash = when(code == c, lambda s, b=block: b(
            s, at, slot, wslot, x), (state, stash, wstash))
    payload, *state = state
    for k in local:  # a local hand-off (the loss cotangent): no message
      mailbox = put(mailbox, jnp.where(recv[k] >= 0, recv[k], spare), payload)
    pending = None
    if with_edge:  # this rank's share of the row done this tick, if any
      pending, result = edge
      mine = (kind == (I if train else F)) & (stg == (0 if train else last))
      k = jnp.minimum(pend, p - 1)
      pending = put(pending, k, jnp.where(
          pend < p, jnp.where(mine, payload, jnp.zeros_like(payload)),
          pending[k]))
    if len(patterns) == 1:
      got = exchange(patterns[0], payload, pending)
    else:
      got = jax.lax.switch(pattern, [
          lambda a, b, pat=pat: exchange(pat, a, b) for pat in patterns],
                           payload, pending)
    for k, msg in zip(remote, got):
      mailbox = put(mailbox, jnp.where(recv[k] >= 0, recv[k], spare), msg)
    if with_edge:  # the rows summed this tick into the result, if any: one
      for k in range(p):  # in-place row write each (a select keeps the row)
        i = jnp.minimum(rows_summed[k], m - 1)
        result = put(result, i, jnp.where(rows_summed[k] < m, got[-1][k],
                                          result[i]))
      edge = pending, result
    return (mailbox, stash, wstash, tuple(state), edge), None

  stash = wstash = None
  state = ()
  if train:
    state = (full(dp_aval, 0, v), full(out_aval, 0), full(dlp_aval, 0),
             vary(full(jax.eval_shape(lambda: embed_params), 0), act_vma))
    stash = full(stash_aval, bubble_fill, lowered.num_stash_slots)
    wstash = full((kept_aval, act_aval), bubble_fill,
                  max(lowered.num_weight_slots, 1))
  spare = lowered.num_mailbox_slots
  mailbox = full(act_aval, bubble_fill, spare + 1)
  edge = None
  if with_edge:  # K = num_ranks pending rows, the result
    edge = (full(act_aval, 0, p), vary(jnp.zeros(
        (m,) + act_aval.shape, act_aval.dtype), act_vma - {axis}))
  rows = (lowered.kind, codes, lowered.stage, lowered.microbatch,
          lowered.local_stage, lowered.read_slot, lowered.stash_slot, lowered.weight_slot,
          lowered.recv_slot)
  (_, _, _, state, edge), _ = jax.lax.scan(
      tick, (mailbox, stash, wstash, state, edge),
      (rows, comm, pend_slot, sum_rows))
  if with_edge:
    edge = edge[1]
  if not train:
    return edge
  grads, out, dlp, de = state
  out, dlp, de = jax.lax.psum((out, dlp, de), axis)  # one collective
  return out, grads, dlp, edge, (de if embedding else None)


def sequential(stage_fn: StageFn, loss_fn: LossFn | None, schedule: Any,
               local_params: PyTree, loss_params: PyTree, inputs: PyTree,
               targets: PyTree, *, axis: str, remat: bool,
               key: jax.Array | None, offset: Any, has_aux: bool,
               embed_fn: Callable[..., jax.Array] | None, embed_params: PyTree,
               embed_key: jax.Array | None, remat_policy: Any = None):
  """``run`` on one rank: the microbatches in turn, no ticks.

  A ``lax.scan`` over the ``m`` microbatches of ``jax.value_and_grad`` of
  the whole model (embedding, the ``num_stages`` stages in order, the loss),
  accumulating as data parallelism's microbatches do; the same keys, results
  and return values as ``run``. Plain autodiff (XLA fuses the backward)
  unless ``remat`` or a ``remat_policy`` is asked for: each stage is then a
  ``jax.checkpoint`` with that policy.
  """
  m, num_stages = schedule.num_microbatches, schedule.num_stages
  train = loss_fn is not None
  base = vma(inputs) | {axis}
  local_params, loss_params, embed_params = vary(
      (local_params, loss_params, embed_params), base)
  layer = stage_fn
  if train and (remat or remat_policy is not None):
    layer = jax.checkpoint(stage_fn, policy=stash_policy(remat, remat_policy))

  def model(params, lp, ep, x, target, mb):
    """The microbatch's share of the mean loss (and aux), or its output."""
    g = offset + mb
    if embed_fn is not None:
      k = None if embed_key is None else jax.random.fold_in(embed_key, g)
      x = embed_fn(ep, x, *with_key(k))
    keys = None if key is None else jax.random.fold_in(key, g)
    key_of = lambda k: () if key is None else (jax.random.fold_in(keys, k),)
    for j in range(num_stages):
      x = layer(jax.tree.map(lambda a, j=j: a[j], params), x, *key_of(j))
    if not train:
      return x
    out = loss_fn(lp, x, target, *key_of(num_stages))
    loss, aux = out if has_aux else (out, ())
    return jax.tree.map(lambda a: a.astype(jnp.promote_types(
        a.dtype, jnp.float32)) / m, (loss, aux))

  mbs = jnp.arange(m)
  if not train:
    return jax.lax.psum(jax.lax.map(
        lambda a: model(local_params, None, embed_params, *a),
        (inputs, targets, mbs)), axis)
  argnums = (0, 1, 2) if embed_fn is not None else (0, 1, 2, 3)
  grad = jax.value_and_grad(model, argnums, has_aux=True)

  def body(acc, a):
    x, target, mb = a
    out, grads = grad(local_params, loss_params, embed_params, x, target, mb)
    dx = grads[3] if embed_fn is None else None
    acc = jax.tree.map(lambda s, d: s + vary(d, vma(s)), acc, (out, grads[:3]))
    return acc, dx

  first = jax.tree.map(lambda a: a[0], (inputs, targets))
  zero = jax.tree.map(
      lambda a: vary(jnp.zeros(a.shape, a.dtype), base | vma(a)),
      jax.eval_shape(lambda: jax.tree.map(lambda a: a, grad(
          local_params, loss_params, embed_params, *first, mbs[0]))))
  zero = (zero[0], zero[1][:3])
  (out, (grads, dlp, de)), dx = jax.lax.scan(body, zero, (inputs, targets,
                                                          mbs))
  out, dlp, de, dx = jax.lax.psum((out, dlp, de, dx), axis)
  return out, grads, dlp, dx, (de if embed_fn is not None else None)


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
