"""Pipeline schedules: simulated bubble fraction against the closed forms.

Section ``bubble``: for each schedule and a few ``(p, m)``, the event-driven
simulation with the default costs ``F = 1, B = 2, I = W = 1`` next to its
closed form (all exact here: GPipe/1F1B ``(p-1)/(m+p-1)``, interleaved
``(p-1)/(v m+p-1)``, ZB-H1 ``(p-1)/(3m+p-1)`` for ``m >= p``, ZB-V
``(p-1)/(6m+p-1)`` for ``m >= 2p-1``), the peak stashes, and the time the
``O(actions)`` simulation takes.
"""

from __future__ import annotations

from jaxpar.bench._timing import median_seconds
from jaxpar.pipeline import constructors as sched

V = 2  # interleaved chunks per rank


def _cases(p: int, m: int):
  """``(schedule, closed-form bubble fraction)`` for one ``(p, m)``."""
  yield sched.gpipe(p, m), (p - 1) / (m + p - 1)
  yield sched.one_f_one_b(p, m), (p - 1) / (m + p - 1)
  yield sched.interleaved_1f1b(p, m, V), (p - 1) / (V * m + p - 1)
  yield sched.zero_bubble_h1(p, m), (p - 1) / (3 * m + p - 1)
  yield sched.zbv(p, m), (p - 1) / (6 * m + p - 1)


def run(*, quick: bool) -> dict[str, list[dict]]:
  """Rows of the ``bubble`` section (``m`` a multiple of ``p``, ``>= 2p``)."""
  sizes = ([(4, 8), (4, 32), (8, 16)] if quick else
           [(2, 4), (2, 16), (4, 8), (4, 32), (8, 16), (8, 64), (16, 32),
            (16, 128)])
  rows = []
  for p, m in sizes:
    for s, closed in _cases(p, m):
      r = s.simulate()
      rows.append({
          'schedule': s.name, 'p': p, 'm': m, 'stages': s.num_stages,
          'actions': sum(len(row) for row in s.actions),
          'makespan': r.makespan,
          'bubble_sim': r.bubble_fraction, 'bubble_closed_form': closed,
          'exact': abs(r.bubble_fraction - closed) < 1e-12,
          'peak_activations': max(r.peak_activations),
          'peak_weight_grad_stash': max(r.peak_weight_grad_stash),
          'simulate_ms': 1e3 * median_seconds(
              lambda s=s: s.simulate().makespan, repeats=3),
      })
  return {'bubble': rows}
