"""A tick's messages: the ``ppermute``s between ranks and the result rows.

After its block, every rank of a tick (``_tick_scan._tick``) hands its
output on: ``exchange`` runs the tick's message pattern (one ``lax.switch``,
the same on every rank: a ``ppermute`` per remote offset that sends, and the
``psum`` of the pending result rows), ``deliver`` stores what arrived in the
mailbox slots the table names, ``pend`` and ``write_rows`` keep the
batch-sized result ``p`` rows at a time (``docs/executor.md``).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxpar.pipeline.executor._microbatches import row
from jaxpar.pipeline.executor._tick_rows import B, F, I
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
              payload: PyTree, pending: PyTree | None) -> list:
  """The tick's messages: one ``lax.switch`` on its pattern, the same on
  every rank (none when there is one pattern)."""
  if len(config.patterns) == 1:
    return send(config, avals, config.patterns[0], payload, pending)
  return jax.lax.switch(message, [
      functools.partial(send, config, avals, pattern)
      for pattern in config.patterns], payload, pending)


def send(config: ScanConfig, avals: Avals, pattern: tuple[bool, ...],
          payload: PyTree, pending: PyTree | None) -> list:
  """One pattern: a ``ppermute`` of the payload per remote offset that
  sends (a fill for the others) and, with ``ScanConfig.with_edge``, the ``psum``
  of the pending rows (zeros when they are not summed this tick)."""
  table, axis = config.table, config.stage_axis
  p = table.schedule.num_ranks
  _, remote = offsets(table)
  msgs = [like(jax.lax.ppermute(payload, axis, [
      (r, (r + table.offsets[k]) % p) for r in range(p)]), avals.act)
          if send else full(avals.act, config.bubble_fill)
          for k, send in zip(remote, pattern)]
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
