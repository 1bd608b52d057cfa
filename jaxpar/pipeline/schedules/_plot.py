"""Pictures of a pipeline schedule: a text grid and a matplotlib Gantt chart."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

from jaxpar.pipeline.schedules import _simulate
from jaxpar.pipeline.schedules._action import Action, ScheduleLike

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

COLORS = {'F': '#4c72b0', 'B': '#55a868', 'I': '#dd8452', 'W': '#8172b3'}
UNIT_COSTS = {'F': 1, 'B': 1, 'I': 1, 'W': 1}


def format_grid(rows: Sequence[Sequence[str]],
                marks: Iterable[tuple[int, int]] = (),
                column: str = 'step', max_columns: int | None = None) -> str:
  """Rank x column text grid; cells ``(rank, col)`` in ``marks`` get ``[ ]``.

  Args:
    rows: one sequence of cell strings per rank.
    marks: ``(rank, column)`` cells to bracket.
    column: the header of the column axis.
    max_columns: if set and the grid is wider, show only a window of this
      many columns, starting a few before the first mark.

  Example:
    >>> from jaxpar.pipeline.schedules._plot import format_grid
    >>> print(format_grid([['0F0', '0B0'], ['', '1F0']], marks=[(1, 1)]))
    step       0     1
    rank 0   0F0   0B0
    rank 1       [1F0]
  """
  marks = set(marks)
  ncol = max((len(row) for row in rows), default=0)
  lo, hi = 0, ncol
  if max_columns is not None and ncol > max_columns:
    lo = max(0, min(min((t for _, t in marks), default=0) - 4,
                    ncol - max_columns))
    hi = lo + max_columns
  cells = [[(f'[{c}]' if (r, t) in marks else c) for t, c in enumerate(row)]
           + [''] * (ncol - len(row)) for r, row in enumerate(rows)]
  cells = [row[lo:hi] for row in cells]
  width = max([len(str(hi - 1))] + [len(c) for row in cells for c in row])
  label = max(len(column), len(f'rank {len(rows) - 1}'))
  lines = [f'{column:<{label}} ' + ' '.join(
      f'{t:>{width}}' for t in range(lo, hi))]
  for r, row in enumerate(cells):
    lines.append(f'{f"rank {r}":<{label}} ' + ' '.join(
        f'{c:>{width}}' for c in row))
  if (lo, hi) != (0, ncol):
    lines.append(f'({column}s {lo}..{hi - 1} of 0..{ncol - 1} shown)')
  return '\n'.join(line.rstrip() for line in lines)


def render(schedule: ScheduleLike, costs: Mapping[str, int] | None = None, *,
           timed: bool = True) -> str:
  """The schedule as a text grid, one row per rank.

  Args:
    schedule: the schedule.
    costs: integer time per kind for the timed grid; default one time step
      per action. An action lasting ``k`` steps shows its label then ``k-1``
      ``~`` cells.
    timed: ``True``: columns are time steps of ``simulate(costs)``, so the
      bubbles show as blank cells. ``False``: columns are positions in each
      rank's action list (as written; ``None`` slots blank), which also works
      for invalid schedules.

  Returns:
    The grid as a string.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline.schedules._plot import render
    >>> print(render(jaxpar.pipeline.one_f_one_b(2, 2)))
    1F1B: p=2, m=2, steps F=1 B=1 I=1 W=1, bubble 33.3%
    t        0   1   2   3   4   5
    rank 0 0F0 0F1     0B0     0B1
    rank 1     1F0 1B0 1F1 1B1
  """
  if not timed:
    header = (f'{schedule.name}: p={schedule.num_ranks}, stages='
              f'{schedule.num_stages}, m={schedule.num_microbatches}, '
              'actions in rank order')
    return header + '\n' + format_grid(
        [['' if a is None else str(a) for a in row]
         for row in schedule.actions])
  duration = _simulate.check_costs(costs, UNIT_COSTS)
  for kind, cost in duration.items():
    if cost != int(cost) or cost < 1:
      raise ValueError(f'render(costs={dict(costs)!r}): costs[{kind!r}]='
                       f'{cost} must be a whole number of steps >= 1 for the '
                       'text grid; use plot() for other costs.')
  result = _simulate.simulate(schedule, duration)
  rows = [[''] * int(result.makespan) for _ in range(schedule.num_ranks)]
  for rank, row in enumerate(schedule.actions):
    for a in row:
      if a is not None:
        t0, t1 = int(result.start[a]), int(result.end[a])
        rows[rank][t0:t1] = [str(a)] + ['~'] * (t1 - t0 - 1)
  used = ' '.join(f'{k}={int(c)}' for k, c in duration.items())
  return (f'{schedule.name}: p={schedule.num_ranks}, m='
          f'{schedule.num_microbatches}, steps {used}, bubble '
          f'{result.bubble_fraction:.1%}\n' + format_grid(rows, column='t'))


def fb_pairs(schedule: ScheduleLike) -> list[tuple[Action, Action]]:
  """``(F, B)`` actions adjacent on a rank, of different stages.

  These are the pairs DualPipe overlaps (a forward of one chunk with the
  full backward of the other); jaxpar's executor runs them one after the
  other.

  Example:
    >>> import jaxpar
    >>> from jaxpar.pipeline.schedules._plot import fb_pairs
    >>> [f'{f}&{b}' for f, b in fb_pairs(jaxpar.pipeline.dualpipe_v(2, 4))][:2]
    ['0F3&3B1', '3F2&0B0']
  """
  pairs = []
  for row in schedule.actions:
    done = [a for a in row if a is not None]
    for f, b in zip(done, done[1:]):
      if f.kind == 'F' and b.kind == 'B' and f.stage != b.stage:
        pairs.append((f, b))
  return pairs


def plot(schedule: ScheduleLike, ax: Axes | None = None,
         costs: Mapping[str, float] | None = None,
         comm: float = 0.0) -> Figure:
  """Gantt chart of ``simulate(costs, comm)``: ranks as rows, time on x.

  Boxes are coloured by kind (F blue, B green, I orange, W purple), labelled
  with the microbatch; when a rank holds several stages, later stages are
  drawn lighter. A forward directly followed on its rank by a full backward
  of another stage (DualPipe's ``F & B`` pairs, which its kernels overlap;
  also interleaved 1F1B's steady state) is framed in black. The title gives
  the name, ``p``, ``m`` and bubble fraction.

  Args:
    schedule: the schedule.
    ax: matplotlib axes to draw into; default a new ``Figure`` (not
      registered with pyplot, so it does not leak or show twice).
    costs: time per kind, as in ``simulate``.
    comm: communication latency, as in ``simulate``.

  Returns:
    The ``Figure`` holding the chart.

  Example:
    >>> import jaxpar
    >>> fig = jaxpar.pipeline.one_f_one_b(4, 8).plot(costs={'F': 1, 'B': 2})
    >>> fig.savefig('1f1b.png')
  """
  try:
    from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError('Schedule.plot needs matplotlib: pip install '
                      "matplotlib (or jaxpar's [dev] extra).") from e
  result = _simulate.simulate(schedule, costs, comm)
  if ax is None:
    fig = Figure(figsize=(min(4 + 0.25 * result.makespan, 18),
                          1 + 0.45 * schedule.num_ranks))
    ax = fig.add_subplot()
  else:
    fig = ax.figure
  local = {}  # stage -> index among the stages of its rank
  for rank in range(schedule.num_ranks):
    mine = [s for s, r in enumerate(schedule.placement) if r == rank]
    local.update({s: j for j, s in enumerate(mine)})
  for rank, row in enumerate(schedule.actions):
    for a in row:
      if a is None:
        continue
      t0, t1 = result.start[a], result.end[a]
      if t1 <= t0:
        continue
      ax.broken_barh([(t0, t1 - t0)], (rank - 0.4, 0.8),
                     facecolors=COLORS[a.kind], edgecolor='white',
                     alpha=1.0 / (1 + 0.6 * local[a.stage]))
      ax.text((t0 + t1) / 2, rank, str(a.microbatch), ha='center',
              va='center', fontsize=7, color='white')
  pairs = fb_pairs(schedule)
  for f, b in pairs:
    t0, t1 = result.start[f], result.end[b]
    ax.broken_barh([(t0, t1 - t0)], (schedule.placement[f.stage] - 0.45, 0.9),
                   facecolors='none', edgecolor='black', linewidth=1.2)
  kinds = sorted({a.kind for row in schedule.actions for a in row if a},
                 key='FBIW'.index)
  handles = [Patch(color=COLORS[k], label=k) for k in kinds]
  if pairs:
    handles.append(Patch(facecolor='none', edgecolor='black', label='F&B'))
  ax.legend(handles=handles, loc='upper left', bbox_to_anchor=(1.0, 1.0),
            fontsize=8)
  ax.set_yticks(range(schedule.num_ranks),
                [f'rank {r}' for r in range(schedule.num_ranks)])
  ax.set_ylim(schedule.num_ranks - 0.5, -0.5)
  ax.margins(x=0)  # x from 0 to the makespan; shared axes take the union
  ax.set_xlabel('time')
  ax.set_title(f'{schedule.name}: p={schedule.num_ranks}, '
               f'm={schedule.num_microbatches}, bubble '
               f'{result.bubble_fraction:.1%}')
  return fig
