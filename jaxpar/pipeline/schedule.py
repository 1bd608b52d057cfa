"""Pipeline schedules as data: ``Action``, ``Schedule``, constructors, validation.

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
that. The constructors reproduce the per-rank orders of PyTorch's
``torch.distributed.pipelining`` (without PyTorch's idle padding: waiting is
implied by the dependencies).
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import operator
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

from jaxpar.pipeline import plot as _plot
from jaxpar.pipeline import simulate as _simulate

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

KINDS = ('F', 'B', 'I', 'W')
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
_ACTION_RE = re.compile(r'(\d+)([FBIW])(\d+)')


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


class Action(NamedTuple):
  """One compute action: ``kind`` of logical ``stage`` on ``microbatch``.

  ``kind`` is ``'F'`` (forward), ``'B'`` (full backward), ``'I'`` (input
  gradient half of the backward) or ``'W'`` (weight gradient half). The string
  form is PyTorch's: stage, kind, microbatch.

  Example:
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
    match = _ACTION_RE.fullmatch(text.strip()) if isinstance(text, str) else None
    if match is None:
      raise ValueError(
          f'Action.parse({text!r}): expected <stage><kind><microbatch> with '
          f'kind one of {"/".join(KINDS)}, e.g. "0F3" or "2W1" (PyTorch '
          'communication actions such as SEND_F or REDUCE_GRAD are not '
          'compute actions).')
    return cls(int(match[1]), match[2], int(match[3]))


def _as_int(value: object, what: str) -> int:
  """``value`` as a plain int (numpy integers too); ``TypeError`` otherwise."""
  try:
    if not isinstance(value, bool):
      return operator.index(value)
  except TypeError:
    pass
  raise TypeError(f'{what}={value!r} must be an int.')


def _as_action(cell: object, rank: int, step: int) -> Action | None:
  if cell is None:
    return None
  if isinstance(cell, str):
    return Action.parse(cell)
  if isinstance(cell, tuple) and len(cell) == 3:
    where = f'Schedule.actions[{rank}][{step}]'
    return Action(_as_int(cell[0], f'{where}.stage'), cell[1],
                  _as_int(cell[2], f'{where}.microbatch'))
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
  like ``'0F3'`` are accepted and normalised to ints and tuples of ``Action``. Constructors return validated schedules; call ``validate()`` on
  hand-made ones.

  Example:
    >>> s = one_f_one_b(2, 3)
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
      object.__setattr__(self, field, _as_int(getattr(self, field),
                                              f'Schedule.{field}'))
    placement = tuple(_as_int(rank, f'Schedule.placement[{stage}]')
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
      >>> gpipe(4, 8).validate().num_stages
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
                 f'num_microbatches={m} must all be >= 1', 'pass positive sizes')
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
      >>> one_f_one_b(2, 2).to_csv('1f1b.csv')
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
      >>> one_f_one_b(2, 2).to_csv('1f1b.csv')
      >>> Schedule.from_csv('1f1b.csv', name='1F1B') == one_f_one_b(2, 2)
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


# --- constructors -------------------------------------------------------------


def _check_sizes(fn: str, **sizes: int) -> str:
  """Checks that every size is an int >= 1; returns ``fn(k=v, ...)``."""
  call = f'{fn}({", ".join(f"{k}={v!r}" for k, v in sizes.items())})'
  for key, value in sizes.items():
    if isinstance(value, bool) or not isinstance(value, int):
      raise TypeError(f'{call}: {key} must be an int, got '
                      f'{type(value).__name__}.')
    if value < 1:
      raise ValueError(f'{call}: {key}={value} must be >= 1; nearest valid '
                       f'choice: {key}=1.')
  return call


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
    >>> [str(a) for a in gpipe(2, 2).actions[0]]
    ['0F0', '0F1', '0B0', '0B1']
  """
  _check_sizes('gpipe', num_ranks=num_ranks, num_microbatches=num_microbatches)
  p, m = num_ranks, num_microbatches
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
    >>> [str(a) for a in one_f_one_b(3, 4).actions[0]]
    ['0F0', '0F1', '0F2', '0B0', '0F3', '0B1', '0B2', '0B3']
  """
  _check_sizes('one_f_one_b', num_ranks=num_ranks,
               num_microbatches=num_microbatches)
  p, m = num_ranks, num_microbatches
  rows = []
  for r in range(p):
    warmup = min(p - r - 1, m)
    row = [Action(r, 'F', i) for i in range(warmup)]
    for i in range(m - warmup):
      row += [Action(r, 'F', warmup + i), Action(r, 'B', i)]
    row += [Action(r, 'B', i) for i in range(m - warmup, m)]
    rows.append(row)
  return _single(rows, p, m, '1F1B')


def interleaved_1f1b(num_ranks: int, num_microbatches: int,
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
    >>> s = interleaved_1f1b(2, 2, 2)
    >>> s.placement, [str(a) for a in s.actions[1]]
    ((0, 1, 0, 1), ['1F0', '1F1', '3F0', '3B0', '3F1', '3B1', '1B0', '1B1'])
  """
  call = _check_sizes('interleaved_1f1b', num_ranks=num_ranks,
                      num_microbatches=num_microbatches,
                      virtual_stages=virtual_stages)
  p, m, v = num_ranks, num_microbatches, virtual_stages
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
    >>> [str(a) for a in zero_bubble_h1(2, 2).actions[1]]
    ['1F0', '1I0', '1F1', '1I1', '1W0', '1W1']
  """
  _check_sizes('zero_bubble_h1', num_ranks=num_ranks,
               num_microbatches=num_microbatches)
  p, m = num_ranks, num_microbatches
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


def zbv(num_ranks: int, num_microbatches: int) -> Schedule:
  """ZB-V: the V-shaped zero-bubble schedule, PyTorch's ``ScheduleZBVZeroBubble``.

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
    >>> s = zbv(2, 2)
    >>> s.placement, [str(a) for a in s.actions[1]][:4]
    ((0, 1, 1, 0), ['1F0', '2F0', '1F1', '2F1'])
  """
  _check_sizes('zbv', num_ranks=num_ranks, num_microbatches=num_microbatches)
  p, m = num_ranks, num_microbatches
  rows = tuple(_zbv_row(r, p, m) for r in range(p))
  placement = tuple(k if k < p else 2 * p - 1 - k for k in range(2 * p))
  return Schedule(p, 2 * p, m, placement, rows, 'ZB-V').validate()


def _zbv_row(r: int, p: int, m: int) -> tuple[Action, ...]:
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
