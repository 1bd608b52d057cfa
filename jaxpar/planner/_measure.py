"""Predicted against measured: time candidates' steps for real.

``measure(plan, n, optimizer, batch)`` builds the trainers of ``n`` of the
plan's candidates spread over its predicted range (the best, then evenly
spaced places of the ranking down to the slowest that fits: a ranking is
only tested by candidates that differ) and of the best's ``RUNNERS_UP``
runners-up (a pick is only as good as the near-ties it beat: ``n + 2`` in
all, ``--measure 6`` times 8), compiles each step (what a
device holds at its peak, ``_compile.held_bytes``) and times them in rounds
(each one's fastest of ``repeats``, each the second of two steps in a row);
``summary`` gives the mean absolute time error and ``spearman``, the rank
correlation of two orders.

Example:
  >>> from jaxpar.planner import spearman
  >>> spearman([1.0, 2.0, 3.0, 4.0], [10.0, 30.0, 20.0, 40.0])
  0.8
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
import optax

from jaxpar.planner import _calibrate
from jaxpar.planner._compile import held_bytes
from jaxpar.planner._time import step_time
from jaxpar.planner._timing import own_device, rounds


class Measured(NamedTuple):
  """One candidate, predicted and measured.

  Attributes:
    candidate: the plan's ``Candidate``.
    seconds: measured seconds per step (the fastest of the repeats).
    memory_bytes: what a device holds at the compiled step's peak
      (``_compile.held_bytes``).
    retimed_s: the candidate's predicted seconds with the profile's block
      rates timed again in the candidates' rounds (``measure``); ``None``
      where the profile was not measured.
  """
  candidate: Any
  seconds: float
  memory_bytes: int
  retimed_s: float | None = None

  def row(self) -> dict:
    """For tables and JSON: ``time_error`` of the prediction as planned,
    ``retimed_error`` of ``retimed_s`` (``None`` without it)."""
    c = self.candidate
    return {'layout': c.layout.describe(), 'predicted_s': c.predicted_s,
            'measured_s': self.seconds,
            'time_error': c.predicted_s / self.seconds - 1,
            'retimed_s': self.retimed_s,
            'retimed_error': (None if self.retimed_s is None
                              else self.retimed_s / self.seconds - 1),
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


# The slowest candidate ``measure`` times, in predicted times of the best
# (a tensor-parallel step of 64 one-sequence microbatches over gloo takes
# minutes, and tells no more about the ranking than one at 3x).
SPREAD = 3.0


def _spread(candidates: Sequence, n: int) -> list:
  """``n`` fitting candidates spread over the predicted range: the best,
  then the one at each of ``n - 1`` evenly spaced places of the ranking by
  predicted time up to ``SPREAD`` times the best's (the slowest there
  last), each the nearest there of a mesh,
  schedule and microbatch count not taken yet (ZeRO and remat variants of
  one are near ties on a loaded machine), in rank order."""
  fits = sorted((c for c in candidates if c.fits),
                key=lambda c: c.predicted_s)
  fits = [c for c in fits if c.predicted_s <= SPREAD * fits[0].predicted_s]
  if len(fits) <= n:
    return fits
  key = lambda c: c.layout[:5]
  out, seen = [fits[0]], {key(fits[0])}
  for k in range(1, n):
    at = round(k * (len(fits) - 1) / (n - 1))
    order = sorted(range(len(fits)), key=lambda i: (abs(i - at), -i))
    pick = next((fits[i] for i in order if key(fits[i]) not in seen),
                next(fits[i] for i in order if fits[i] not in out))
    seen.add(key(pick))
    out.append(pick)
  return sorted(out, key=lambda c: c.predicted_s)


# The best's runners-up ``measure`` times besides the ``n`` spread: the next
# candidates by predicted time of a mesh, schedule and microbatch count not
# chosen yet.
RUNNERS_UP = 2


def chosen(candidates: Sequence, n: int) -> list:
  """What ``measure`` times: ``_spread``'s ``n`` and the best's
  ``RUNNERS_UP`` runners-up not among them, in rank order.

  Example:
    >>> from types import SimpleNamespace as C
    >>> from jaxpar.planner._measure import chosen
    >>> plan = [C(fits=True, predicted_s=t, layout=(1, 1, 1, 'x', m))
    ...         for m, t in enumerate((1.0, 1.01, 1.02, 1.5, 2.0, 2.5))]
    >>> [c.predicted_s for c in chosen(plan, 3)]
    [1.0, 1.01, 1.02, 1.5, 2.5]
  """
  out = _spread(candidates, n)
  taken = {c.layout[:5] for c in out}
  extra = []
  for c in sorted((c for c in candidates if c.fits),
                  key=lambda c: c.predicted_s):
    if len(extra) < RUNNERS_UP and c.layout[:5] not in taken:
      taken.add(c.layout[:5])
      extra.append(c)
  return sorted(out + extra, key=lambda c: c.predicted_s)


def measure(plan: Any, n: int, optimizer: optax.GradientTransformation,
            batch: Any, *, repeats: int = 5) -> list[Measured]:
  """Times ``n`` candidates of ``plan`` spread over its predicted range
  and the best's ``RUNNERS_UP`` runners-up (``chosen``; module doc): the
  fastest of ``repeats`` steps after one warm-up, and what a device holds
  at the compiled step's peak.

  The candidates are stepped in rounds, so that load from other work that
  comes and goes falls on all of them alike (timed one after another, the
  same step measured 2.1 s and 4.8 s twenty minutes apart on a shared
  machine). Each round runs a candidate's step twice and times the second,
  as training runs one step after another: on a CPU the first step after
  another program's pays to fault its memory back in (the largest
  temporaries, a 32-sequence microbatch, took 1.38 s against 1.01 s).
  Each round also times the calibration's one-rank programs again
  (``_calibrate.block_calls``), as the calibration did: with their rates,
  each candidate's ``Measured.retimed_s`` (the same code's calibrated rate
  at 8 sequences read 34.0 and 40.5 GFLOP/s in two runs an hour apart
  whose steps took the same time).
  """
  runs, again, samples = [], _block_calls(plan), []
  for candidate in chosen(plan.candidates, n):
    trainer = plan.trainer(optimizer, candidate)
    state = trainer.init(plan.params(candidate))
    # jit reuses this executable for the calls below: one compile each.
    nbytes = held_bytes(trainer.step.lower(state, batch).compile())
    state, _ = jax.block_until_ready(trainer.step(state, batch))
    runs.append((candidate, trainer.step, [state], [], nbytes))
  for _ in range(repeats):
    for _, step, state, times, _ in runs:
      state[0], _ = jax.block_until_ready(step(state[0], batch))
      start = time.perf_counter()
      state[0], _ = jax.block_until_ready(step(state[0], batch))
      times.append(time.perf_counter() - start)
    if again:
      samples.append(rounds(again, 1))
  retimed = _retimed(plan, samples, len(jax.tree.leaves(batch)[0]))
  return [Measured(c, min(times), nbytes, retimed(c))
          for c, _, _, times, nbytes in runs]


def _block_calls(plan: Any) -> list:
  """``_calibrate.block_calls`` on this process's first device of the
  plan, where its profile has measured block rates (else none)."""
  if plan.devices is None or not plan.profile.block_rates:
    return []
  return _calibrate.block_calls(plan.spec, own_device(plan.devices))


def _retimed(plan: Any, samples: list, batch: int) -> Callable:
  """``retimed(candidate)``: its predicted seconds with the block rates of
  ``samples`` (rounds of ``block_calls``' seconds; their median), or
  ``None`` without samples."""
  if not samples:
    return lambda candidate: None
  profile = plan.profile._replace(block_rates=_calibrate.block_rates(
      plan.spec, np.median(samples, axis=0)))
  return lambda candidate: step_time(plan.spec, candidate.layout,
                                     batch=batch, profile=profile,
                                     mem=candidate.memory).total


def summary(measured: Sequence[Measured], *, repeats: int = 5) -> dict:
  """``measure``'s rows and what they say: ``mean_abs_error`` (of the
  predicted time, relative to the measured), ``spearman`` (predicted
  against measured order), ``best_vs_fastest`` (the predicted best's
  measured time over the fastest measured, minus 1) and
  ``mean_abs_retimed_error`` (of ``Measured.retimed_s``: the time model's
  error at the block rates the machine ran the steps at; ``None``
  without them).

  Example:
    >>> from jaxpar.planner import Measured, summary
    >>> from types import SimpleNamespace as C
    >>> rows = [Measured(C(predicted_s=t, memory_bytes=1,
    ...                    layout=C(describe=lambda: 'x')), m, 1)
    ...         for t, m in ((1.0, 1.1), (2.0, 1.9), (3.0, 3.3))]
    >>> out = summary(rows)
    >>> round(out['mean_abs_error'], 3), out['spearman'], out['best_vs_fastest']
    (0.078, 1.0, 0.0)
  """
  rows = [m.row() for m in measured]
  retimed = [r['retimed_error'] for r in rows]
  first = min(rows, key=lambda r: r['predicted_s'])
  return {'rows': rows,
          'mean_abs_error': float(np.mean([abs(r['time_error'])
                                           for r in rows])),
          'mean_abs_retimed_error': None if None in retimed else float(
              np.mean(np.abs(retimed))),
          'spearman': spearman([r['predicted_s'] for r in rows],
                               [r['measured_s'] for r in rows]),
          'best_vs_fastest': first['measured_s'] / min(
              r['measured_s'] for r in rows) - 1,
          'how': f'the fastest of {repeats} rounds, each the second of two '
                 'steps in a row; memory: the compiled peak, arguments + '
                 'outputs + temp - aliased'}
