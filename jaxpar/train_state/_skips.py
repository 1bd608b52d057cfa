"""The skip guard: stop a run after too many non-finite steps in a row.

Every jaxpar train step skips an update whose loss or gradient is not finite
(``StepStats.skipped``): one bad batch costs one step. Many in a row mean
the run has diverged (or the data is broken) and further steps only burn
time. ``count_skipped`` keeps the count in a small NamedTuple and raises
``TooManySkippedError`` after ``max_skipped`` consecutive skips, so the loop
stops before it saves anything: the last good checkpoint stays the newest
(``jaxpar.checkpoint.save`` also refuses non-finite params).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from jaxpar._validate import check_int
from jaxpar.train_state._state import StepStats


class SkipCount(NamedTuple):
  """Skipped steps so far: the current run of consecutive ones, and all."""
  consecutive: int = 0
  total: int = 0


class TooManySkippedError(RuntimeError):
  """``max_skipped`` consecutive steps were skipped as non-finite."""


def count_skipped(count: SkipCount, skipped: StepStats | Any, *,
                  max_skipped: int = 5, step: int | None = None) -> SkipCount:
  """Adds one step to ``count``; raises after ``max_skipped`` skips in a row.

  Args:
    count: the count so far (``SkipCount()`` to start).
    skipped: the step's ``StepStats`` (its ``skipped`` field is read: one
      host sync) or a bool.
    max_skipped: consecutive skipped steps allowed, an int ``>= 1``.
    step: the step number, for the message.

  Returns:
    The new ``SkipCount``.

  Raises:
    TooManySkippedError: the ``max_skipped``-th consecutive skipped step.
    TypeError / ValueError: a bad ``count``, ``skipped`` or ``max_skipped``.

  Example:
    >>> import jaxpar
    >>> c = jaxpar.count_skipped(jaxpar.SkipCount(), True)
    >>> c.consecutive, c.total
    (1, 1)
  """
  if not isinstance(count, SkipCount):
    raise TypeError(f'count must be a jaxpar.SkipCount (start with '
                    f'SkipCount()), got {type(count).__name__}.')
  max_skipped = check_int(
      'max_skipped', max_skipped,
      fix='It counts the consecutive skipped steps allowed.')
  flag = skipped.skipped if isinstance(skipped, StepStats) else skipped
  if np.ndim(flag) != 0 or np.asarray(flag).dtype != bool:
    raise TypeError(f'skipped must be a StepStats or a bool, got '
                    f'{type(skipped).__name__}: {skipped!r}.')
  if not bool(flag):
    return SkipCount(0, count.total)
  count = SkipCount(count.consecutive + 1, count.total + 1)
  if count.consecutive >= max_skipped:
    at = '' if step is None else f', the last at step {step}'
    raise TooManySkippedError(
        f'{count.consecutive} consecutive steps were skipped (non-finite loss '
        f'or gradients){at}; stopped (max_skipped={max_skipped}). The params '
        'are those of the last good step (skipped steps leave them as they '
        'were); lower the learning rate, check the data for NaN/inf, or raise '
        'max_skipped.')
  return count
