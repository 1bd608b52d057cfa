"""Pipeline schedules as data: ``Action`` and ``Schedule``."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

KINDS = ('F', 'B', 'I', 'W')


class Action(NamedTuple):
  """One compute action: ``kind`` of logical ``stage`` on ``microbatch``."""
  stage: int
  kind: str
  microbatch: int

  def __str__(self) -> str:
    return f'{self.stage}{self.kind}{self.microbatch}'


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline schedule: per-rank ordered compute actions."""
  num_ranks: int
  num_stages: int
  num_microbatches: int
  placement: tuple[int, ...]
  actions: tuple[tuple[Action | None, ...], ...]
  name: str = 'custom'
