"""The pipeline schedule as a value: ``Schedule``, validation, PyTorch CSV.

A schedule says, for every rank of the pipeline, which compute actions it runs
and in which order. Dependencies between actions are implied by the actions
themselves (``S = num_stages``):

* ``F(s, i)`` needs ``F(s-1, i)`` for ``s > 0`` (the activation from upstream);
* ``B(s, i)`` / ``I(s, i)`` need ``F(s, i)`` (the stash) and, for ``s < S-1``,
  the input gradient ``B(s+1, i)`` or ``I(s+1, i)``; the last stage computes
  the loss, so its backward needs only its own forward;
* ``W(s, i)`` needs ``I(s, i)``.

Each rank runs its actions strictly in order, so a schedule is correct when
every action appears once, on the rank its stage is placed on, and the ranks
never wait for each other in a cycle. ``Schedule.validate`` proves exactly
that. The constructors live in ``constructors`` (GPipe, 1F1B, interleaved,
ZB-H1, ZB-V) and ``vshape`` (V-Half, V-Min, DualPipeV); ``search`` finds the
fastest schedule under a memory cap.
"""

from __future__ import annotations

import csv
import dataclasses
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from jaxpar.pipeline.schedules import _plot
from jaxpar.pipeline.schedules import _simulate
from jaxpar.pipeline.schedules._action import KINDS, Action, as_int

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

# What each rule of ``Schedule.validate`` demands (``ScheduleError.rule``).
RULES = {
    'structure': 'placement has num_stages entries in [0, num_ranks) and '
                 'actions has one row per rank',
    'range': 'every action has a stage in [0, num_stages), a kind in F/B/I/W '
             'and a microbatch in [0, num_microbatches)',
    'placement': 'every action runs on the rank its stage is placed on',
    'duplicate': 'every action appears at most once',
    'missing': 'every (stage, microbatch) has one F and either one B or one I '
               'and one W',
    'split': 'a (stage, microbatch) uses either B or the I/W pair, not both',
    'order': 'on one rank, an action comes after the actions it depends on',
    'deadlock': 'the ranks, each running its actions in order, finish',
}
MAX_ERROR_COLUMNS = 24  # error grids show a window around the offending cell

class ScheduleError(ValueError):
  """A schedule breaks one of the rules of ``Schedule.validate``.

  Attributes:
    rule: the broken rule, a key of ``RULES`` (e.g. ``'order'``).
    action: the offending action (``None`` for structural problems).
    rank: its rank, or ``None``.
    step: its position in that rank's action list, or ``None``.
  """

  def __init__(self, message: str, *, rule: str,
               action: Action | None = None, rank: int | None = None,
               step: int | None = None):
    super().__init__(message)
    self.rule = rule
    self.action = action
    self.rank = rank
    self.step = step


def _as_action(cell: object, rank: int, step: int) -> Action | None:
  if cell is None:
    return None
  if isinstance(cell, str):
    return Action.parse(cell)
  if isinstance(cell, tuple) and len(cell) == 3:
    where = f'Schedule.actions[{rank}][{step}]'
    return Action(as_int(cell[0], f'{where}.stage'), cell[1],
                  as_int(cell[2], f'{where}.microbatch'))
  raise TypeError(
      f'Schedule.actions[{rank}][{step}] = {cell!r}: expected an Action, a '
      'string like "0F3", or None for an idle slot.')


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A pipeline schedule: the ordered compute actions of every rank.

  Attributes:
    num_ranks: ``p``, the number of pipeline ranks (devices on the stage axis).
    num_stages: ``S``, the number of logical stages in model order
      (``S = p`` for GPipe/1F1B, ``v * p`` for interleaved, ``2p`` for ZB-V).
    num_microbatches: ``m``, the number of microbatches per step.
    placement: ``placement[s]`` is the rank holding logical stage ``s``.
    actions: ``actions[r]`` is rank ``r``'s tuple of ``Action`` in execution
      order; ``None`` is an explicit idle slot (kept for display and CSV
      round trips; timing treats waiting as implied by dependencies).
    name: a label for printing and plots.

  Lists, numpy integers, ``(stage, kind, microbatch)`` tuples and strings
  like ``'0F3'`` are accepted and normalised to ints and tuples of
  ``Action``. Constructors return validated schedules; call ``validate()`` on
  hand-made ones.

  Example:
    >>> import jaxpar
    >>> s = jaxpar.pipeline.one_f_one_b(2, 3)
    >>> [str(a) for a in s.actions[1]]
    ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2']
    >>> s.simulate(costs={'F': 1, 'B': 1}).bubble_fraction   # (p-1)/(m+p-1)
    0.25
  """
  num_ranks: int
  num_stages: int
  num_microbatches: int
  placement: tuple[int, ...]
  actions: tuple[tuple[Action | None, ...], ...]
  name: str = 'custom'

  def __post_init__(self):
    for field in ('num_ranks', 'num_stages', 'num_microbatches'):
      object.__setattr__(self, field, as_int(getattr(self, field),
                                              f'Schedule.{field}'))
    placement = tuple(as_int(rank, f'Schedule.placement[{stage}]')
                      for stage, rank in enumerate(self.placement))
    actions = tuple(
        tuple(_as_action(cell, r, t) for t, cell in enumerate(row))
        for r, row in enumerate(self.actions))
    object.__setattr__(self, 'placement', placement)
    object.__setattr__(self, 'actions', actions)

  def __str__(self) -> str:
    return self.render(timed=False)

  # --- validation -----------------------------------------------------------

  def validate(self) -> Schedule:
    """Proves the schedule runs: counts, placement, order, no deadlock.

    Checks, in this order, the rules in ``RULES``: structure, range,
    placement, duplicate, missing, split, order (same-rank dependencies, e.g.
    ``F`` before its ``B``/``I``, ``I`` before its ``W``), and deadlock (a
    dependency simulation across ranks, each running its actions in order,
    completes). ``O(actions)``.

    Returns:
      ``self``, so that ``schedule = Schedule(...).validate()`` chains.

    Raises:
      ScheduleError: naming the broken rule and the action, with the rank x
        step grid and the offending cell marked like ``[1B0]``.

    Example:
      >>> import jaxpar
      >>> jaxpar.pipeline.gpipe(4, 8).validate().num_stages
      4
    """
    self._check_structure()
    where: dict[Action, tuple[int, int]] = {}
    for rank, row in enumerate(self.actions):
      for step, action in enumerate(row):
        if action is None:
          continue
        self._check_action(action, rank, step)
        if action in where:
          r0, t0 = where[action]
          self._fail('duplicate', f'{action} appears twice: at rank {r0} step '
                     f'{t0} and at rank {rank} step {step}',
                     'remove one of them', action, rank, step)
        where[action] = (rank, step)
    self._check_counts(where)
    graph = _simulate.dependency_graph(self)
    for action, deps in graph.items():
      rank, step = where[action]
      for dep in deps:
        dep_rank, dep_step = where[dep]
        if dep_rank == rank and dep_step > step:
          self._fail('order', f'rank {rank} runs {action} at step {step} but '
                     f'its dependency {dep} only at step {dep_step}',
                     f'move {dep} before {action} on rank {rank}',
                     action, rank, step)
    stuck = _simulate.blocked(self, graph)
    if stuck:
      waits = '; '.join(
          f'rank {r} waits at step {t} ({self.actions[r][t]}) for {dep} on '
          f'rank {where[dep][0]}' for r, t, dep in stuck)
      r, t, _ = stuck[0]
      self._fail('deadlock', f'the ranks wait for each other: {waits}',
                 'reorder the actions so that each awaited action can run '
                 'first (compare with one_f_one_b)',
                 self.actions[r][t], r, t, marks=[(r, t) for r, t, _ in stuck])
    return self

  def _fail(self, rule: str, what: str, fix: str, action: Action | None = None,
            rank: int | None = None, step: int | None = None,
            marks: list[tuple[int, int]] | None = None):
    if marks is None:
      marks = [] if step is None else [(rank, step)]
    grid = _plot.format_grid(
        [['' if a is None else str(a) for a in row] for row in self.actions],
        marks=marks, max_columns=MAX_ERROR_COLUMNS) if self.actions else ''
    raise ScheduleError(
        f'Schedule {self.name!r} (p={self.num_ranks}, stages='
        f'{self.num_stages}, m={self.num_microbatches}) breaks rule {rule!r} '
        f'({RULES[rule]}): {what}. Fix: {fix}.\n{grid}',
        rule=rule, action=action, rank=rank, step=step)

  def _check_structure(self):
    p, s, m = self.num_ranks, self.num_stages, self.num_microbatches
    if p < 1 or s < 1 or m < 1:
      self._fail('structure', f'num_ranks={p}, num_stages={s}, '
                 f'num_microbatches={m} must all be >= 1',
                 'pass positive sizes')
    if len(self.placement) != s:
      self._fail('structure', f'placement has {len(self.placement)} entries '
                 f'for num_stages={s}', 'give one rank per logical stage')
    for stage, rank in enumerate(self.placement):
      if not 0 <= rank < p:
        self._fail('structure', f'placement[{stage}]={rank} is not a rank in '
                   f'[0, {p})', f'place stage {stage} on a rank < {p}')
    if len(self.actions) != p:
      self._fail('structure', f'actions has {len(self.actions)} rows for '
                 f'num_ranks={p}', 'give one row (possibly empty) per rank')

  def _check_action(self, action: Action, rank: int, step: int):
    stage, kind, mb = action
    if (kind not in KINDS or not 0 <= stage < self.num_stages
        or not 0 <= mb < self.num_microbatches):
      self._fail('range', f'{action} at rank {rank} step {step} is out of '
                 'range', f'use stages < {self.num_stages} and microbatches < '
                 f'{self.num_microbatches}, or change those sizes',
                 action, rank, step)
    if self.placement[stage] != rank:
      self._fail('placement', f'{action} runs on rank {rank} but stage '
                 f'{stage} is placed on rank {self.placement[stage]}',
                 f'move it to rank {self.placement[stage]} or set '
                 f'placement[{stage}]={rank}', action, rank, step)

  def _check_counts(self, where: Mapping[Action, tuple[int, int]]):
    for stage in range(self.num_stages):
      rank = self.placement[stage]
      for mb in range(self.num_microbatches):
        has = {k: Action(stage, k, mb) in where for k in KINDS}
        if has['B'] and (has['I'] or has['W']):
          split = Action(stage, 'I' if has['I'] else 'W', mb)
          self._fail('split', f'{stage}B{mb} and {split} both appear',
                     f'keep either {stage}B{mb} or the pair {stage}I{mb}, '
                     f'{stage}W{mb}', split, *where[split])
        need = ['F'] + (['I', 'W'] if has['I'] or has['W'] else ['B'])
        for kind in need:
          if not has[kind]:
            action = Action(stage, kind, mb)
            self._fail('missing', f'{action} is missing', f'add {action} to '
                       f'rank {rank}', action, rank)

  # --- timing, display, exchange -------------------------------------------

  def simulate(self, costs: Mapping[str, float] | None = None,
               comm: float = 0.0) -> _simulate.SimResult:
    """Event-driven timing of this schedule; see ``simulate.simulate``."""
    return _simulate.simulate(self, costs, comm)

  def render(self, costs: Mapping[str, int] | None = None, *,
             timed: bool = True) -> str:
    """A text grid, one row per rank; see ``plot.render``."""
    return _plot.render(self, costs, timed=timed)

  def plot(self, ax: Axes | None = None,
           costs: Mapping[str, float] | None = None,
           comm: float = 0.0) -> Figure:
    """A matplotlib Gantt chart; see ``plot.plot``."""
    return _plot.plot(self, ax, costs, comm)

  def to_csv(self, path: str | os.PathLike) -> None:
    """Writes PyTorch's compute-only CSV: one row per rank, empty = idle.

    Example:
      >>> import jaxpar
      >>> jaxpar.pipeline.one_f_one_b(2, 2).to_csv('1f1b.csv')
      >>> print(open('1f1b.csv').read())
      0F0,0F1,0B0,0B1
      1F0,1B0,1F1,1B1
      <BLANKLINE>
    """
    with open(path, 'w', newline='') as f:
      writer = csv.writer(f)
      for row in self.actions:
        writer.writerow(['' if a is None else str(a) for a in row])

  @classmethod
  def from_csv(cls, path: str | os.PathLike, *, name: str | None = None,
               num_microbatches: int | None = None) -> Schedule:
    """Reads PyTorch's compute-only CSV (``_dump_csv(format='compute_only')``).

    Row ``r`` is rank ``r``'s actions; cells like ``0F3``, ``4B1``, ``2I0``,
    ``2W0``; empty cells are idle slots. ``num_stages`` and
    ``num_microbatches`` are one more than the largest index seen and the
    placement is read from the rows.

    Args:
      path: the CSV file.
      name: the schedule's name; defaults to the file name without extension.
      num_microbatches: the expected ``m``; default: inferred. Pass it to
        have microbatch indices ``>= m`` reported as out of range.

    Returns:
      The validated ``Schedule``.

    Raises:
      ValueError: for a cell that is not a compute action (with its rank and
        column), a stage number that never appears, or a ``ScheduleError``
        for an invalid schedule.

    Example:
      >>> import jaxpar
      >>> from jaxpar.pipeline import Schedule
      >>> s = jaxpar.pipeline.one_f_one_b(2, 2)
      >>> s.to_csv('1f1b.csv')
      >>> Schedule.from_csv('1f1b.csv', name='1F1B') == s
      True
    """
    with open(path, newline='') as f:
      rows = list(csv.reader(f))
    actions = []
    for rank, row in enumerate(rows):
      parsed = []
      for col, cell in enumerate(row):
        try:
          parsed.append(Action.parse(cell) if cell.strip() else None)
        except ValueError as e:
          raise ValueError(f'{os.fspath(path)}: rank {rank} column {col}: '
                           f'{e}') from None
      actions.append(tuple(parsed))
    present = [a for row in actions for a in row if a is not None]
    num_stages = 1 + max((a.stage for a in present), default=0)
    placement = [-1] * num_stages
    for rank, row in enumerate(actions):
      for a in row:
        if a is not None and placement[a.stage] == -1:
          placement[a.stage] = rank
    if -1 in placement:
      raise ValueError(
          f'{os.fspath(path)}: stage {placement.index(-1)} has no actions, but '
          f'stages up to {num_stages - 1} appear; every logical stage must '
          'appear on some row (stages are numbered from 0).')
    if name is None:
      name = os.path.splitext(os.path.basename(os.fspath(path)))[0]
    if num_microbatches is None:
      num_microbatches = 1 + max((a.microbatch for a in present), default=0)
    schedule = cls(len(actions), num_stages, num_microbatches,
                   tuple(placement), tuple(actions), name)
    return schedule.validate()
