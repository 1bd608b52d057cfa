"""``timeline``: a pipeline step run with a host timestamp at each tick's seams.

``timeline(step, *args)`` traces ``step`` afresh with the executor's hook
(``stamp``, called three times in each tick of ``_tick_scan``) switched on,
runs it, and returns a ``Timeline`` (``_timeline``): when each rank's block
started and ended and when the tick's messages landed, on the host's
monotonic clock. Each stamp is an ``io_callback`` tied into the data flow
on both sides (``stamp``): it fires once the values before it exist, and
what comes after waits for it, so a stamp falls exactly
between the block and the messages, on every rank (simulated devices of one
process, or processes of ``jax.distributed``). Outside ``timeline`` the hook
returns its values untouched and adds nothing to the program.
"""

from __future__ import annotations

import contextvars
import functools
import socket
import time
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback, multihost_utils

from jaxpar.pipeline.executor._timeline import Timeline, exchanges
from jaxpar.pipeline.schedules import TickTable
from jaxpar.vma import vary, varying_axes

PyTree = Any
EVENTS = ('start', 'computed', 'received')   # a tick's stamps, in order


class _Recorder:
  """Host side of a ``timeline``: the tables traced and the stamps."""

  def __init__(self):
    self.tables: list[tuple[TickTable, bool]] = []   # (table, with_edge)
    # (ns, event, rank, replica, kind, stage, microbatch), -1: not stamped
    self.events: list[tuple[int, ...]] = []
    # per call: its first and last event, the call's and return's ns
    self.steps: list[tuple[int, int, int, int]] = []

  def record(self, event: int, info: np.ndarray, *firsts) -> list:
    """The callback: ``info`` is ``(rank, replica[, kind, stage, mb])``;
    ``firsts`` (what it waited for) go back unchanged."""
    now = time.perf_counter_ns()
    info = [int(v) for v in np.asarray(info)]
    self.events.append((now, event, *info, *[-1] * (5 - len(info))))
    return list(firsts)

  def run(self, step: Callable, args: tuple, kwargs: dict) -> None:
    """One call of ``step``, its events and host times kept apart."""
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('jaxpar.pipeline.timeline')
    first, called = len(self.events), time.perf_counter_ns()
    jax.block_until_ready(step(*args, **kwargs))
    self.steps.append((first, len(self.events), called,
                       time.perf_counter_ns()))


_RECORDER: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar(
    'jaxpar_pipeline_timeline', default=None)


def stamp(config: Any, event: str, values: PyTree, cell: Any = None
          ) -> PyTree:
  """The executor's hook: ``values``, with a host timestamp between what
  computes them and what uses them, while ``timeline`` traces; else
  ``values`` as they are (no callback in the program).

  The callback takes the first element of each leaf (so it runs once they
  all exist) and returns them; each leaf comes back with its first element
  overwritten by the returned one (in place), so what uses it waits for the
  callback: data dependencies that XLA keeps (``optimization_barrier``s are
  expanded away on XLA:CPU before scheduling). The cost is the host
  callback and one element read and written per leaf.

  Args:
    config: the tick scan's ``ScanConfig`` (its ``table``, ``stage_axis``,
      ``with_edge``).
    event: one of ``EVENTS``.
    values: the pytree the stamp waits for and then hands on.
    cell: at ``'start'``, the rank's ``TickCell`` (its kind, stage and
      microbatch are recorded as the device read them).
  """
  recorder = _RECORDER.get()
  if recorder is None:
    return values
  if not any(t is config.table for t, _ in recorder.tables):
    recorder.tables.append((config.table, config.with_edge))
  info = [jax.lax.axis_index(config.stage_axis)]
  others = tuple(a for a in jax.sharding.get_abstract_mesh().manual_axes
                 if a != config.stage_axis)
  info.append(jax.lax.axis_index(others) if others else info[0] * 0)
  if cell is not None:
    info += [cell.kind, cell.stage, cell.microbatch]
  leaves, tree = jax.tree.flatten(values)
  tied = [k for k, leaf in enumerate(leaves) if _tieable(leaf)]
  firsts = [_first(leaves[k]) for k in tied]
  echoed = io_callback(
      functools.partial(recorder.record, EVENTS.index(event)),
      [jax.ShapeDtypeStruct(f.shape, f.dtype) for f in firsts],
      jnp.stack([jnp.asarray(i, jnp.int32) for i in info]), *firsts,
      ordered=False)
  for k, first in zip(tied, echoed):
    leaf = leaves[k]
    first = vary(first, varying_axes(leaf))
    leaves[k] = first.reshape(()) if leaf.ndim == 0 else (
        jax.lax.dynamic_update_slice(leaf, first, (0,) * leaf.ndim))
  return jax.tree.unflatten(tree, leaves)


def _tieable(leaf: Any) -> bool:
  """A non-empty numeric array (a key or an empty leaf is handed on as is)."""
  dtype = getattr(leaf, 'dtype', None)
  return (dtype is not None and np.size(leaf) > 0 and
          (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_))


def _first(leaf: jax.Array) -> jax.Array:
  """The leaf's first element, shaped ``[1] * ndim``."""
  return jax.lax.slice(leaf, (0,) * leaf.ndim, (1,) * leaf.ndim)


def timeline(step: Callable[..., Any], *args: Any, steps: int = 3,
             warmup: int = 1, **kwargs: Any) -> Timeline:
  """Runs a pipeline step and returns when each rank's ticks ran.

  ``step`` is any function whose trace runs the executor's tick scan once:
  the step ``pipeline_value_and_grad`` returns, ``parallel.trainer``'s
  ``Trainer.step``, or a function of yours that calls
  ``pipeline_value_and_grad_local``. ``timeline`` traces it again with a
  host timestamp at three points of every tick (the block starts, the block
  ends, the messages have landed), calls it ``warmup + steps`` times with
  ``args`` and ``kwargs``, and returns what the stamps measured. It clears
  JAX's caches before and after, so the next ordinary call compiles the
  step without the stamps. No state is threaded from call to call: time a
  pure step, or one that does not donate its inputs. In a multi-process job
  every process calls it, and each call starts after a barrier.

  Each stamp costs a host callback (about 0.05 ms on an idle core, more on
  a loaded one): time blocks of a millisecond or more, and compare
  ``Timeline.walls`` with the step's own time.

  Args:
    step: the step, called as ``step(*args, **kwargs)``.
    *args: its positional arguments.
    steps: the calls measured, after ``warmup``; their totals are averaged.
    warmup: the calls made first and not kept (the first compiles).
    **kwargs: its keyword arguments.

  Returns:
    A ``Timeline``: ``summary()``, ``totals()`` (compute, messages, waiting,
    overhead and outside time per rank), ``costs()`` and ``plot()`` (the
    measured Gantt chart below the simulated one). With several devices per
    rank (a data or tensor axis) the first device of each rank is kept.
    Every process returns the whole timeline, on the machine's monotonic
    clock (across machines, aligned at a barrier).

  Raises:
    TypeError: ``step`` is not callable.
    ValueError: ``steps < 1`` or ``warmup < 0``; the step ran no tick (with
      one pipeline rank the microbatches run in turn, without ticks) or the
      ticks of more than one tick table.

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> step = jaxpar.pipeline.pipeline_value_and_grad(
    ...     lambda w, x: jnp.tanh(x @ w),
    ...     lambda _, y, t: jnp.mean((y - t) ** 2),
    ...     schedule=jaxpar.pipeline.one_f_one_b(2, 2),
    ...     mesh=jaxpar.make_mesh(stage=2, devices=jax.devices()[:2]))
    >>> timeline = jaxpar.pipeline.timeline(
    ...     step, np.ones((2, 8, 8), np.float32) / 8, 0., np.ones((4, 8)),
    ...     np.zeros((4, 8)), steps=2)
    >>> timeline.start.shape      # [steps, ticks, ranks]
    (2, 8, 2)
    >>> t = timeline.totals()[0]
    >>> bool(abs(t.compute + t.messages + t.waiting + t.overhead + t.outside
    ...          - t.wall) < 1e-9)
    True
  """
  if not callable(step):
    raise TypeError(f'timeline: step={step!r} is not callable; pass the '
                    'jitted step, e.g. pipeline_value_and_grad(...).')
  for name, value, low in (('steps', steps, 1), ('warmup', warmup, 0)):
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
      raise ValueError(f'timeline: {name}={value!r} must be an int >= {low}.')
  recorder = _Recorder()
  token = _RECORDER.set(recorder)
  jax.clear_caches()   # trace the step again, with the stamps
  try:
    for _ in range(warmup + steps):
      recorder.run(step, args, kwargs)
  finally:
    _RECORDER.reset(token)
    jax.clear_caches()   # the next ordinary call traces it without them
  return _measured(recorder, warmup)


def _measured(recorder: _Recorder, warmup: int) -> Timeline:
  """The recorded stamps as a ``Timeline`` (gathered from every process)."""
  tables = recorder.tables
  if not tables:
    raise ValueError(
        'timeline: the step ran no pipeline tick: with one pipeline rank '
        '(num_ranks == 1) the executor runs the microbatches in turn, '
        'without ticks; time a schedule over >= 2 ranks.')
  if any(t.kind.shape != tables[0][0].kind.shape or
         (t.kind != tables[0][0].kind).any() for t, _ in tables[1:]):
    raise ValueError(f'timeline: the step ran {len(tables)} different tick '
                     'tables; time a step with one pipeline.')
  table, with_edge = tables[0]
  ticks = table.num_ticks
  local, hosts = [], []   # per step: {rank: [T, 6]}; (call, return) ns
  for first, last, called, returned in recorder.steps[warmup:]:
    local.append(_by_rank(recorder.events[first:last], ticks))
    hosts.append((called, returned))
  ranks = sorted(local[0])
  mine = np.array([[local[k][r] for r in ranks] for k in range(len(local))])
  ranks, mine, hosts = _gathered(np.array(ranks), mine, np.array(hosts))
  order = np.argsort(ranks)
  mine = mine[:, order]                  # [n, p, T, 6]
  hosts = hosts[:, order]                # [n, p, 2]
  origin = hosts[:, :, 0].min(1)         # per step: the first call
  seconds = lambda ns: (ns - origin.reshape((-1,) + (1,) * (ns.ndim - 1))
                        ) * 1e-9
  times = seconds(mine[..., :3].transpose(0, 2, 1, 3))   # [n, T, p, 3]
  return Timeline(table, mine[0, :, :, 3:].transpose(1, 0, 2).astype(np.int32),
                  times[..., 0], times[..., 1], times[..., 2],
                  seconds(hosts[..., 0]), seconds(hosts[..., 1]),
                  exchanges(table, with_edge))


def _by_rank(events: list[tuple[int, ...]], ticks: int
             ) -> dict[int, np.ndarray]:
  """One step's stamps of each local rank (its first device): int64
  ``[T, 6]``, the three stamps' ns and the action reported at ``start``."""
  out = {}
  replica = {}
  for ns, event, rank, rep, kind, stage, mb in events:
    if replica.setdefault(rank, rep) != rep:
      continue
    row = out.setdefault(rank, [])
    if event == 0:
      row.append([ns, 0, 0, kind, stage, mb])
    else:
      row[-1][event] = ns
  for rank, rows in out.items():
    if len(rows) != ticks:
      raise RuntimeError(f'timeline: rank {rank} stamped {len(rows)} ticks, '
                         f'the table has {ticks}.')
  return {rank: np.array(rows, np.int64) for rank, rows in out.items()}


def _gathered(ranks: np.ndarray, mine: np.ndarray, hosts: np.ndarray):
  """Every process's ranks, stamps ``[n, K, T, 6]`` and host times, with
  the clocks of other machines moved onto process 0's (at a barrier)."""
  n = mine.shape[0]
  hosts = np.broadcast_to(hosts[:, None], (n, len(ranks), 2))
  if jax.process_count() == 1:
    return ranks, mine, hosts
  multihost_utils.sync_global_devices('jaxpar.pipeline.timeline: clocks')
  clock = np.array([time.perf_counter_ns(),
                    zlib.crc32(socket.gethostname().encode())], np.int64)
  with jax.enable_x64(True):
    ranks, mine, hosts, clock = (np.asarray(multihost_utils.process_allgather(
        a)) for a in (ranks, mine, np.ascontiguousarray(hosts), clock))
  if len(set(clock[:, 1])) > 1:   # several machines: align at the barrier
    shift = clock[:, 0] - clock[0, 0]
    mine = mine - np.where(np.arange(6) < 3, shift.reshape(-1, 1, 1, 1, 1), 0)
    hosts = hosts - shift.reshape(-1, 1, 1, 1)
  # [P, n, K, ...] -> [n, P * K, ...]
  merge = lambda a: np.concatenate(list(a), axis=1)
  return ranks.reshape(-1), merge(mine), merge(hosts)
