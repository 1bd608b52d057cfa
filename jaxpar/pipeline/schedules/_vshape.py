"""V-shaped schedules: DualPipeV, V-Half and V-Min.

All three cut the model into ``2p`` logical stages placed in a V: stage ``k``
on rank ``k`` for ``k < p`` and on rank ``2p-1-k`` otherwise, as ZB-V does.
Rank 0 holds the first and the last stage, and the activation turns around on
rank ``p-1`` without communication. Costs below are per logical stage (half a
1F1B stage), memory is counted in stashes of one logical stage (two make one
1F1B stage's activations).
"""

from __future__ import annotations

import collections

from jaxpar.pipeline.schedules import _building_block
from jaxpar.pipeline.schedules._action import Action, check_sizes
from jaxpar.pipeline.schedules._schedule import Schedule

def v_placement(num_ranks: int) -> tuple[int, ...]:
  """Rank of each of the ``2p`` logical stages of a V: ``0..p-1, p-1..0``.

  Example:
    >>> from jaxpar.pipeline.schedules._vshape import v_placement
    >>> v_placement(3)
    (0, 1, 2, 2, 1, 0)
  """
  p = num_ranks
  return tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))


def dualpipe_v(num_ranks: int, num_microbatches: int) -> Schedule:
  """DualPipeV: DeepSeek's DualPipe cut in half (torch's ``ScheduleDualPipeV``).

  Rank ``r`` holds stage ``r`` (phase 0, on the way down) and stage
  ``2p-1-r`` (phase 1, on the way up) and runs DeepSeek's eight steps for
  ``n = max(m, 2p)`` microbatches (those ``>= m`` dropped, as
  ``zero_bubble_v`` does):

  1. ``2(p-r-1)`` forwards of phase 0;
  2. ``r+1`` pairs ``F0, F1``;
  3. ``p-r-1`` triples ``I1, W1, F1`` (zero bubble: ``W`` right away);
  4. ``n-2p+r+1`` rounds ``F0 & B1``, ``F1 & B0`` (the main step);
  5. ``p-r-1`` rounds ``B1``, ``F1 & B0``;
  6. ``r+1`` pairs ``B1, B0``, the second half split into ``I`` (weight
     gradients deferred);
  7. ``p-r-1`` pairs ``W, I0``;
  8. the ``r+1`` remaining ``W``, first in first out.

  ``F & B`` is DualPipe's overlapped pair: a forward of one microbatch and a
  backward of another, whose compute and communication DeepSeek's kernels
  overlap so that the pair costs about ``max(F, B)``; DeepSeek's bubble
  ``(PP/2-1)(F&B + B - 3W)`` assumes that overlap. jaxpar's executor runs one
  action at a time, so here a pair is its forward then its backward and costs
  ``F + B``. What DualPipeV still gives: with ``F = I = W`` per logical stage
  (``B = 2F``) and ``m >= 2p`` every rank idles ``(p-1) F`` (makespan
  ``6mF + (p-1)F``, ZB-V's), against 1F1B's ``(p-1)(F+B)`` per 1F1B stage, i.e.
  ``6(p-1)F`` in these units; full backwards ``B`` in the steady state (one
  kernel, no ``I``/``W`` recompute); and ``2p+1`` logical-stage stashes on
  every rank (``p + 1/2`` 1F1B stages: DualPipe's ``PP+1``). The communication
  hiding of the overlap is not gained.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1`` (DeepSeek asks ``m >= 2p``; smaller ``m``
      keeps the first ``m`` microbatches of the ``2p`` order).

  Returns:
    The validated ``Schedule`` named ``'DualPipeV'``, with ``2p`` stages.

  Example:
    >>> from jaxpar.pipeline import dualpipe_v
    >>> s = dualpipe_v(2, 4)
    >>> [str(a) for a in s.actions[1]][:8]
    ['1F0', '2F0', '1F1', '2F1', '1F2', '2B0', '2F2', '1B0']
  """
  check_sizes('dualpipe_v', num_ranks=num_ranks,
              num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = tuple(_dualpipe_v_row(r, p, m) for r in range(p))
  return Schedule(p, 2 * p, m, v_placement(p), rows, 'DualPipeV').validate()


def _dualpipe_v_row(r: int, p: int, m: int) -> tuple[Action, ...]:
  """Rank ``r`` of DualPipeV (DeepSeek's ``DualPipeV.step`` steps 1-8)."""
  n = max(m, 2 * p)
  stage = (r, 2 * p - 1 - r)  # phase 0 and phase 1
  count = collections.Counter()
  deferred = collections.deque()  # DeepSeek's WeightGradStore queue
  row = []

  def forward(phase: int):
    row.append(Action(stage[phase], 'F', count['F', phase]))
    count['F', phase] += 1

  def backward(phase: int, split: bool = False):
    i = count['B', phase]
    count['B', phase] += 1
    if split:
      row.append(Action(stage[phase], 'I', i))
      deferred.append(Action(stage[phase], 'W', i))
    else:
      row.append(Action(stage[phase], 'B', i))

  def weight():
    row.append(deferred.popleft())

  for _ in range(2 * (p - r - 1)):  # 1: nF0
    forward(0)
  for _ in range(r + 1):  # 2: nF0F1
    forward(0)
    forward(1)
  for _ in range(p - r - 1):  # 3: nB1W1F1
    backward(1, split=True)
    weight()
    forward(1)
  for _ in range(n - 2 * p + r + 1):  # 4: nF0B1F1B0
    forward(0)
    backward(1)
    forward(1)
    backward(0)
  for _ in range(p - r - 1):  # 5: nB1F1B0
    backward(1)
    forward(1)
    backward(0)
  split = False
  for i in range(r + 1):  # 6: nB1B0, the second half split
    split = split or (i == (r + 1) // 2 and r % 2 == 1)
    backward(1, split)
    split = split or (i == (r + 1) // 2 and r % 2 == 0)
    backward(0, split)
  for _ in range(p - r - 1):  # 7: nWB0
    weight()
    backward(0, split=True)
  while deferred:  # 8: nW
    weight()
  return tuple(a for a in row if a.microbatch < m)


def _grown(fn: str, num_ranks: int, num_microbatches: int, block, name: str
           ) -> Schedule:
  """The schedule grown from the building block ``block(p)``."""
  check_sizes(fn, num_ranks=num_ranks, num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = _building_block.rows(block(p), m)
  return Schedule(p, 2 * p, m, v_placement(p), rows, name).validate()


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
  """V-Half (Qi et al. 2024): a V schedule holding half of 1F1B's memory.

  Built as the paper builds it (``_building_block``): its building block
  sends the forward down the V two slots a stage and up one slot a stage, is
  repeated every 6 slots (``2F + 2I + 2W`` per microbatch and rank, one slot a
  pass of one logical stage), the weight gradients ``W`` fill the empty
  slots, and the warm-up and cool-down are squeezed without raising the
  peak memory.

  Memory (the paper's table): ``(p+2)//2`` 1F1B-stage activations per rank,
  held from ``F`` until ``W`` (1F1B's rank 0 holds ``p``); exactly that for
  ``m >= p``. Bubble with ``F = I = W``: the paper's ``~ p/(2m)`` of the step,
  i.e. about ``3p`` slots (half a 1F1B stage's ``F``) per rank; the makespan
  is ``6m + 6*ceil(p/2) - 7`` slots for ``p >= 3`` and ``m >= 2p``, against
  1F1B's ``6m + 6(p-1)``: never larger than 1F1B's, for any ``m`` (tested for
  ``p <= 8``).

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'V-Half'``, with ``2p`` stages.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import v_half
    >>> s = v_half(4, 8)
    >>> max(jaxpar.pipeline.peak_memory(s)), s.num_stages   # (p+2)//2 = 3
    (3.0, 8)
    >>> s.simulate({'F': 1, 'I': 1, 'W': 1}).makespan     # 6m + 6*2 - 7
    53.0
  """
  return _grown('v_half', num_ranks, num_microbatches,
                _building_block.v_half_block, 'V-Half')


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
  """V-Min (Qi et al. 2024): a V schedule holding a third of 1F1B's memory.

  Built as ``v_half`` from the paper's V-Min block: the forward goes down and
  up the V one slot a stage and the input gradient comes straight back (after
  2 more slots when ``3 | p``), so a microbatch lives ``4p`` slots on rank 0.

  Memory (the paper's table): ``(p+4)//3`` 1F1B-stage activations per rank
  (exactly, for ``m >= p``). Bubble with ``F = I = W``: the paper's
  ``~ 2p/(3m)`` of the step, about ``4p`` slots per rank; the makespan is
  ``6m + 4p - 5`` slots (``6m + 4p - 7`` when ``3 | p`` and ``m >= p``),
  below 1F1B's ``6m + 6(p-1)`` for every ``p >= 2`` (tested for ``p <= 8``).
  With unequal costs the steady state keeps the block's slot pattern, so a
  slow kind stretches it (the paper's "repeating bubbles"): see the
  ``frontier`` bench.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'V-Min'``, with ``2p`` stages.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline import v_min
    >>> s = v_min(4, 8)
    >>> max(jaxpar.pipeline.peak_memory(s))   # (p+4)//3 = 2
    2.0
    >>> s.simulate({'F': 1, 'I': 1, 'W': 1}).makespan   # 6m + 4p - 5
    59.0
  """
  return _grown('v_min', num_ranks, num_microbatches,
                _building_block.v_min_block, 'V-Min')
