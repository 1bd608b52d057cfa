"""The V-shape building blocks of Qi et al. 2024; a schedule grown from one.

"Pipeline Parallelism with Controllable Memory" (Qi, Wan, Amar, Lin;
arXiv 2405.15362) builds V-Half and V-Min in three steps, on a grid of time
slots that each hold one pass of one logical stage (``F = I = W``):

1. **Repeat the building block.** A block says in which slot rank ``r`` runs
   the four passes of microbatch 0: the forward of its stage on the way down
   (``F0``, stage ``r``), the forward on the way up (``F1``, stage
   ``2p-1-r``), and the input gradients in reverse (``I1``, then ``I0``).
   Microbatch ``i`` runs the same passes ``6i`` slots later: a rank has six
   passes per microbatch (two ``F``, two ``I``, two ``W``), so in the steady
   state no slot is empty. The block's lifespan on a rank (its ``F0`` to its
   last ``W``) divided by 6 is the rank's peak memory in microbatches.
2. **Fill in the weight gradients.** Each ``W`` goes into the first empty
   slot after its ``I`` (the up stage's first), the rest after the end.
3. **Squeeze.** Passes of the warm-up (before rank 0's first ``I0``) and of
   the cool-down (after rank 0's last ``F0``) move to the earliest free slot
   after their inputs, if the rank's peak memory does not grow; then every
   pass starts as early as its inputs and its rank allow. The cool-down is
   squeezed a second time with the ``W`` taken out and put back.

The paper's code is ``zbv_greedy.py`` in ``sail-sg/zero-bubble-pipeline-
parallelism``; this is an independent implementation of the same steps.
Slots are lists ``slots[r][k][i]`` per rank ``r``, pass ``k`` in ``PASSES``
and microbatch ``i``; ``W`` are counted per rank, not per stage, until the
last step splits them.
"""

from __future__ import annotations

from jaxpar.pipeline.schedules._action import Action

PASSES = ('F0', 'F1', 'I1', 'I0', 'W')  # 0: the down stage, 1: the up stage
PERIOD = 6  # slots per microbatch and rank: F0, F1, I1, I0 and two W


def v_min_block(p: int) -> tuple[tuple[int, int, int, int], ...]:
  """V-Min's block: slots of ``F0, F1, I1, I0`` of microbatch 0 per rank.

  The forward runs down and up the V one slot a stage, the input gradient
  comes back ``gap`` slots later (``gap = 2`` when ``3 | p``, so that no two
  passes of a rank share a slot modulo 6). Rank 0's lifespan is ``4p + gap``
  slots plus its ``W``: ``(p+4)//3`` microbatches of 1F1B-stage activations.
  """
  gap = 2 if p % 3 == 0 else 0
  return tuple((r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r)
               for r in range(p))


def v_half_block(p: int) -> tuple[tuple[int, int, int, int], ...]:
  """V-Half's block: forwards two slots a stage on the way down, one up.

  ``gap = 3`` when ``p`` is even; the lifespan gives ``(p+2)//2`` microbatches
  of 1F1B-stage activations.
  """
  gap = 3 if p % 2 == 0 else 0
  return tuple((2 * r, 3 * p - 2 - r, 3 * p + gap + 2 * r - 1,
                6 * p + gap - 2 - r) for r in range(p))


def rows(block, m: int) -> tuple[tuple[Action, ...], ...]:
  """Per-rank action orders of the schedule grown from ``block`` (steps 1-3)."""
  p = len(block)
  slots = [[[t + PERIOD * i for i in range(m)] for t in first]
           for first in block]
  slots = _compact(_squeeze([_fill_w(r) for r in slots], m, warmup=True))
  slots = _squeeze([r[:4] for r in slots], m, warmup=False)
  slots = _compact([_fill_w(r) for r in slots])
  return tuple(_actions(r, _fill_w([k[:] for k in rank[:4]], split=True), p)
               for r, rank in enumerate(slots))


def _fill_w(rank: list[list[int]], split: bool = False) -> list[list[int]]:
  """Step 2: ``W`` into the empty slots after their ``I``, then after the end.

  Returns the rank's lists with ``W`` appended: one list (``W`` counted per
  rank), or with ``split`` two, of the up stage's and the down stage's ``W``
  (the up stage's taken first, each stage's in microbatch order).
  """
  kinds = rank[:4]
  taken = {t: k for k in range(4) for t in kinds[k]}
  ws: list[list[int]] = [[], []]
  pending = [0, 0]
  end = max(taken)
  for t in range(end + 1):
    if t in taken:
      if taken[t] >= 2:  # I1 -> the up stage's W, I0 -> the down stage's
        pending[taken[t] - 2 if split else 0] += 1
    elif any(pending):
      w = 0 if pending[0] else 1
      ws[w].append(t)
      pending[w] -= 1
  for w in (0, 1):
    for _ in range(pending[w]):
      end += 1
      ws[w].append(end)
  return kinds + (ws if split else ws[:1])


def _peak(rank: list[list[int]]) -> int:
  """Peak stashes of a rank: ``F`` holds one until a ``W`` frees one.

  Without ``W`` lists, each empty slot after an ``I`` runs a pending ``W``.
  """
  kind_at = {t: k for k, times in enumerate(rank) for t in times}
  live = peak = pending = 0
  for t in range(max(kind_at) + 1):
    k = kind_at.get(t)
    if k is not None:
      live += 1 if k < 2 else -1 if k == 4 else 0
      pending += k in (2, 3)
    elif len(rank) == 4 and pending:
      live, pending = live - 1, pending - 1
    peak = max(peak, live)
  return peak


def _inputs(slots, r: int, k: int, i: int) -> list[int]:
  """Slots of what pass ``k`` of microbatch ``i`` on rank ``r`` waits for."""
  p, rank = len(slots), slots[r]
  deps = []
  if k in (0, 2) and r > 0:  # F0 and I1 travel down the ranks
    deps.append(slots[r - 1][k][i])
  if k in (1, 3) and r < p - 1:  # F1 and I0 travel up
    deps.append(slots[r + 1][k][i])
  if 0 < k < 4:  # F1 after F0, I1 after F1, I0 after I1 on the same rank
    deps.append(rank[k - 1][i])
  if k == 4:  # the i-th W after the i-th I of the rank
    deps.append(sorted(rank[2] + rank[3])[i])
  if i > 0:
    deps.append(rank[k][i - 1])
  return deps


def _squeeze(slots, m: int, warmup: bool):
  """Step 3: warm-up (if ``warmup``) and cool-down passes into earlier slots.

  Passes are visited in slot order; from rank 0's first ``I0`` up to the
  last ``F0`` (the steady state) they stay. The others take the first free
  slot after their inputs that keeps the rank within the schedule's peak.
  """
  cap = max(map(_peak, slots))
  taken = [set() for _ in slots]
  phase = 0 if warmup else -1  # -1: warm-up kept; 1: steady; 2: cool-down
  for t, r, k, i in sorted((t, r, k, i) for r, rank in enumerate(slots)
                           for k, times in enumerate(rank)
                           for i, t in enumerate(times)):
    if phase < 1 and k == 3 and r == 0:
      phase = 1
    if phase in (-1, 1):  # kept where it is
      phase += phase == 1 and k == 0 and i == m - 1
      taken[r].add(t)
      continue
    rank = slots[r]
    for s in range(max(_inputs(slots, r, k, i), default=-1) + 1, t):
      if s not in taken[r]:
        rank[k][i] = s
        # With W in place, moving I or W earlier never raises the peak.
        if (k >= 2 and len(rank) == 5) or _peak(rank) <= cap:
          break
    else:
      rank[k][i] = t
    taken[r].add(rank[k][i])
  return slots


def _compact(slots):
  """Every pass as early as its inputs and its rank's order allow (unit time).

  Returns new lists of start slots, rank orders unchanged.
  """
  out = [[list(times) for times in rank] for rank in slots]
  free = [0] * len(slots)
  for _, r, k, i in sorted((t, r, k, i) for r, rank in enumerate(slots)
                           for k, times in enumerate(rank)
                           for i, t in enumerate(times)):
    deps = _inputs(out, r, k, i) if k < 4 else []  # W: its rank's order
    start = max([free[r]] + [d + 1 for d in deps])
    out[r][k][i] = start
    free[r] = start + 1
  return out


def _actions(r: int, rank: list[list[int]], p: int) -> tuple[Action, ...]:
  """Rank ``r``'s actions in slot order (``rank``: F0, F1, I1, I0, W1, W0)."""
  up, down = 2 * p - 1 - r, r
  names = ((down, 'F'), (up, 'F'), (up, 'I'), (down, 'I'), (up, 'W'),
           (down, 'W'))
  timed = sorted((t, Action(names[k][0], names[k][1], i))
                 for k, times in enumerate(rank) for i, t in enumerate(times))
  return tuple(a for _, a in timed)
