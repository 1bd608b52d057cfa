"""The tick table as the executor reads it: block codes, message patterns, edge rows.

Pure numpy over a ``TickTable``: which block (kind, first, last) each rank
runs at each tick, which ``ppermute`` pattern each tick's messages use, and
where the batch-sized edge results (input cotangents) are written.
"""

from __future__ import annotations

import numpy as np

from jaxpar.pipeline.schedules import KIND_CODES, TickTable

F, B, I, W = (KIND_CODES[k] for k in 'FBIW')   # the tick table's kind codes


def blocks(table: TickTable, *, loss: bool, embed: bool
           ) -> tuple[np.ndarray, tuple[tuple[int, bool, bool], ...]]:
  """The block each rank runs at each tick, as a code into a list of kinds.

  A block is ``(kind, first, last)``: ``first`` is stage 0 with an
  ``embed_fn`` (its ``F`` embeds the raw microbatch, its ``B`` or ``I``
  adds the embedding's VJP of the input cotangent), ``last`` the last
  stage's ``F`` with the loss.

  Returns:
    ``(code, kinds)``: int32 ``[T, p]`` (``-1`` idle) and the blocks present,
    ``kinds[code]``, in a fixed order.
  """
  kind, stage = table.kind, table.stage
  first = embed & (stage == 0) & ((kind == F) | (kind == B) | (kind == I))
  last = loss & (stage == table.schedule.num_stages - 1) & (kind == F)
  keys = np.stack([kind, first, last], -1)
  present = sorted({tuple(int(v) for v in k) for k in keys.reshape(-1, 3)
                    if k[0]})
  code = np.full(kind.shape, -1, np.int32)
  for c, k in enumerate(present):
    code[(keys == k).all(-1)] = c
  return code, tuple((k, bool(f), bool(l)) for k, f, l in present)


SENDS, BUNDLE = 1, 2   # a pattern's flag for an offset: a message, a bundle


def messages(table: TickTable, edge: bool
             ) -> tuple[np.ndarray, tuple[tuple[int, ...], ...]]:
  """What is communicated at each tick, the same on every rank.

  A pattern is one flag per nonzero offset plus, with ``edge``, one for the
  ``psum`` of the pending rows of the batch-sized result (``edge_rows``):
  ``0`` nothing, ``SENDS`` a ``ppermute`` of the block's output over the
  offset, ``BUNDLE`` one of the output with the hold slots (held messages
  travel, ``TickTable.recv_held``).

  Returns:
    ``(code, patterns)``: int32 ``[T]`` and the distinct patterns.
  """
  remote = [k for k, o in enumerate(table.offsets) if o]
  flags = np.where((table.recv_held[:, :, remote] >= 0).any((1, 3)), BUNDLE,
                   (table.recv_slot[:, :, remote] >= 0).any(1) * SENDS)
  if edge:
    summed = (edge_rows(table)[1] < table.schedule.num_microbatches
              ).any(1)
    flags = np.concatenate([flags, summed[:, None]], 1)
  patterns = sorted({tuple(int(f) for f in row) for row in flags})
  code = np.array([patterns.index(tuple(int(f) for f in row))
                   for row in flags], np.int32)
  return code, tuple(patterns)


def edge_rows(table: TickTable) -> tuple[np.ndarray, np.ndarray]:
  """When each row of the batch-sized result is done, and when it is summed.

  A row (stage 0's input cotangent of a microbatch when training, from its
  ``B`` or ``I``, else the last stage's output) is done on one rank; it
  waits in one of ``K = num_ranks`` pending slots until ``K`` rows are done
  (or the last one is), then one ``psum`` over the pipeline axis brings them
  to every rank: ``ceil(m / K)`` collectives of ``K`` rows, not ``m`` of
  one.

  Returns:
    ``(slot, rows)``: int32 ``[T]``, the pending slot the row done at tick
    ``t`` is written to (``K``: none, a write that is dropped); int32
    ``[T, K]``, the result row each slot holds when tick ``t`` sums them
    (``m``: none).
  """
  train = table.training
  kinds, stage = (((B, I), 0) if train else
                  ((F,), table.schedule.num_stages - 1))
  at = np.isin(table.kind, kinds) & (table.stage == stage)
  done = np.where(at.any(1), np.where(at, table.microbatch, -1).max(1), -1)
  k, m = table.schedule.num_ranks, table.schedule.num_microbatches
  slot = np.full(done.shape, k, np.int32)
  rows = np.full(done.shape + (k,), m, np.int32)
  ticks = np.flatnonzero(done >= 0)
  for n, t in enumerate(ticks):
    slot[t] = n % k
    if n % k == k - 1 or n == len(ticks) - 1:
      group = ticks[n - n % k:n + 1]
      rows[t, :len(group)] = done[group]
  return slot, rows
