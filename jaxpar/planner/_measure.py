"""Predicted against measured: time the top candidates' steps for real.

``measure(plan, n, optimizer, batch)`` builds the trainers of ``n`` of the
plan's best candidates, the best of each mesh and microbatch count first
(then of each schedule too: candidates that differ only in ZeRO stage or
remat policy differ by less than a loaded machine's noise), compiles each step
(its ``memory_analysis()``: arguments + temp) and times them in rounds
(each one's fastest of ``repeats``, each the second of two steps in a
row); ``spearman`` is the
rank correlation of two orders.

Example:
  >>> from jaxpar.planner import spearman
  >>> spearman([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0])
  0.8
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax


class Measured(NamedTuple):
  """One candidate, predicted and measured.

  Attributes:
    candidate: the plan's ``Candidate``.
    seconds: measured seconds per step (the fastest of the repeats).
    memory_bytes: the compiled step's arguments + temp per device.
  """
  candidate: Any
  seconds: float
  memory_bytes: int

  def row(self) -> dict:
    """For tables and JSON."""
    c = self.candidate
    return {'layout': c.layout.describe(), 'predicted_s': c.predicted_s,
            'measured_s': self.seconds,
            'time_error': c.predicted_s / self.seconds - 1,
            'predicted_bytes': c.memory_bytes,
            'compiled_bytes': self.memory_bytes,
            'memory_error': c.memory_bytes / self.memory_bytes - 1}


def _ranks(values: Sequence[float]) -> np.ndarray:
  order = np.argsort(np.asarray(values), kind='stable')
  ranks = np.empty(len(values))
  ranks[order] = np.arange(len(values))
  return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
  """Spearman's rank correlation of ``a`` and ``b`` (ties: stable order)."""
  ra, rb = _ranks(a), _ranks(b)
  if len(a) < 2:
    return 1.0
  return float(np.corrcoef(ra, rb)[0, 1])


# What makes two candidates worth timing apart, most telling first: the
# mesh and microbatch count (the microbatch size moves a CPU's block rate by
# 2x), then the schedule too (on a few ranks the schedules of one mesh and
# microbatch count measure within a few percent: near ties).
_DISTINCT = (lambda x: (x.data, x.stage, x.tensor, x.num_microbatches),
             lambda x: x[:5])


def _diverse(candidates: Sequence, n: int) -> list:
  """``n`` fitting candidates: the best of each mesh and microbatch count,
  then of each mesh, schedule and microbatch count, in rank order."""
  fits = [c for c in candidates if c.fits]
  out = []
  for key in _DISTINCT:
    seen = {key(c.layout) for c in out}
    for c in fits:
      if len(out) < n and key(c.layout) not in seen and c not in out:
        seen.add(key(c.layout))
        out.append(c)
  return sorted(out, key=candidates.index)


def measure(plan: Any, n: int, optimizer: optax.GradientTransformation,
            batch: Any, *, repeats: int = 5) -> list[Measured]:
  """Times ``n`` of the best candidates of ``plan`` (module doc): the
  fastest of ``repeats`` steps after one warm-up, and the compiled step's
  arguments + temp.

  The candidates are stepped in rounds, so that load from other work that
  comes and goes falls on all of them alike (timed one after another, the
  same step measured 2.1 s and 4.8 s twenty minutes apart on a shared
  machine). Each round runs a candidate's step twice and times the second,
  as training runs one step after another: on a CPU the first step after
  another program's pays to fault its memory back in (the largest
  temporaries, a 32-sequence microbatch, took 1.38 s against 1.01 s).
  """
  runs = []
  for candidate in _diverse(plan.candidates, n):
    trainer = plan.trainer(optimizer, candidate)
    state = trainer.init(plan.params(candidate))
    # jit reuses this executable for the calls below: one compile each.
    mem = trainer.step.lower(state, batch).compile().memory_analysis()
    state, _ = jax.block_until_ready(trainer.step(state, batch))
    runs.append((candidate, trainer.step, [state], [],
                 int(mem.argument_size_in_bytes + mem.temp_size_in_bytes)))
  for _ in range(repeats):
    for _, step, state, times, _ in runs:
      state[0], _ = jax.block_until_ready(step(state[0], batch))
      start = time.perf_counter()
      state[0], _ = jax.block_until_ready(step(state[0], batch))
      times.append(time.perf_counter() - start)
  return [Measured(c, min(times), nbytes) for c, _, _, times, nbytes in runs]
