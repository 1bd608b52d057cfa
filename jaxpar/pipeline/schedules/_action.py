"""The leaf of the schedule modules: ``Action``, its kinds and int checks.

``schedule``, ``simulate``, ``plot``, the constructors and ``tick_table`` all
import this module and it imports none of them, so the schedule modules form
no import circle. ``ScheduleLike`` names the fields of a ``Schedule`` that the
timing and drawing functions read, so that they need not import ``Schedule``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from jaxpar._validate import check_int

KINDS = ('F', 'B', 'I', 'W')
_ACTION_RE = re.compile(r'(\d+)([FBIW])(\d+)')


class Action(NamedTuple):
  """One compute action: ``kind`` of logical ``stage`` on ``microbatch``.

  ``kind`` is ``'F'`` (forward), ``'B'`` (full backward), ``'I'`` (input
  gradient half of the backward) or ``'W'`` (weight gradient half). The string
  form is PyTorch's: stage, kind, microbatch.

  Example:
    >>> from jaxpar.pipeline import Action
    >>> str(Action(0, 'F', 3))
    '0F3'
    >>> Action.parse('4B1')
    Action(stage=4, kind='B', microbatch=1)
  """
  stage: int
  kind: str
  microbatch: int

  def __str__(self) -> str:
    return f'{self.stage}{self.kind}{self.microbatch}'

  @classmethod
  def parse(cls, text: str) -> Action:
    """The action written as ``'<stage><kind><microbatch>'``, e.g. ``'2I0'``.

    Raises:
      ValueError: if ``text`` is not of that form.
    """
    match = (_ACTION_RE.fullmatch(text.strip()) if isinstance(text, str)
             else None)
    if match is None:
      raise ValueError(
          f'Action.parse({text!r}): expected <stage><kind><microbatch> with '
          f'kind one of {"/".join(KINDS)}, e.g. "0F3" or "2W1" (PyTorch '
          'communication actions such as SEND_F or REDUCE_GRAD are not '
          'compute actions).')
    return cls(int(match[1]), match[2], int(match[3]))


class ScheduleLike(Protocol):
  """What ``simulate`` and ``plot`` read of a ``Schedule``."""
  num_ranks: int
  num_stages: int
  num_microbatches: int
  placement: tuple[int, ...]
  actions: Sequence[Sequence[Action | None]]
  name: str

  def validate(self) -> ScheduleLike:
    ...


def as_int(value: object, what: str) -> int:
  """``value`` as a plain int (numpy integers too); ``TypeError`` otherwise.

  ``True``/``False`` are refused: a bool is never a size
  (``jaxpar._validate.check_int`` with no minimum).
  """
  return check_int(what, value, minimum=None)


def check_sizes(fn: str, **sizes: object) -> str:
  """Checks that every size is an int >= 1; returns ``fn(k=v, ...)``.

  NumPy integers are accepted; bools and floats raise ``TypeError``, values
  below 1 ``ValueError`` naming the nearest valid choice.
  """
  call = f'{fn}({", ".join(f"{k}={v!r}" for k, v in sizes.items())})'
  for key, value in sizes.items():
    try:
      value = as_int(value, key)
    except TypeError:
      raise TypeError(f'{call}: {key} must be an int, got '
                      f'{type(value).__name__}.') from None
    if value < 1:
      raise ValueError(f'{call}: {key}={value} must be >= 1; nearest valid '
                       f'choice: {key}=1.')
  return call
