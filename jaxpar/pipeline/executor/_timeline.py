"""A pipeline step's ticks as they ran: ``Timeline`` (from ``timeline``).

Per tick ``t`` and rank ``r`` the executor stamped three host times
(``_stamps``): ``start`` (the block's input read), ``computed`` (its block
done) and ``received`` (the tick's messages landed). The step splits, on
every rank, into

* **compute**: ``computed - start``, the block (an idle rank's is ~0);
* **waiting**: in a tick with messages, from ``computed`` until the last
  rank reaches the tick's collectives (``max_r computed``): lock-step time
  spent on slower ranks; after the last tick, until the last rank ends it
  (a rank whose last ticks are idle and send nothing runs through them at
  once and waits in the step's final sums: GPipe's last rank, the drain);
  on an idle tick that is the schedule's bubble (``bubble``, a part of
  ``waiting``);
* **messages**: the rest of the exchange, the collectives themselves (the
  tick's ``ppermute``s and the sum of result rows, one interval);
* **overhead**: between ticks (``received`` to the next ``start``: landing
  the messages, the loop) and ticks without messages;
* **outside**: before the first tick and after the last rank's last tick
  (placing the params, the buffers, the final sums, dispatch).

They add up to the step's wall time on each rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from jaxpar.pipeline.executor._tick_rows import messages
from jaxpar.pipeline.schedules import KIND_CODES, TickTable

if TYPE_CHECKING:
  from matplotlib.axes import Axes
  from matplotlib.figure import Figure

KINDS = {code: kind for kind, code in KIND_CODES.items()}   # 1 -> 'F', ...
# The colours of Schedule.plot (F blue, B green, I orange, W purple) and
# the exchange's parts.
COLORS = {'F': '#4c72b0', 'B': '#55a868', 'I': '#dd8452', 'W': '#8172b3',
          'messages': '#333333', 'waiting': '#c8c8c8',
          'overhead': '#e377c2', 'outside': '#7f7f7f'}
PARTS = ('compute', 'messages', 'waiting', 'overhead', 'outside')


class RankTotals(NamedTuple):
  """One rank's step time by where it went, in seconds (mean over the
  measured steps): ``compute + messages + waiting + overhead + outside ==
  wall``; ``bubble`` is the part of ``waiting`` in the rank's idle ticks."""
  rank: int
  wall: float
  compute: float
  messages: float
  waiting: float
  overhead: float
  outside: float
  bubble: float


class Timeline(NamedTuple):
  """A pipeline step's ticks as they ran on every rank (module doc).

  ``n`` measured steps, ``T = table.num_ticks`` ticks, ``p`` ranks; times
  are seconds from the step's call (the earliest process's, per step).

  Attributes:
    table: the ``TickTable`` the step scanned (``table.schedule``).
    actions: int32 ``[T, p, 3]``, ``(kind, stage, microbatch)`` each rank
      reported running (kind ``0`` idle, else ``KIND_CODES``: F 1, B 2,
      I 3, W 4; a schedule's ``B`` runs as one ``B`` block, or as an ``I``
      and a ``W`` where the table splits it).
    start: float64 ``[n, T, p]``, the block's input read.
    computed: ``[n, T, p]``, the block done.
    received: ``[n, T, p]``, the tick's messages landed.
    called: ``[n, p]``, the host called the step (the rank's process).
    returned: ``[n, p]``, the step's outputs were ready.
    exchanges: bool ``[T]``, the tick has collectives (the same on every
      rank).
  """
  table: TickTable
  actions: np.ndarray
  start: np.ndarray
  computed: np.ndarray
  received: np.ndarray
  called: np.ndarray
  returned: np.ndarray
  exchanges: np.ndarray

  @property
  def walls(self) -> np.ndarray:
    """``[n]``: each step's wall time, first call to last return."""
    return self.returned.max(1) - self.called.min(1)

  def parts(self) -> dict[str, np.ndarray]:
    """The split of the module doc per step, tick and rank: ``compute``,
    ``messages``, ``waiting``, ``overhead``, ``bubble`` ``[n, T, p]`` and
    ``outside`` ``[n, p]``."""
    s, c, e = self.start, self.computed, self.received
    window = e - c
    talk = self.exchanges[None, :, None]
    waiting = np.where(talk, np.clip(c.max(2, keepdims=True) - c, 0, window),
                       0.)
    overhead = np.where(talk, 0., window)
    overhead[:, :-1] += s[:, 1:] - e[:, :-1]
    messages = np.where(talk, window - waiting, 0.)
    drain = self._drain()
    waiting[:, -1] += drain
    idle = (self.actions[None, :, :, 0] == 0)
    return {'compute': c - s, 'messages': messages,
            'waiting': waiting, 'overhead': overhead,
            'outside': (s[:, 0] - self.called) + (
                self.returned - e[:, -1] - drain),
            'bubble': np.where(idle, waiting, 0.)}

  def _drain(self) -> np.ndarray:
    """``[n, p]``: from the rank's last tick to the last rank's (until
    the rank returned). Ticks without collectives do not wait for other
    ranks, so a rank whose last ticks are idle runs through them at once
    and waits for the others in the step's final sums: lock-step time of
    its last tick, not ``outside``."""
    end = self.received[:, -1]
    last = np.minimum(end.max(1, keepdims=True), self.returned)
    return np.clip(last - end, 0., None)

  def totals(self) -> tuple[RankTotals, ...]:
    """Per rank, where its step time went (``RankTotals``, seconds)."""
    parts = {k: v.sum(1) if v.ndim == 3 else v for k, v in
             self.parts().items()}   # [n, p]
    wall = self.returned - self.called
    return tuple(RankTotals(r, *(float(a[:, r].mean()) for a in (
        wall, *(parts[k] for k in PARTS), parts['bubble'])))
                 for r in range(self.actions.shape[1]))

  def costs(self) -> dict[str, float]:
    """Mean seconds per block kind, over every rank (``B = I + W`` when
    the table runs no ``B`` block)."""
    compute = self.parts()['compute']
    out = {}
    for code, kind in KINDS.items():
      busy = self.actions[:, :, 0] == code
      if busy.any():
        out[kind] = float(compute[:, busy].mean())
    if 'B' not in out and 'I' in out and 'W' in out:
      out['B'] = out['I'] + out['W']
    return out

  def message_seconds(self) -> float:
    """Mean seconds of one tick's collectives once all ranks reached them
    (``messages`` over the ticks with collectives); 0 without any."""
    if not self.exchanges.any():
      return 0.
    return float(self.parts()['messages'][:, self.exchanges].mean())

  def predicted(self) -> dict[str, float]:
    """The ticks' seconds three ways, with the measured ``costs()`` and
    ``message_seconds()``: ``simulated`` (``Schedule.simulate``: each
    action starts when its inputs are there), ``lockstep``
    (``TickTable.makespan``: every tick lasts as long as its slowest rank,
    plus its messages) and ``measured`` (first tick's start to the last
    tick's messages, mean over the steps). ``lockstep - simulated`` is what
    the lock-step costs with these block costs (negative where a split
    ``I`` sends before the schedule's ``B`` would end); ``measured -
    lockstep``
    the per-tick overhead and what varied from tick to tick."""
    costs, comm = self.costs(), self.message_seconds()
    return {'simulated': self.table.schedule.simulate(costs, comm).makespan,
            'lockstep': self.table.makespan(costs, comm),
            'measured': float((self.received[:, -1].max(1)
                               - self.start[:, 0].min(1)).mean())}

  def summary(self) -> str:
    """Per-rank totals (``totals()``), block costs and ``predicted()`` as
    text, in milliseconds."""
    s = self.table.schedule
    ms = lambda d: ', '.join(f'{k} {1e3 * v:.3g}' for k, v in d.items())
    lines = [f'{s.name}: p={s.num_ranks}, m={s.num_microbatches}, '
             f'{len(self.walls)} step(s), wall {1e3 * self.walls.mean():.3g} '
             'ms',
             f'blocks (ms): {ms(self.costs())}; a tick\'s messages '
             f'{1e3 * self.message_seconds():.3g}',
             f'ticks (ms): {ms(self.predicted())}',
             'rank' + ''.join(f'{h:>10}' for h in ('wall', *PARTS))
             + '  (bubble)']
    for t in self.totals():
      lines.append(f'{t.rank:>4}' + ''.join(
          f'{1e3 * v:>10.3f}' for v in (t.wall, *(getattr(t, k) for k in
                                                   PARTS)))
                   + f'  ({1e3 * t.bubble:.3f})')
    return '\n'.join(lines)

  def plot(self, step: int | None = None) -> Figure:
    """The measured Gantt chart below ``Schedule.plot``'s simulated one.

    Three panels on one time axis in milliseconds: the schedule simulated
    with the measured block costs (``costs()``) and message time
    (``message_seconds()``) as ``comm``; the step as it ran (each block in
    its kind's colour with its microbatch, then the waiting, grey, and the
    messages, black, of the tick); and per rank the totals (``totals()``)
    as stacked bars.

    Args:
      step: which measured step to draw; default the one of median wall
        time.

    Returns:
      A matplotlib ``Figure`` (not registered with pyplot).
    """
    try:
      from matplotlib.figure import Figure  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError('Timeline.plot needs matplotlib: pip install '
                        'matplotlib.') from e
    n, _, p = self.start.shape
    if step is None:
      step = int(np.argsort(self.walls)[n // 2])
    if not (isinstance(step, (int, np.integer)) and -n <= step < n):
      raise ValueError(f'Timeline.plot: step={step!r} must be an int in '
                       f'[-{n}, {n}) (the {n} measured steps).')
    fig = Figure(figsize=(12, 2.2 + 1.1 * p), layout='constrained')
    grid = fig.add_gridspec(2, 2, width_ratios=(5, 1))
    measured = fig.add_subplot(grid[1, 0])
    simulated = fig.add_subplot(grid[0, 0], sharex=measured)
    bars = fig.add_subplot(grid[:, 1])
    ms = {k: 1e3 * v for k, v in self.costs().items()}
    self.table.schedule.plot(ax=simulated, costs=ms,
                             comm=1e3 * self.message_seconds())
    simulated.set_title('simulated with the measured costs: '
                        + simulated.get_title(), fontsize=9)
    simulated.set_xlabel('')
    self._draw_ticks(measured, step)
    self._draw_totals(bars)
    return fig

  def _draw_ticks(self, ax: Axes, step: int) -> None:
    """The measured chart of one step (``plot``)."""
    from matplotlib.patches import Patch  # pylint: disable=g-import-not-at-top
    parts = self.parts()
    s, c = 1e3 * self.start[step], 1e3 * self.computed[step]
    wait = 1e3 * parts['waiting'][step]
    e = 1e3 * self.received[step]
    for (t, r), code in np.ndenumerate(self.actions[:, :, 0]):
      if code:
        kind = KINDS[int(code)]
        ax.broken_barh([(s[t, r], c[t, r] - s[t, r])], (r - 0.4, 0.8),
                       facecolors=COLORS[kind], edgecolor='white')
        ax.text((s[t, r] + c[t, r]) / 2, r, str(self.actions[t, r, 2]),
                ha='center', va='center', fontsize=7, color='white')
      if self.exchanges[t]:
        ax.broken_barh([(c[t, r], wait[t, r])], (r - 0.15, 0.3),
                       facecolors=COLORS['waiting'])
        ax.broken_barh([(c[t, r] + wait[t, r], e[t, r] - c[t, r] - wait[
            t, r])], (r - 0.15, 0.3), facecolors=COLORS['messages'])
    kinds = sorted({KINDS[int(k)] for k in np.unique(self.actions[:, :, 0])
                    if k}, key='FBIW'.index)
    ax.legend(handles=[Patch(color=COLORS[k], label=k)
                       for k in (*kinds, 'waiting', 'messages')],
              loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=8)
    p = self.actions.shape[1]
    ax.set_yticks(range(p), [f'rank {r}' for r in range(p)])
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_xlim(0, 1e3 * self.returned[step].max())
    ax.set_xlabel('ms from the call')
    ax.set_title(f'measured: step {step % len(self.walls)}, wall '
                 f'{1e3 * self.walls[step]:.3g} ms', fontsize=9)

  def _draw_totals(self, ax: Axes) -> None:
    """Per-rank stacked bars of ``totals()`` (``plot``)."""
    totals = self.totals()
    left = np.zeros(len(totals))
    colors = {'compute': COLORS['F'], **COLORS}
    for part in PARTS:
      ms = np.array([1e3 * getattr(t, part) for t in totals])
      ax.barh(range(len(totals)), ms, left=left, color=colors[part],
              label=part)
      left += ms
    ax.set_yticks(range(len(totals)), [f'rank {t.rank}' for t in totals])
    ax.set_ylim(len(totals) - 0.5, -0.5)
    ax.set_xlabel('ms per step')
    ax.set_title('where the time went', fontsize=9)
    ax.legend(fontsize=7, loc='upper center', bbox_to_anchor=(0.5, -0.12),
              ncol=2)


def exchanges(table: TickTable, with_edge: bool) -> np.ndarray:
  """bool ``[T]``: which ticks run collectives (``_tick_rows.messages``)."""
  code, patterns = messages(table, with_edge)
  return np.array([any(patterns[c]) for c in code], bool)
