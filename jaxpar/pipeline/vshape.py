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
import functools

from jaxpar.pipeline import _greedy
from jaxpar.pipeline._action import Action, check_sizes
from jaxpar.pipeline.schedule import Schedule

# Per-logical-stage costs the V-Half / V-Min orders are built for: half of
# the default 1F1B stage costs, F = I = W.
_V_COSTS = {'F': 0.5, 'B': 1.0, 'I': 0.5, 'W': 0.5}


def v_placement(num_ranks: int) -> tuple[int, ...]:
  """Rank of each of the ``2p`` logical stages of a V: ``0..p-1, p-1..0``.

  Example:
    >>> v_placement(3)
    (0, 1, 2, 2, 1, 0)
  """
  p = num_ranks
  return tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))


def dualpipev(num_ranks: int, num_microbatches: int) -> Schedule:
  """DualPipeV: DeepSeek's DualPipe cut in half (torch's ``ScheduleDualPipeV``).

  Rank ``r`` holds stage ``r`` (phase 0, on the way down) and stage
  ``2p-1-r`` (phase 1, on the way up) and runs DeepSeek's eight steps for
  ``n = max(m, 2p)`` microbatches (those ``>= m`` dropped, as ``zbv`` does):

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
    >>> s = dualpipev(2, 4)
    >>> [str(a) for a in s.actions[1]][:8]
    ['1F0', '2F0', '1F1', '2F1', '1F2', '2B0', '2F2', '1B0']
  """
  check_sizes('dualpipev', num_ranks=num_ranks,
              num_microbatches=num_microbatches)
  p, m = int(num_ranks), int(num_microbatches)
  rows = tuple(_dualpipev_row(r, p, m) for r in range(p))
  return Schedule(p, 2 * p, m, v_placement(p), rows, 'DualPipeV').validate()


def _dualpipev_row(r: int, p: int, m: int) -> tuple[Action, ...]:
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


def _capped_v(fn: str, num_ranks: int, num_microbatches: int, divisor: int,
              name: str) -> Schedule:
  """The fastest greedy V order within ``(p + 2(d-1)) // d`` stage units."""
  check_sizes(fn, num_ranks=num_ranks, num_microbatches=num_microbatches)
  return _fastest_v(int(num_ranks), int(num_microbatches), divisor, name)


@functools.lru_cache(maxsize=64)  # Schedules are immutable; search reuses
def _fastest_v(p: int, m: int, divisor: int, name: str) -> Schedule:
  units = (p + 2 * (divisor - 1)) // divisor
  best = None
  for policy in _greedy.POLICIES:
    s = _greedy.schedule(p, m, v_placement(p), 2 * units, _V_COSTS, policy,
                         name=name)
    if s is not None:
      time = s.simulate(_V_COSTS).makespan
      if best is None or time < best[0]:
        best = (time, s)
  return best[1].validate()


def v_half(num_ranks: int, num_microbatches: int) -> Schedule:
  """V-Half (Qi et al. 2024): a V schedule holding about half of 1F1B's memory.

  The paper's budget for V-Half is ``(p+2)//2`` 1F1B-stage activations per
  rank (1F1B's rank 0 holds ``p``), i.e. ``2((p+2)//2)`` logical-stage
  stashes, each held from its forward until its weight gradient ``W`` has
  run. This builds the V order with jaxpar's memory-capped list scheduler
  (the engine of ``search``) at that budget, for ``F = I = W``: the paper's
  bubble is about ``p/(2m)`` of the step, against ``p/m`` for 1F1B; the
  simulated makespan here is no larger than 1F1B's (tested for ``p <= 8``,
  ``m`` from ``2p`` to ``4p``).

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'V-Half'``, with ``2p`` stages.

  Example:
    >>> s = v_half(4, 8)
    >>> max(jaxpar.pipeline.peak_memory(s)), s.num_stages   # (p+2)//2 = 3
    (3.0, 8)
  """
  return _capped_v('v_half', num_ranks, num_microbatches, 2, 'V-Half')


def v_min(num_ranks: int, num_microbatches: int) -> Schedule:
  """V-Min (Qi et al. 2024): a V schedule holding a third of 1F1B's memory.

  The paper's budget for V-Min is ``(p+4)//3`` 1F1B-stage activations per
  rank, i.e. ``2((p+4)//3)`` logical-stage stashes held from forward to
  ``W``; built like ``v_half`` at that budget. The paper's hand-made
  building block reaches a bubble of about ``2p/(3m)`` of the step; this
  list-scheduled order matches 1F1B's time for ``p`` in 2, 3, 5 but pays up
  to 15% more for others (``p = 4, m = 16``: 65 against 57 with ``F = 1,
  B = 2`` per 1F1B stage), the price of a third of the memory.

  Args:
    num_ranks: ``p >= 1``.
    num_microbatches: ``m >= 1``.

  Returns:
    The validated ``Schedule`` named ``'V-Min'``, with ``2p`` stages.

  Example:
    >>> s = v_min(4, 8)
    >>> max(jaxpar.pipeline.peak_memory(s))   # (p+4)//3 = 2
    2.0
  """
  return _capped_v('v_min', num_ranks, num_microbatches, 3, 'V-Min')
