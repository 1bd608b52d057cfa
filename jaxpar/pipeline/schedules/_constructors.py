"""The classic schedules: GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V.

Each constructor reproduces the per-rank order of PyTorch's
``torch.distributed.pipelining`` schedule of the same name (without PyTorch's
idle padding: waiting is implied by the dependencies) and returns a validated
``Schedule``. The V-shaped controllable-memory schedules are in ``vshape``.
"""

from __future__ import annotations

import collections

from jaxpar.pipeline.schedules._action import Action, check_sizes
from jaxpar.pipeline.schedules._schedule import Schedule

# Constructor name -> logical stages each rank holds (``None``: the
# constructor's ``virtual_stages`` argument); the V shapes are in _vshape.
STAGES_PER_RANK = {'gpipe': 1, 'one_f_one_b': 1, 'zero_bubble_h1': 1,
                   'interleaved_one_f_one_b': None, 'zero_bubble_v': 2,
                   'dualpipe_v': 2, 'v_half': 2, 'v_min': 2}


def _single(rows: list[list[Action]], p: int, m: int, name: str) -> Schedule:
  return Schedule(p, p, m, tuple(range(p)), tuple(map(tuple, rows)),
                  name).validate()


def gpipe(num_ranks: int, num_microbatches: int) -> Schedule:
  """GPipe: every rank runs all forwards, then all backwards, in order.

  Rank ``r`` holds stage ``r``. With uniform per-stage costs (any ``F``,
  ``B``) the makespan is ``(m+p-1)(F+B)`` and the bubble fraction
  ``(p-1)/(m+p-1)``; every rank stashes all ``m`` activations (peak ``m``).

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'GPipe'``.

  Example:
    >>> from jaxpar.pipeline import gpipe
    >>> [str(a) for a in gpipe(2, 2).actions[0]]
    ['0F0', '0F1', '0B0', '0B1']
  """
  check_sizes('gpipe', num_ranks=num_ranks, num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = [[Action(r, 'F', i) for i in range(m)] +
          [Action(r, 'B', i) for i in range(m)] for r in range(p)]
  return _single(rows, p, m, 'GPipe')


def one_f_one_b(num_ranks: int, num_microbatches: int) -> Schedule:
  """1F1B (PipeDream-Flush), PyTorch's ``Schedule1F1B`` order.

  Rank ``r`` runs ``w = min(p-r-1, m)`` warm-up forwards, then alternates one
  forward and one backward until the forwards run out, then the remaining
  backwards. At most ``min(p-r, m)`` activations are stashed on rank ``r``.
  With ``F = B = 1`` the bubble fraction is ``(p-1)/(m+p-1)``, as for GPipe
  (also for any uniform ``F``, ``B``, including the default ``B = 2F``).

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1`` (``m < p`` is allowed).

  Returns:
    The validated ``Schedule`` named ``'1F1B'``.

  Example:
    >>> from jaxpar.pipeline import one_f_one_b
    >>> [str(a) for a in one_f_one_b(3, 4).actions[0]]
    ['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
  """
  check_sizes('one_f_one_b', num_ranks=num_ranks,
               num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = []
  for r in range(p):
    warmup = min(p - r - 1, m)
    row = [Action(r, 'F', i) for i in range(warmup)]
    for i in range(m - warmup):
      row += [Action(r, 'F', warmup + i), Action(r, 'B', i)]
    row += [Action(r, 'B', i) for i in range(m - warmup, m)]
    rows.append(row)
  return _single(rows, p, m, '1F1B')


def interleaved_one_f_one_b(num_ranks: int, num_microbatches: int,
                     virtual_stages: int) -> Schedule:
  """Interleaved 1F1B (Megatron-LM), PyTorch's ``ScheduleInterleaved1F1B``.

  The model is cut into ``S = v * p`` logical stages; stage ``k`` lives on
  rank ``k % p``. Rank ``r`` cycles over its ``v`` chunks in rounds of ``p``
  microbatches (forwards chunk 0 -> v-1, backwards v-1 -> 0), starting with
  ``min((v-1)p + 2(p-1-r), v m)`` warm-up forwards, then alternating one
  forward and one backward. With every chunk costing ``F = B = 1`` the bubble
  fraction is ``(p-1)/(v m + p-1)``, ``v`` times less bubble time than
  1F1B on the same model (exact in simulation for ``F = B`` and for the
  default ``B = 2F``); rank ``r`` stashes ``min((v-1)p + 2(p-r) - 1, v m)``
  chunk activations at peak.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m``, a positive multiple of ``p``.
    virtual_stages: ``v >= 1`` chunks per rank.

  Returns:
    The validated ``Schedule`` named ``'Interleaved 1F1B (v=...)'``.

  Raises:
    ValueError: for sizes < 1 or ``m`` not a multiple of ``p`` (naming the
      nearest valid ``m``).

  Example:
    >>> from jaxpar.pipeline import interleaved_one_f_one_b
    >>> s = interleaved_one_f_one_b(2, 2, 2)
    >>> s.placement, [str(a) for a in s.actions[1]]
    ((0, 1, 0, 1), ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1'])
  """
  call = check_sizes('interleaved_one_f_one_b', num_ranks=num_ranks,
                      num_microbatches=num_microbatches,
                      virtual_stages=virtual_stages)
  p, m, v = int(num_ranks), int(num_microbatches), int(virtual_stages)
  if m % p:
    below, above = m - m % p, m - m % p + p
    nearest = (f'num_microbatches={below} or {above}' if below
               else f'num_microbatches={above}')
    raise ValueError(
        f'{call}: num_microbatches must be a multiple of num_ranks={p} '
        f'(microbatches go round the ranks in groups of {p}); nearest valid '
        f'choice: {nearest}.')
  rows = tuple(_interleaved_row(r, p, m, v) for r in range(p))
  return Schedule(p, v * p, m, tuple(k % p for k in range(v * p)), rows,
                  f'Interleaved 1F1B (v={v})').validate()


def _interleaved_row(r: int, p: int, m: int, v: int) -> tuple[Action, ...]:
  """Rank ``r`` of interleaved 1F1B (PyTorch's ``_get_1f1b_rank_ops``)."""
  warmup = min((v - 1) * p + 2 * (p - 1 - r), v * m)
  count = collections.Counter()

  def act(kind: str, op: int) -> Action:
    # Op ``op`` of a kind works on chunk ``op // p % v``: rounds of p
    # microbatches per chunk; backwards count from the end of the warm-up and
    # walk the chunks in reverse.
    if kind == 'F':
      chunk = op // p % v
    else:
      chunk = v - 1 - (op - warmup) // p % v
    stage = chunk * p + r
    count[kind, stage] += 1
    return Action(stage, kind, count[kind, stage] - 1)

  row = [act('F', op) for op in range(warmup)]
  for op in range(warmup, v * m):
    row += [act('F', op), act('B', op)]
  row += [act('B', op) for op in range(v * m, v * m + warmup)]
  return tuple(row)


def zero_bubble_h1(num_ranks: int, num_microbatches: int) -> Schedule:
  """ZB-H1 (Qi et al. 2024): 1F1B with the backward split into ``I`` and ``W``.

  PyTorch's ``ScheduleInterleavedZeroBubble`` order with one stage per rank
  (PyTorch pads it with idle slots and needs ``m`` divisible by its number of
  rounds; here any ``m >= 1`` works):
  rank ``r`` runs ``w = min(p-r-1, m)`` warm-up forwards, then pairs
  ``F, I``; after its ``k``-th input gradient ``I(k)`` it runs the weight
  gradient ``W(k-r)`` (when ``k >= r``), and the ``r`` postponed ``W`` fill
  the cool-down where 1F1B idles. Activation stash as 1F1B (``min(p-r, m)``
  freed at ``I``); rank ``r`` holds up to ``min(r+1, m)`` pending weight
  gradients. For ``m >= p`` and ``F = I = W = 1`` the bubble fraction is
  ``(p-1)/(3m+p-1)``: at most half of 1F1B's ``(p-1)/(m+p-1)`` (with
  ``B = I + W = 2``), and about a third for ``m >> p``.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'ZB-H1'``.

  Example:
    >>> from jaxpar.pipeline import zero_bubble_h1
    >>> [str(a) for a in zero_bubble_h1(2, 2).actions[1]]
    ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
  """
  check_sizes('zero_bubble_h1', num_ranks=num_ranks,
               num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = []
  for r in range(p):
    warmup = min(p - r - 1, m)
    row = [Action(r, 'F', i) for i in range(warmup)]
    for k in range(m):
      if warmup + k < m:
        row.append(Action(r, 'F', warmup + k))
      row.append(Action(r, 'I', k))
      if k >= r:
        row.append(Action(r, 'W', k - r))
    row += [Action(r, 'W', k) for k in range(max(m - r, 0), m)]
    rows.append(row)
  return _single(rows, p, m, 'ZB-H1')


def zero_bubble_v(num_ranks: int, num_microbatches: int) -> Schedule:
  """ZB-V: the V-shaped zero-bubble schedule (``ScheduleZBVZeroBubble``).

  ``2p`` logical stages: stage ``k`` on rank ``k`` for ``k < p`` and on rank
  ``2p-1-k`` otherwise, so the first and last stage share rank 0 and the
  activation turns around on rank ``p-1`` without communication. Backwards are
  split into ``I``/``W``; ``W`` fills the gaps. PyTorch builds the order for
  ``max(m, 2p-1)`` microbatches and drops the extra ones, which is what this
  does too, so any ``m >= 1`` works (no other constraint: every ``p, m``
  validates). For ``m >= 2p-1`` and ``F = I = W = 1`` the bubble fraction is
  ``(p-1)/(6m+p-1)`` (each rank is busy ``6m``, idle ``p-1``) and every rank
  stashes ``2p`` chunk activations, i.e. ``p`` full-stage ones, as 1F1B's
  rank 0.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'ZB-V'``.

  Example:
    >>> from jaxpar.pipeline import zero_bubble_v
    >>> s = zero_bubble_v(2, 2)
    >>> s.placement, [str(a) for a in s.actions[1]][:4]
    ((0, 1, 1, 0), ['1F0', '2F0', '1F1', '2F1'])
  """
  check_sizes('zero_bubble_v', num_ranks=num_ranks,
              num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = tuple(_zero_bubble_v_row(r, p, m) for r in range(p))
  placement = tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))
  return Schedule(p, 2 * p, m, placement, rows, 'ZB-V').validate()


def _zero_bubble_v_row(r: int, p: int, m: int) -> tuple[Action, ...]:
  """Rank ``r`` of ZB-V (PyTorch's ``ScheduleZBVZeroBubble``)."""
  n = max(2 * p - 1, m)  # built for n microbatches, those >= m dropped
  down, up = r, 2 * p - 1 - r  # this rank's stages on the way down and up
  count = collections.Counter()
  row = []

  def act(stage: int, *kinds: str):
    for kind in kinds:
      row.append(Action(stage, kind, count[stage, kind]))
      count[stage, kind] += 1

  for _ in range(2 * (p - r) - 1):  # warm-up
    act(down, 'F')
  for _ in range(r):
    act(up, 'F')
    act(down, 'F')
  for _ in range(p - r):
    act(up, 'F', 'I', 'W')
  while count[up, 'F'] < count[down, 'F'] or count[down, 'F'] < n:  # steady
    if count[down, 'F'] < n:
      act(down, 'F')
    act(down, 'I', 'W')
    act(up, 'F', 'I', 'W')
  for _ in range(r):  # cool-down
    act(down, 'I')
    act(up, 'I')
  for _ in range(p - r):
    act(down, 'I', 'W')
  for stage in (up, down):
    while count[stage, 'W'] < count[stage, 'I']:
      act(stage, 'W')
  return tuple(a for a in row if a.microbatch < m)
