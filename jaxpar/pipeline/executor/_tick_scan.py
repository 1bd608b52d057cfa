"""One rank's scan over the ticks of a ``TickTable`` (the executor's core).

``run`` is one ``lax.scan`` over the ticks of ``jaxpar.pipeline.tick_table``'s
table, inside a ``jax.shard_map`` over the pipeline axis
(``docs/executor.md`` draws a tick); ``jaxpar.pipeline.executor`` wraps it
into the public steps. ``run`` reads as the recipe: the rank's view of the
step (``Rank``), the types of what the blocks produce (``_avals``), the
blocks and message patterns the table holds (``_scan_config``), the
buffers (``_init_carry``), the scan of ``_tick``, the sums (``_result``);
the calls of the user's functions are in ``_tick_maths``.
The scan's carry is a ``Carry`` (mailbox, stash, weight stash,
``Accumulators``, the pending and result rows as an ``Edge``, the
``ModelState``); its ``xs`` are ``TickRow``s, each rank's part a ``TickCell``; a
block reads and updates a ``BlockState``. An activation (so a mailbox
slot, a message, a row of the result) may be any pytree: values a stage
only passes on (an encoder output, a mask) ride with it, and integer
leaves get zero cotangents (``_vma.cotangent``). Per tick (``_tick``),
every rank

1. reads its row of the tick table (block kind, stage, microbatch, slots);
2. reads the block's input: the batch for stage 0's ``F`` (with an
   embedding: the embedded raw microbatch), else a mailbox slot (the
   activation for ``F``, the output cotangent for ``B``, ``I`` and ``W``);
3. runs its block and no other (``StageVJP``):

   * ``F``: ``stage_fn`` forward, writing the activations its backward needs
     (never the parameters or values computed from them alone) to its stash
     slot in place; on the last stage also ``loss_fn`` and the loss
     cotangent. A stateful stage (``stage_state``) reads its state and
     writes the new one in its place, so each microbatch's ``F`` sees the
     state the previous one left (what depends on it is stashed); so do
     stage 0's embedding and the last stage's loss with theirs (stage 0
     also stashes the embedding's state for its recompute in ``B``/``I``);
   * ``B``: a schedule's backward as one VJP (``StageVJP.backward``): the
     parameter cotangent added to the gradient accumulator in place, the
     input cotangent sent; it keeps nothing;
   * ``I``: the input cotangent (sent), keeping what ``W`` needs (the
     cotangents at the parameter-consuming operations) in a weight-stash
     slot;
   * ``W``: the parameter cotangent from what ``I`` kept, added to the
     gradient accumulator in place; it sends nothing. ``I`` and ``W``
     together do the FLOPs of one backward. The table runs a schedule's
     ``B`` as a ``B`` block, or as an ``I`` and a later ``W`` where that
     packs its ticks better (``tick_table``); its ``I`` and ``W`` actions
     stay ``I`` and ``W``.

   An idle rank computes nothing;
4. sends the block's output at the end of the tick with one ``ppermute``
   per distinct nonzero rank offset of the schedule that carries a message
   this tick (every rank takes part; which offsets do is in the table, the
   same on every rank); receivers store it in the mailbox slot the table
   names. Where the table holds a message back (``TickTable.hold_slot``)
   the rank keeps it in a hold slot (``Carry.held``) instead, and its next
   message over that offset takes it along: one ``ppermute`` of the output
   stacked on the hold slots, each stored where ``recv_held`` says. The batch-sized result (stage 0's input cotangents; forward only:
   the last stage's outputs) is written into the output itself, ``p`` rows
   at a time: the row stage 0's ``B`` or ``I`` of microbatch ``i`` ends
   waits in one of ``p`` pending slots (the cotangent on stage 0's rank,
   zeros elsewhere); when ``p`` rows wait (or the last is done) one
   ``psum`` over the pipeline axis lands them in their rows on every rank
   (``edge_rows``). No batch-sized buffer is held besides the output
   (``grads.inputs`` costs ``2p`` rows of scratch), and the result costs
   ``ceil(m / p)`` collectives (one per row costs 1F1B 15% of its step on
   two pinned cores over gloo). With an embedding stage 0's ``F`` embeds
   the raw microbatch and its ``B`` or ``I`` adds the embedding's VJP of
   the input cotangent (recomputing the embedding) to its gradient, and
   there is no batch-sized result at all.

**Dispatch: per tick, one zero-or-one-trip ``while_loop`` per block and one
``lax.switch`` over the messages.** A block is a kind with its stage's
part: ``F``, the last stage's ``F`` (with the loss), ``B``, ``I``, ``W``,
and with an embedding stage 0's ``F``, ``B`` and ``I``; ``blocks`` codes
the ones the table holds per (tick, rank) (1F1B: ``F``, the last ``F``,
``I``, ``W``; GPipe: ``F``, the last ``F``, ``B``). Each runs in a
``when`` (a while loop whose carries, the stash, weight stash and gradient
accumulators, XLA updates in place; ``F`` and ``B`` do not carry the
weight stash). The messages of a tick -- which offsets send, whether a row
of the result is summed -- are one of a few patterns, the same on every
rank (``messages``): one ``lax.switch`` on the pattern runs its
``ppermute``s and ``psum``; its operands are read and its results are one
activation each, so it copies nothing else. A local hand-off (the loss
cotangent) and the write of a result row are selects, no branch. On
XLA:GPU each of these ops (one per block present, plus the switch) reads
its predicate back to the host. Fewer would need the blocks in one
``lax.switch``, which copies every buffer a branch passes through unchanged
on every tick (XLA 0.10: a scan of 64 ticks over a 384x384 accumulator and
8 activation slots holds 4.2x the temp memory and takes 1.5-1.8x the CPU
time of the same scan with whiles), or branches with small outputs and the
accumulators updated outside, which costs a parameter-sized read and write
on every tick. One pipeline rank (``num_ranks == 1``) runs no ticks: the
microbatches run in turn (``sequential``), as data parallelism runs them.

Buffer updates are selects or writes to a spare slot, never masks multiplied
in, so whatever a bubble produces (``bubble_fill``, NaN in the tests) never
reaches the results. Memory is the schedule's: ``num_stash_slots`` stashes,
``num_weight_slots`` weight stashes (none is allocated when the table has
no ``I``: a ``B`` keeps nothing) and ``num_mailbox_slots + 1`` activations
per rank (``O(p)`` for 1F1B whatever the number of microbatches ``m``; a
table that holds messages, ``num_hold_slots + 1`` more), plus the
parameters, their gradients, the batch and the output.

**Randomness.** With a key, stage ``k`` on microbatch ``i`` runs with
``fold_in(fold_in(key, microbatch_offset + i), k)`` in its ``F``, ``B``,
``I`` and ``W`` (and a remat recompute), the loss with ``k = num_stages``:
``StageVJP`` treats the key like the parameters, so a dropout mask is
recomputed from it in the backward, never stashed, and is the forward's
mask.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.executor._microbatches import (
    LossFn, StageFn, row, rows)
from jaxpar.pipeline.executor._options import Embedding, StepOptions
from jaxpar.pipeline.executor._sequential import sequential
from jaxpar.pipeline.executor._stage_vjp import StageVJP
from jaxpar.pipeline.executor._stamps import stamp
from jaxpar.pipeline.executor._tick_maths import (
    add, cast, embed_params, embedded, key_of, new_state, owner, params_of,
    seed, written, zeros_like)
from jaxpar.pipeline.executor._tick_rows import (
    B, F, I, W, blocks, edge_rows, messages)
from jaxpar.pipeline.executor._tick_state import (
    Accumulators, Avals, BlockState, Carry, Edge, ModelState, Rank, Result,
    ScanConfig, TickCell, TickRow)
from jaxpar.pipeline.executor._tick_messages import (
    deliver, deliver_held, exchange, hold, offsets, pend, write_rows)
from jaxpar.pipeline.executor._vma import cotangent, full, like, put, stored
from jaxpar.pipeline.schedules import TickTable
from jaxpar.vma import vary, varying_axes

PyTree = Any


# ------------------------------------------------------------ the scan


def run(stage_fn: StageFn, loss_fn: LossFn | None, table: TickTable,
        local_params: PyTree, loss_params: PyTree, inputs: PyTree,
        targets: PyTree, *, options: StepOptions,
        embedding: Embedding | None = None,
        stage_state: PyTree = None, head_state: PyTree = None
        ) -> Result | PyTree:
  """The scan over ticks on one rank (inside ``shard_map``); see module doc.

  Args are one rank's view: ``local_params`` ``[v, ...]``, ``inputs``
  ``[m, mb, ...]`` (raw rows with an ``embedding``, whose ``fn`` gives
  stage 0's input), ``targets`` leaves ``[m, mb, ...]``; ``options`` the
  step's checked ``StepOptions`` (its key, ``microbatch_offset``, ...).
  ``stage_state`` (training only) is ``[v, ...]`` like ``local_params``:
  the stages' state, passed from each ``F`` of a stage to its next (in
  microbatch order, ``check_state_order``); ``embedding.state`` and
  ``head_state`` the embedding's and the loss's, passed so by stage 0's
  and the last stage's ``F`` (a ``ModelState`` in the carry).

  Returns:
    Training (``loss_fn`` given): a ``Result``: the loss (and aux) and the
    gradients of the mean over the ``m`` microbatches. Forward-only: the
    last stage's outputs ``[m, mb, ...]``. Everything but
    ``Result.stages`` and ``Result.state`` is reduced over the stage axis.
  """
  schedule = table.schedule
  if schedule.num_ranks == 1:
    return sequential(stage_fn, loss_fn, schedule, local_params, loss_params,
                      inputs, targets, options=options, embedding=embedding,
                      stage_state=stage_state, head_state=head_state)
  check_command_buffers(os.environ.get('XLA_FLAGS', ''),
                        jax.default_backend())
  training = loss_fn is not None
  axis = options.stage_axis
  # Every value the blocks touch varies over the pipeline axis and over
  # what the batch varies over (e.g. 'data'): no gradient is then psum-ed
  # implicitly inside a block that only some ranks run.
  base = varying_axes(inputs) | {axis}
  rank = Rank(
      index=jax.lax.axis_index(axis),
      # Forward-only: nothing is differentiated, so nothing is stashed.
      stage=StageVJP(stage_fn,
                     options.remat_policy if training else 'nothing',
                     w_recompute=options.w_recompute),
      loss_fn=loss_fn,
      embedding=None if embedding is None else embedding._replace(
          params=vary(embedding.params, base), state=None),
      local_params=vary(local_params, base),
      loss_params=vary(loss_params, base), inputs=inputs, targets=targets,
      options=options, num_microbatches=schedule.num_microbatches,
      num_stages=schedule.num_stages, state=vary(ModelState(
          stage_state, None if embedding is None else embedding.state,
          head_state), base))
  config, rows = _scan_config(table, options, training,
                              embedding=embedding is not None)
  avals = _avals(rank, axis, split=config.split)
  carry, _ = jax.lax.scan(functools.partial(_tick, rank, avals, config),
                          _init_carry(rank, avals, config), rows)
  return _result(config, carry)


def _scan_config(table: TickTable, options: StepOptions, training: bool, *,
                 embedding: bool) -> tuple[ScanConfig, TickRow]:
  """The blocks and message patterns present, and the scan's rows."""
  codes, kinds = blocks(table, loss=training, embed=embedding)
  config = ScanConfig(table, kinds, (), options.stage_axis,
                      options.bubble_fill, training, embedding,
                      options.input_grads)
  message, patterns = messages(table, config.with_edge)
  pending_slot, summed_rows = edge_rows(table)
  ranks = TickCell(table.kind, codes, table.stage, table.microbatch,
                   table.local_stage, table.read_slot, table.stash_slot,
                   table.weight_slot, table.recv_slot)
  if config.holds:
    ranks = ranks._replace(hold_slot=table.hold_slot,
                           recv_held=table.recv_held)
  return (config._replace(patterns=patterns),
          TickRow(ranks, message, pending_slot, summed_rows))


def _avals(rank: Rank, axis: str, *, split: bool) -> Avals:
  """Types of everything the blocks produce; with ``split`` (the table has
  ``I`` and ``W`` blocks) also cuts the stage's backward into them
  (``StageVJP.split``).

  The activations' varying axes are a fixed point of x -> y (-> loss
  cotangent -> dx) -> x. The key is built as in a tick (its microbatch
  comes from the rank's table row).
  """
  training = rank.loss_fn is not None
  one_params = params_of(rank, 0)
  one_state = rank.state._replace(stages=row(rank.state.stages, 0))
  k0 = key_of(rank, rank.index * 0, rank.index * 0)
  target = jax.tree.map(lambda t: t[0], rank.targets)
  x0 = (jax.eval_shape(
      lambda ep, mb: embedded(rank, ep, mb, one_state.embed)[0],
      embed_params(rank), rank.index * 0)
        if rank.embedding is not None else
        jax.tree.map(lambda a: jax.typeof(a[0]), rank.inputs))
  act_vma = varying_axes(rank.inputs) | {axis} | varying_axes(x0)
  while True:
    x = vary(full(x0, 0), act_vma)
    state = vary(one_state, act_vma)   # varies as the activations do
    y_aval, stash = rank.stage.trace(one_params, x, k0, state=state.stages)
    new = act_vma | varying_axes(y_aval) | varying_axes(
        new_state(rank, one_params, x, k0, state, target))
    if training:
      y = vary(zeros_like(x), varying_axes(y_aval))
      value, (dhead, dy_aval), _ = jax.eval_shape(
          lambda lp, y, t, k, s: seed(rank, lp, y, t, k, s),
          rank.loss_params, y, target, k0, state.head)
      dy = vary(zeros_like(x), new | varying_axes(dy_aval))
      dstage, dx_aval = jax.eval_shape(
          functools.partial(rank.stage.backward, state=state.stages),
          one_params, full(stash, 0), dy, k0)
      new |= varying_axes(dy_aval) | varying_axes(dx_aval)
    if new == act_vma:
      break
    act_vma = new
  act = jax.tree.map(jax.typeof, x)
  if not training:
    return Avals(act, act_vma, stash)
  kept = (rank.stage.split(one_params, full(stash, 0), dy, k0,
                           state=state.stages)
          if split else None)
  return Avals(act, act_vma, stash, kept, dstage, value, dhead)


def _init_carry(rank: Rank, avals: Avals, config: ScanConfig) -> Carry:
  """The buffers before the first tick: ``bubble_fill`` in every slot,
  zeros in the accumulators, the pending rows and the result."""
  table, fill = config.table, config.bubble_fill
  p, m = table.schedule.num_ranks, table.schedule.num_microbatches
  acc = stash = wstash = edge = None
  if config.training:
    acc = Accumulators(
        full(avals.dstage, 0, table.schedule.num_stages // p),
        full(avals.value, 0), full(avals.dhead, 0),
        vary(full(jax.eval_shape(lambda: embed_params(rank)), 0),
             avals.act_vma))
    stash = full(avals.stash, fill, table.num_stash_slots)
    if config.split:
      wstash = full(avals.kept, fill, max(table.num_weight_slots, 1))
  mailbox = full(avals.act, fill, table.num_mailbox_slots + 1)
  if config.with_edge:
    result = jax.tree.map(lambda a: jnp.zeros((m,) + a.shape, a.dtype),
                          avals.act)
    edge = Edge(full(avals.act, 0, p),
                vary(result, avals.act_vma - {config.stage_axis}))
  state = vary(rank.state, avals.act_vma)
  if state.embed is not None:   # the embed state each of stage 0's F saw
    state = state._replace(seen=full(jax.tree.map(jax.typeof, state.embed),
                                     0, table.num_stash_slots))
  held = (full(avals.act, fill, table.num_hold_slots + 1) if config.holds
          else None)
  return Carry(mailbox, stash, wstash, acc, edge, state, held)


def _tick(rank: Rank, avals: Avals, config: ScanConfig, carry: Carry,
          row: TickRow) -> tuple[Carry, None]:
  """One tick on this rank: read the input, run the block, exchange the
  messages, land them and the summed result rows (module doc, 1-4)."""
  cell = _cell(row.ranks, rank.index)
  x = _block_input(rank, carry.mailbox, cell)
  # jaxpar.pipeline.timeline's hook (_stamps.stamp: a host timestamp here,
  # after the block and after the messages); outside a timeline it returns
  # its values and adds nothing to the program.
  x = stamp(config, 'start', x, cell)
  target = jax.tree.map(lambda t: t[cell.microbatch], rank.targets)
  state, ran = _run_blocks(rank, avals, config, cell, x, target, BlockState(
      full(avals.act, config.bubble_fill), carry.acc, carry.stash,
      carry.wstash, carry.state))
  state = stamp(config, 'computed', state)
  # The messages run after every block: their switch index reads the last
  # block's loop (``ran`` is always False; XLA cannot know it), so no
  # block's collectives (a W, which sends nothing) run beside them.
  message = jnp.where(ran, 0, row.message)
  local, remote = offsets(config.table)
  spare = config.table.num_mailbox_slots
  # A local hand-off (the loss cotangent): no message.
  mailbox = deliver(carry.mailbox, cell.recv_slot, local,
                     [state.payload] * len(local), spare)
  pending = edge = None
  if config.with_edge:
    pending = pend(config, cell, row.pending_slot, state.payload,
                    carry.edge.pending)
  got = stamp(config, 'received', exchange(
      config, avals, message, state.payload, pending, carry.held))
  msgs, held = got[:len(remote)], None
  if config.holds:   # (output, held ones) per offset; the output held?
    msgs, bundles = [g[0] for g in msgs], [g[1] for g in msgs]
    mailbox = deliver_held(mailbox, cell.recv_held, remote, bundles, spare)
    held = hold(carry.held, cell.hold_slot, state.payload)
  mailbox = deliver(mailbox, cell.recv_slot, remote, msgs, spare)
  if config.with_edge:
    edge = Edge(pending, write_rows(carry.edge.result, row.summed_rows,
                                     got[-1]))
  return Carry(mailbox, state.stash, state.wstash, state.acc, edge,
               state.state, held), None


def _result(config: ScanConfig, carry: Carry) -> Result | PyTree:
  """The scan's outputs; the sums over the pipeline axis in one collective."""
  result = carry.edge.result if config.with_edge else None
  if not config.training:
    return result
  acc, state = carry.acc, carry.state
  # The embedding's and the loss's state, from the ranks that ran them.
  index = jax.lax.axis_index(config.stage_axis)
  ends = [jax.tree.map(lambda a: jnp.where(index == owner(
      config.table, stage), a, jnp.zeros((), a.dtype)), part)
          for stage, part in ((0, state.embed),
                              (config.table.schedule.num_stages - 1,
                               state.head))]
  value, head, embed, ends = jax.lax.psum(
      (acc.value, acc.head, acc.embed, ends), config.stage_axis)
  return Result(value, acc.stages, head, result,
                embed if config.embedding else None,
                ModelState(state.stages, *ends))


# ------------------------------------------------------------ one tick


def _cell(ranks: TickCell, index: jax.Array) -> TickCell:
  """This rank's cell, its buffer indices clipped to 0 where they are -1
  (an idle rank runs no block; a clipped read is not used)."""
  cell = jax.tree.map(lambda a: a[index], ranks)
  return cell._replace(
      microbatch=jnp.maximum(cell.microbatch, 0),
      local_stage=jnp.maximum(cell.local_stage, 0),
      stash_slot=jnp.maximum(cell.stash_slot, 0),
      weight_slot=jnp.maximum(cell.weight_slot, 0))


def _block_input(rank: Rank, mailbox: PyTree, cell: TickCell) -> PyTree:
  """The action's input: its mailbox slot (an activation for ``F``, a
  cotangent for ``I`` and ``W``), or the batch for stage 0's ``F`` (with
  an embedding that ``F`` embeds its microbatch itself)."""
  x = row(mailbox, jnp.maximum(cell.read_slot, 0))
  if rank.embedding is None:
    x = jax.tree.map(lambda a, b: jnp.where(cell.read_slot >= 0, a, b), x,
                     row(rank.inputs, cell.microbatch))
  return x


def _run_blocks(rank: Rank, avals: Avals, config: ScanConfig,
                cell: TickCell, x: PyTree, target: PyTree,
                state: BlockState) -> tuple[BlockState, jax.Array]:
  """Runs the action's block: each block present in its own ``when``.

  The whiles run in a chain: each one's predicate reads the one before's
  (always False after it), so XLA keeps them in order even where a block
  passes every buffer it does not write through unchanged. Returns the
  state and the last predicate (False), for what must run after them.
  """
  ran = jnp.zeros((), bool)
  for code, (kind, first, last) in enumerate(config.kinds):
    block = {F: functools.partial(_forward, rank, avals, first, last, cell,
                                  x, target),
             B: functools.partial(_backward, rank, avals, first, cell, x),
             I: functools.partial(_input_grad, rank, avals, first, cell, x),
             W: functools.partial(_weight_grad, rank, cell, x)}[kind]
    pred = (cell.block == code) & ~ran
    if kind in (F, B):   # they do not carry the weight stash
      wstash = state.wstash
      state, ran = when(pred, block, state._replace(wstash=None))
      state = state._replace(wstash=wstash)
    else:
      state, ran = when(pred, block, state)
  return state, ran


def _forward(rank: Rank, avals: Avals, first: bool, last: bool,
             cell: TickCell, x: PyTree, target: PyTree,
             state: BlockState) -> BlockState:
  """The ``F`` block: the stage's forward (stage 0 with an embedding: of
  the embedded microbatch). Training stashes the residuals; the last stage
  adds its loss and sends the loss's cotangent instead of ``y``. Each
  function with model state (the stage's, stage 0's embedding's, the last
  stage's loss's) reads it and writes the new one in its place; stage 0
  also keeps the embedding's for its ``B`` or ``I`` (``ModelState.seen``)."""
  model = state.state
  if first:
    x, new_embed = embedded(rank, embed_params(rank), cell.microbatch,
                            model.embed)
    x = like(cast(x, avals.act), avals.act)
    if model.embed is not None:
      model = model._replace(seen=put(model.seen, cell.stash_slot,
                                      model.embed),
                             embed=written(model.embed, new_embed))
  params = params_of(rank, cell.local_stage)
  if rank.loss_fn is None:
    return state._replace(payload=like(rank.stage.stage_fn(params, x),
                                       avals.act))
  y, residuals, *new_stage = rank.stage.forward(
      params, x, key_of(rank, cell.stage, cell.microbatch),
      state=row(model.stages, cell.local_stage))
  model = model._replace(stages=put(model.stages, cell.local_stage,
                                    new_stage[0] if new_stage else None))
  state = state._replace(stash=put(state.stash, cell.stash_slot,
                                   residuals), state=model)
  if not last:
    return state._replace(payload=like(y, avals.act))
  value, (dhead, dy), new_head = seed(
      rank, rank.loss_params, y, target,
      key_of(rank, rank.num_stages, cell.microbatch), model.head)
  acc = state.acc._replace(value=add(state.acc.value, value),
                           head=add(state.acc.head, dhead))
  return state._replace(payload=like(dy, avals.act), acc=acc,
                        state=model._replace(
                            head=written(model.head, new_head)))


def _backward(rank: Rank, avals: Avals, first: bool, cell: TickCell,
              dy: PyTree, state: BlockState) -> BlockState:
  """The ``B`` block: the stage's whole backward as one VJP, keeping
  nothing: its parameter cotangent added to the gradient, its input
  cotangent sent (stage 0 with an embedding: the embedding's VJP of it)."""
  j = cell.local_stage
  dstage, dx = rank.stage.backward(
      params_of(rank, j), row(state.stash, cell.stash_slot), dy,
      key_of(rank, cell.stage, cell.microbatch),
      state=row(state.state.stages, j))
  return _sent(rank, avals, first, cell, like(dx, avals.act), state._replace(
      acc=_add_stage(state.acc, j, dstage)))


def _input_grad(rank: Rank, avals: Avals, first: bool, cell: TickCell,
                dy: PyTree, state: BlockState) -> BlockState:
  """The ``I`` block: the input cotangent (sent; stage 0 with an
  embedding: the embedding's VJP of it), and what ``W`` needs in the
  weight stash. ``I`` and ``W`` read their stash rows where they use them
  (``rows``: a scan over the stage's layers reads one layer per iteration,
  not a copy of the row)."""
  dx, kept = rank.stage.input_grad(
      params_of(rank, cell.local_stage), rows(state.stash, cell.stash_slot),
      dy, key_of(rank, cell.stage, cell.microbatch))
  return _sent(rank, avals, first, cell, like(dx, avals.act), state._replace(
      wstash=put(state.wstash, cell.weight_slot, kept)))


def _weight_grad(rank: Rank, cell: TickCell, dy: PyTree,
                 state: BlockState) -> BlockState:
  """The ``W`` block: the stage's parameter cotangent from what ``I``
  kept, added to its gradient; it sends nothing."""
  j = cell.local_stage
  dstage = rank.stage.weight_grad(
      params_of(rank, j), rows(state.stash, cell.stash_slot), dy,
      rows(state.wstash, cell.weight_slot),
      key_of(rank, cell.stage, cell.microbatch))
  return state._replace(acc=_add_stage(state.acc, j, dstage))


def _sent(rank: Rank, avals: Avals, first: bool, cell: TickCell, dx: PyTree,
          state: BlockState) -> BlockState:
  """``state`` sending the input cotangent ``dx``; on stage 0 with an
  embedding (``first``) the embedding's VJP of it (recomputing the
  embedding, with the state its ``F`` saw) is added to its gradient
  instead."""
  if not first:
    return state._replace(payload=dx)
  seen = row(state.state.seen, cell.stash_slot)
  _, vjp = jax.vjp(lambda ep: embedded(rank, ep, cell.microbatch, seen)[0],
                   embed_params(rank))
  embed = add(state.acc.embed, vjp(cotangent(cast(dx, avals.act),
                                             avals.act))[0])
  return state._replace(acc=state.acc._replace(embed=embed))


def _add_stage(acc: Accumulators, j: Any, dstage: PyTree) -> Accumulators:
  """``acc`` with ``dstage`` added to local stage ``j``'s gradient."""
  return acc._replace(stages=jax.tree.map(
      lambda g, d: g.at[j].add(like(d, g[j])), acc.stages, dstage))


def check_command_buffers(xla_flags: str, backend: str) -> None:
  """Raises where XLA:GPU would record the blocks' ``while`` loops in
  command buffers: on an H200 with jax 0.11.2 such a zero-or-one-trip loop
  returned wrong values (``python -m jaxpar bench --only dispatch`` with
  ``XLA_FLAGS=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL``: max
  difference 0.41 and 0.51 from the ungated blocks, 0 without the flag;
  docs/executor.md, "Cost on GPU").

  Example:
    >>> check_command_buffers('--xla_gpu_enable_command_buffer=+WHILE', 'cpu')
  """
  found = re.search(r'--xla_gpu_enable_command_buffer=(\S*)', xla_flags)
  kinds = found.group(1).upper().split(',') if found else []
  if backend == 'gpu' and {'WHILE', '+WHILE'} & set(kinds):
    raise ValueError(
        f'XLA_FLAGS has {found.group(0)!r}: with WHILE loops in XLA:GPU '
        'command buffers the pipeline\'s gated blocks computed wrong values '
        '(docs/executor.md, "Cost on GPU"); drop WHILE from '
        '--xla_gpu_enable_command_buffer before the process starts.')


def when(pred: jax.Array, fn: Callable[[PyTree], PyTree],
         state: PyTree) -> tuple[PyTree, jax.Array]:
  """``(fn(state) if pred else state, False)``, updating buffers in place.

  A ``while_loop`` of zero or one trip. XLA keeps while-loop carries in
  place, whereas a ``lax.cond``/``lax.switch`` copies every buffer that a
  branch passes through unchanged: with a branch per action kind that would
  copy the gradient accumulators and stash on every tick. The loop's final
  predicate (always False) is returned so that later work can read it and
  stay ordered after the loop.
  """
  done, state = jax.lax.while_loop(
      lambda c: c[0], lambda c: (c[0] & False, fn(c[1])), (pred, state))
  return state, done
