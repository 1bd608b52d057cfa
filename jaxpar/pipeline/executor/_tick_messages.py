"""A tick's messages: the ``ppermute``s between ranks and the result rows.

After its block, every rank of a tick (``_tick_scan._tick``) hands its
output on: ``exchange`` runs the tick's message pattern (one ``lax.switch``,
the same on every rank: a ``ppermute`` per remote offset that sends, and the
``psum`` of the pending result rows), ``deliver`` stores what arrived in the
mailbox slots the table names, ``pend`` and ``write_rows`` keep the
batch-sized result ``p`` rows at a time (``docs/executor.md``). Where the
table holds messages back (``TickTable.hold_slot``), ``hold`` keeps the
output in a hold slot instead, and a bundle (``BUNDLE``) sends it later in
one ``ppermute`` with the output of the tick: one array per leaf, the
output stacked on the hold slots.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.executor._microbatches import row
from jaxpar.pipeline.executor._tick_rows import B, BUNDLE, F, I
from jaxpar.pipeline.executor._tick_state import Avals, ScanConfig, TickCell
from jaxpar.pipeline.executor._vma import full, like, put
from jaxpar.pipeline.schedules import TickTable
from jaxpar.vma import vary

PyTree = Any


def offsets(table: TickTable) -> tuple[list[int], list[int]]:
  """Indices into ``table.offsets``: ``(local, remote)``, zero or not."""
  return ([k for k, o in enumerate(table.offsets) if not o],
          [k for k, o in enumerate(table.offsets) if o])


def deliver(mailbox: PyTree, recv_slot: jax.Array, offsets: list[int],
             msgs: list[PyTree], spare: int) -> PyTree:
  """Each message into the slot ``recv_slot`` names for its offset (the
  ``spare`` slot, never read, if none)."""
  for k, msg in zip(offsets, msgs):
    mailbox = put(mailbox, jnp.where(recv_slot[k] >= 0, recv_slot[k], spare),
                   msg)
  return mailbox


def deliver_held(mailbox: PyTree, recv_held: jax.Array, offsets: list[int],
                 bundles: list[PyTree], spare: int) -> PyTree:
  """The held messages of each offset's bundle (``[H, ...]``, in hold slot
  order) into the slots ``recv_held`` names (``spare`` if none)."""
  for k, bundle in zip(offsets, bundles):
    for h in range(recv_held.shape[-1]):
      slot = recv_held[k, h]
      mailbox = put(mailbox, jnp.where(slot >= 0, slot, spare),
                    row(bundle, h))
  return mailbox


def hold(held: PyTree, hold_slot: jax.Array, payload: PyTree) -> PyTree:
  """``held`` with the tick's output in ``hold_slot`` (the spare last slot
  if it is sent, ``-1``)."""
  spare = jax.tree.leaves(held)[0].shape[0] - 1
  return put(held, jnp.where(hold_slot >= 0, hold_slot, spare), payload)


def pend(config: ScanConfig, cell: TickCell, slot: jax.Array,
          payload: PyTree, pending: PyTree) -> PyTree:
  """``pending`` with the result row done this tick, if any, in ``slot``:
  the payload on the rank that did it, zeros elsewhere (summed later)."""
  schedule = config.table.schedule
  p = schedule.num_ranks
  done = (((cell.kind == B) | (cell.kind == I)) if config.training else
          (cell.kind == F))
  mine = done & (cell.stage == (0 if config.training else
                                schedule.num_stages - 1))
  k = jnp.minimum(slot, p - 1)
  return put(pending, k, jax.tree.map(
      lambda new, old: jnp.where(slot < p, jnp.where(mine, new, 0), old),
      payload, row(pending, k)))


def exchange(config: ScanConfig, avals: Avals, message: jax.Array,
              payload: PyTree, pending: PyTree | None,
              held: PyTree = None) -> list:
  """The tick's messages: one ``lax.switch`` on its pattern, the same on
  every rank (none when there is one pattern)."""
  if len(config.patterns) == 1:
    return send(config, avals, config.patterns[0], payload, pending, held)
  return jax.lax.switch(message, [
      functools.partial(send, config, avals, pattern)
      for pattern in config.patterns], payload, pending, held)


def send(config: ScanConfig, avals: Avals, pattern: tuple[int, ...],
          payload: PyTree, pending: PyTree | None,
          held: PyTree = None) -> list:
  """One pattern: a ``ppermute`` of the payload per remote offset that
  sends (a fill for the others) and, with ``ScanConfig.with_edge``, the
  ``psum`` of the pending rows (zeros when they are not summed this tick).
  With ``ScanConfig.holds`` each offset's message is a pair ``(output,
  [H, ...] held)``: a ``BUNDLE`` sends both as one array per leaf (the
  output stacked on the hold slots), the others a fill for the held part."""
  table, axis = config.table, config.stage_axis
  p = table.schedule.num_ranks
  _, remote = offsets(table)
  hops = lambda k: [(r, (r + table.offsets[k]) % p) for r in range(p)]
  msgs = []
  for k, flag in zip(remote, pattern):
    if flag == BUNDLE:
      both = jax.lax.ppermute(jax.tree.map(
          lambda a, h: jnp.concatenate([a[None], h[:-1]]), payload, held),
                              axis, hops(k))
      msgs.append((like(row(both, 0), avals.act),
                   like(jax.tree.map(lambda a: a[1:], both), held)))
      continue
    msg = (like(jax.lax.ppermute(payload, axis, hops(k)), avals.act) if flag
           else full(avals.act, config.bubble_fill))
    msgs.append((msg, full(avals.act, config.bubble_fill,
                           table.num_hold_slots)) if config.holds else msg)
  if config.with_edge:
    msgs.append(jax.lax.psum(pending, axis) if pattern[-1] else
                vary(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                  pending), avals.act_vma - {axis}))
  return msgs


def write_rows(result: PyTree, summed_rows: jax.Array,
                summed: PyTree) -> PyTree:
  """The rows summed this tick into ``result``, if any: one in-place row
  write per pending slot (a select keeps the row otherwise)."""
  m = jax.tree.leaves(result)[0].shape[0]
  for k in range(summed_rows.shape[0]):
    i = jnp.minimum(summed_rows[k], m - 1)
    result = put(result, i, jax.tree.map(
        lambda new, old: jnp.where(summed_rows[k] < m, new, old),
        row(summed, k), row(result, i)))
  return result
