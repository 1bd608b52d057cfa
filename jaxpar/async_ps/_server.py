"""Asynchronous parameter server with bounded staleness: threaded and simulated.

Synchronous data parallelism waits for the slowest device every step. A
parameter server does not: each worker pulls the current parameters, computes
a gradient on its next batch and pushes it; the server applies pushes in the
order they arrive. A gradient may therefore be computed on parameters that
are a few updates old. jaxpar offers the pattern twice, with one update rule:

* ``AsyncParameterServer``: a real runtime, one Python thread per device
  dispatching JAX work, the calling thread acting as the server.
* ``simulate``: the same rule, deterministic, with a staleness trace given
  up front (for research, and as the reference the runtime is tested
  against).

The update rule. The server's params have a *version* ``c``: the number of
updates applied so far. Update ``i`` (applied at version ``c = i``) uses the
gradient ``g_i = grad loss_fn(params_{i - s_i}, batch_i)``, and
``params_{i+1} = params_i + optimizer.update(g_i, opt_state_i, params_i)``:
the optax state and the parameters the update is added to are always the
current ones; only the gradient is stale. ``s_i = staleness[i]`` is the number
of updates applied between the pull of ``params_{i - s_i}`` and update ``i``.

Bounded staleness holds by construction. Staleness is measured when a push is
applied, by the one thread that applies pushes: a push computed on version
``v`` arriving at version ``c`` with ``c - v > max_staleness`` is rejected,
and its worker pulls the current params and recomputes the gradient on the
*same* batch (counted in ``AsyncResult.retries``). No batch is dropped for
staleness: every batch taken from the iterator with a finite gradient gives
exactly one applied update. ``max_staleness=0`` makes every update use the
current params: plain sequential optax training over the batches in the order
they were applied (``AsyncResult.batch_ids``). The price of a small bound is
wasted work: with ``W`` workers and ``max_staleness=0`` up to ``W - 1`` of
every ``W`` gradients are recomputed.

Non-finite gradients are never applied. A push whose loss or gradient holds a
NaN or inf is dropped, not recomputed (the server's params are always finite,
so the batch or ``loss_fn`` made it), and its batch is listed in
``AsyncResult.skipped``; the run takes another batch in its place, so
``run(batches, n)`` applies exactly ``n`` updates and consumes
``n + len(skipped)`` batches. ``simulate`` follows the same rule: update ``i``
with a non-finite gradient leaves params and optimizer state unchanged.
``run(..., max_skipped=K)`` stops after ``K`` non-finite pushes in a row (in
arrival order; an applied update resets the count) with
``jaxpar.TooManySkippedError``, as the demo's ``--max-skipped`` does:
when every batch is bad, it would otherwise take batches forever. The
server's ``state`` stays that of its last applied update.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxpar._validate import check_int
from jaxpar.train_state import TooManySkippedError, TrainState
from jaxpar.train_state.internal import check_optimizer

PyTree = Any


class AsyncResult(NamedTuple):
  """The outcome and per-update record of an asynchronous run.

  Attributes:
    params: the parameters after the last update.
    staleness: int array ``[num_updates]``; ``staleness[i]`` is the number of
      updates applied between the pull of the params update ``i`` used and
      update ``i`` itself (so update ``i`` used version ``i - staleness[i]``).
    losses: float array ``[num_updates]``; ``losses[i]`` is the loss the
      gradient of update ``i`` was computed with (on its stale params).
    workers: int array ``[num_updates]``, the worker that made update ``i``;
      ``None`` from ``simulate``.
    batch_ids: int array ``[num_updates]``, the position (0-based, within
      this run) in the batch iterator of the batch update ``i`` used; a
      permutation of ``range(num_updates)``. ``None`` from ``simulate``,
      whose update ``i`` always uses batch ``i``.
    retries: int array ``[num_updates]``, how many gradients of update ``i``'s
      batch were rejected as too stale and recomputed; ``None`` from
      ``simulate``.
    skipped: int array, the positions (as in ``batch_ids``) of the batches
      whose loss or gradient was not finite: dropped, never applied. From
      ``simulate``: the updates ``i`` that were skipped (no-ops).
  """
  params: PyTree
  staleness: np.ndarray
  losses: np.ndarray
  workers: np.ndarray | None = None
  batch_ids: np.ndarray | None = None
  retries: np.ndarray | None = None
  skipped: np.ndarray | None = None


class _Compiled(NamedTuple):
  # (params, batch) -> (loss, grads, finite): finite is a bool scalar, True
  # when the loss and every gradient element are finite.
  value_and_grad: Callable[[PyTree, PyTree], tuple[jax.Array, PyTree,
                                                   jax.Array]]
  apply: Callable[[TrainState, PyTree], TrainState]


def _build(loss_fn: Callable, optimizer: optax.GradientTransformation
           ) -> _Compiled:
  def value_and_grad(params: PyTree, batch: PyTree):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    finite = jnp.isfinite(loss)
    for g in jax.tree.leaves(grads):
      finite &= jnp.all(jnp.isfinite(g))
    return loss, grads, finite

  def apply(state: TrainState, grads: PyTree) -> TrainState:
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return TrainState(state.step + 1, optax.apply_updates(state.params, updates),
                      opt_state)
  return _Compiled(jax.jit(value_and_grad), jax.jit(apply))


# One pair of jitted functions per (loss_fn, optimizer): servers built again
# with the same functions, and ``simulate``, reuse the per-device executables
# (and compute bit-identical updates).
_build_cached = functools.lru_cache(maxsize=64)(_build)


def _compiled(loss_fn: Callable, optimizer: optax.GradientTransformation
              ) -> _Compiled:
  if not callable(loss_fn):
    raise TypeError(f'loss_fn must be a callable loss_fn(params, batch) -> '
                    f'scalar, got {type(loss_fn).__name__}: {loss_fn!r}.')
  check_optimizer(optimizer)
  try:
    hash((loss_fn, optimizer))
  except TypeError:  # an unhashable callable: jit it without caching
    return _build(loss_fn, optimizer)
  return _build_cached(loss_fn, optimizer)


def _check_staleness(staleness: Any) -> np.ndarray:
  arr = np.asarray(staleness)
  if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
    raise ValueError(
        f'staleness must be a non-empty 1-D sequence of ints (one per update), '
        f'got shape {arr.shape} and dtype {arr.dtype}: {staleness!r}.')
  bad = np.flatnonzero((arr < 0) | (arr > np.arange(arr.size)))
  if bad.size:
    i = int(bad[0])
    raise ValueError(
        f'staleness[{i}]={int(arr[i])} must be in [0, {i}]: update {i} can use '
        f'the params of {i} updates ago at most. Clip the trace with '
        f'np.minimum(staleness, np.arange(len(staleness))).')
  return arr.astype(np.int64)


def _iterate(batches: Any) -> Any:
  try:
    return iter(batches)
  except TypeError:
    raise TypeError(
        f'batches must be an iterable of batches (a list, generator or '
        f'iterator of pytrees of arrays), got {type(batches).__name__}.'
    ) from None


def simulate(loss_fn: Callable[[PyTree, PyTree], jax.Array],
             optimizer: optax.GradientTransformation, params: PyTree,
             batches: Iterable[PyTree], *,
             staleness: Sequence[int] | np.ndarray) -> AsyncResult:
  """Deterministic asynchronous training with a prescribed staleness trace.

  Update ``i`` (for ``i < n = len(staleness)``) computes
  ``loss_i, g_i = value_and_grad(loss_fn)(params_{i - staleness[i]}, batch_i)``
  and applies ``g_i`` with ``optimizer`` to the current params and optimizer
  state, unless ``loss_i`` or ``g_i`` is not finite: then update ``i`` is
  skipped (``params_{i+1} = params_i``, listed in ``skipped``). All-zero
  staleness is exactly sequential optax training; replaying a
  threaded run (its batches in ``batch_ids`` order, its ``staleness``)
  reproduces its params. Keeps ``max(staleness) + 1`` param versions.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch.
    optimizer: an optax ``GradientTransformation``.
    params: the initial parameters (version 0).
    batches: an iterable giving at least ``n`` batches; ``batch_i`` is the
      ``i``-th.
    staleness: ``n`` ints with ``0 <= staleness[i] <= i``.

  Returns:
    ``AsyncResult(params, staleness, losses, skipped=...)`` with
    ``workers``, ``batch_ids`` and ``retries`` left ``None``.

  Raises:
    TypeError: if ``loss_fn`` is not callable, ``optimizer`` is not optax or
      ``batches`` is not iterable.
    ValueError: if ``staleness`` is malformed or ``batches`` has fewer than
      ``n`` batches.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> loss = lambda w, b: jnp.mean((b['x'] @ w - b['y']) ** 2)
    >>> data = [{'x': jnp.ones((4, 2)), 'y': jnp.ones(4)}] * 3
    >>> res = jaxpar.async_ps.simulate(loss, optax.sgd(0.1), jnp.zeros(2),
    ...                                data, staleness=[0, 1, 1])
    >>> res.losses.shape
    (3,)
  """
  compiled = _compiled(loss_fn, optimizer)
  staleness = _check_staleness(staleness)
  state = TrainState.create(params, optimizer)
  # history[-1 - s] is the version of s updates ago (history[-1]: current).
  history = collections.deque([state.params], maxlen=int(staleness.max()) + 1)
  batch_iter = _iterate(batches)
  losses, skipped = [], []
  for i, s in enumerate(staleness):
    batch = next(batch_iter, _END)
    if batch is _END:
      raise ValueError(
          f'batches ran out after {i} batches but staleness has '
          f'{staleness.size} entries (one batch per update); pass at least '
          f'{staleness.size} batches or a shorter staleness trace.')
    loss, grads, finite = compiled.value_and_grad(history[-1 - s], batch)
    if bool(finite):
      state = compiled.apply(state, grads)
    else:
      skipped.append(i)
    history.append(state.params)
    losses.append(loss)
  return AsyncResult(state.params, staleness,
                     np.asarray(jax.device_get(losses)),
                     skipped=np.asarray(skipped, np.int64))


_END = object()  # end of a batch iterator
# server -> worker
_ACCEPTED, _RETRY, _DROPPED, _STOP = 'accepted', 'retry', 'dropped', 'stop'


class _Push(NamedTuple):
  worker: int
  version: int      # the params version the gradient was computed on
  batch_id: int
  retries: int
  loss: float
  grads: PyTree
  finite: bool


class _Failure(NamedTuple):
  worker: int
  error: BaseException


class AsyncParameterServer:
  """A parameter server with one worker thread per device (bounded staleness).

  Each worker repeatedly takes the next batch from the shared iterator, pulls
  the server's current params onto its device, computes
  ``value_and_grad(loss_fn)`` there (jitted; one executable per device) and
  pushes the gradient, tagged with the params version it used. The calling
  thread is the server: it applies pushes in arrival order with the jitted
  optax update, on ``devices[0]``, unless the push is more than
  ``max_staleness`` updates old; then the worker pulls fresh params and
  recomputes the gradient on the same batch. A non-finite loss or gradient is
  dropped and its batch listed in ``AsyncResult.skipped``; another batch
  takes its place. See the module docstring for the
  exact rule and ``simulate`` for its deterministic twin.

  The server keeps its ``state`` (a ``TrainState`` whose ``step`` is the
  params version) across calls to ``run``: a second ``run`` continues
  training. An exception in a worker (the batch iterator, ``loss_fn``, a bad
  batch) stops every worker and is re-raised from ``run`` with a note naming
  the worker; the updates applied before it stay in ``state``, the batches
  taken but not yet applied are discarded.

  Args:
    loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a batch.
    optimizer: an optax ``GradientTransformation``.
    params: the initial parameters (any pytree of arrays).
    num_workers: number of worker threads, ``1 <= num_workers <= len(devices)``;
      worker ``k`` computes on ``devices[k]``.
    max_staleness: the largest allowed staleness, an int ``>= 0``; ``0`` is
      sequential training.
    devices: the devices to use; defaults to ``jax.devices()``.

  Raises:
    TypeError: if ``loss_fn`` is not callable or ``optimizer`` is not optax.
    ValueError: if ``num_workers < 1``, ``max_staleness < 0``, or there are
      fewer (distinct) devices than workers.

  Example:
    >>> import jax.numpy as jnp, numpy as np, optax, jaxpar
    >>> loss = lambda w, b: jnp.mean((b['x'] @ w - b['y']) ** 2)
    >>> ps = jaxpar.AsyncParameterServer(loss, optax.sgd(0.1), jnp.zeros(2),
    ...                                  num_workers=4, max_staleness=2)
    >>> data = ({'x': np.ones((4, 2)), 'y': np.ones(4)} for _ in range(20))
    >>> res = ps.run(data, num_updates=20)
    >>> int(res.staleness.max()) <= 2, sorted(res.batch_ids) == list(range(20))
    (True, True)
  """

  def __init__(self, loss_fn: Callable[[PyTree, PyTree], jax.Array],
               optimizer: optax.GradientTransformation, params: PyTree, *,
               num_workers: int, max_staleness: int,
               devices: Sequence[jax.Device] | None = None):
    self._compiled = _compiled(loss_fn, optimizer)
    self.num_workers = check_int(
        'num_workers', num_workers, fix=
        'Use at least one worker (one worker thread per device).')
    self.max_staleness = check_int(
        'max_staleness', max_staleness, minimum=0, fix=
        'Use 0 for sequential training or a small bound such as 4.')
    devices = list(jax.devices() if devices is None else devices)
    if len(set(devices)) != len(devices):
      raise ValueError(f'devices contains a device twice: {devices}; each '
                       'worker needs its own device.')
    if self.num_workers > len(devices):
      raise ValueError(
          f'num_workers={self.num_workers} is more than the {len(devices)} '
          f'devices available (one worker per device); use num_workers <= '
          f'{len(devices)} or pass more devices.')
    self.devices = tuple(devices[:self.num_workers])
    self._state = jax.device_put(TrainState.create(params, optimizer),
                                 self.devices[0])

  @property
  def state(self) -> TrainState:
    """The server's ``TrainState``; ``state.step`` is the params version."""
    return self._state

  def run(self, batches: Iterable[PyTree], num_updates: int, *,
          max_skipped: int = 5) -> AsyncResult:
    """Trains asynchronously until ``num_updates`` more updates are applied.

    Args:
      batches: an iterable of batches (pytrees of arrays with a leading batch
        axis), shared by all workers; exactly ``num_updates`` are taken. An
        iterator continues where the previous run stopped; a sequence is
        iterated from its start.
      num_updates: the number of updates to apply, an int ``>= 1``.
      max_skipped: the non-finite pushes allowed in a row (an int ``>= 1``,
        the default of the demo's ``--max-skipped``); one more stops the run.

    Returns:
      ``AsyncResult`` of this run, update ``i`` being the ``i``-th applied:
      the final params and, per update, its staleness (``<= max_staleness``),
      loss, worker, batch position and retries; and the positions of the
      batches dropped for a non-finite gradient (``skipped``). ``batch_ids``
      and ``skipped`` together are ``range(num_updates + len(skipped))``.

    Raises:
      TypeError: if ``batches`` is not iterable.
      ValueError: if ``num_updates < 1``, ``max_skipped < 1`` or ``batches``
        runs out before ``num_updates`` updates are applied.
      jaxpar.TooManySkippedError: ``max_skipped`` pushes in a row had a
        non-finite loss or gradient; ``state`` keeps the updates applied
        before them.
      Exception: the first exception raised in a worker, re-raised unchanged
        (same type and message, its traceback from the worker) with a note.
    """
    num_updates = check_int('num_updates', num_updates,
                            fix='Ask for at least one update.')
    max_skipped = check_int('max_skipped', max_skipped, fix=
                            'It counts the non-finite pushes allowed in a row.')
    channel = _open_channel(batches, num_updates, self._state,
                            num_workers=self.num_workers)
    threads = [threading.Thread(
        target=_work, args=(k, device, self._compiled.value_and_grad, channel),
        name=f'jaxpar-async-ps-worker-{k}')
               for k, device in enumerate(self.devices)]
    try:
      for t in threads:
        t.start()
      updates, skipped = self._serve(channel, max_skipped)
    finally:
      _close_channel(channel, threads)
    staleness, losses, workers, batch_ids, retries = map(np.asarray,
                                                          zip(*updates))
    return AsyncResult(self._state.params, staleness, losses, workers,
                       batch_ids, retries,
                       np.asarray(sorted(skipped), np.int64))

  def _serve(self, channel: _Channel, max_skipped: int
             ) -> tuple[list[_Update], list[int]]:
    """Applies pushes in arrival order until ``num_updates`` are applied."""
    server = self.devices[0]
    version = int(self._state.step)
    updates, skipped, in_a_row = [], [], 0
    while len(updates) < channel.num_updates:
      msg = channel.pushes.get()
      if isinstance(msg, _Failure):
        msg.error.add_note(
            f'Raised in jaxpar.AsyncParameterServer worker {msg.worker} '
            f'({self.devices[msg.worker]}); the run stopped after '
            f'{len(updates)} of {channel.num_updates} updates, which are kept '
            f'in .state (step {version}).')
        raise msg.error
      if not msg.finite:   # dropped; the worker takes another batch
        with channel.take_lock:
          channel.board.dropped += 1
        skipped.append(msg.batch_id)
        in_a_row += 1
        if in_a_row >= max_skipped:
          raise _too_many_skipped(skipped[-in_a_row:], max_skipped,
                                  len(updates), channel.num_updates, version)
        channel.replies[msg.worker].put(_DROPPED)
        continue
      staleness = version - msg.version
      if staleness > self.max_staleness:
        channel.replies[msg.worker].put(_RETRY)
        continue
      self._state = self._compiled.apply(self._state,
                                         jax.device_put(msg.grads, server))
      version += 1
      channel.board.latest = (version, self._state.params)
      channel.replies[msg.worker].put(_ACCEPTED)
      in_a_row = 0
      updates.append(_Update(staleness, msg.loss, msg.worker, msg.batch_id,
                             msg.retries))
    return updates, skipped


class _Update(NamedTuple):
  """One applied update, as ``AsyncResult`` lists it."""
  staleness: int
  loss: float
  worker: int
  batch_id: int
  retries: int


@dataclasses.dataclass
class _Board:
  """What the server and the workers of one run read and write."""
  latest: tuple[int, PyTree]   # (version, params): replaced, never mutated
  taken: int = 0               # batches taken from the iterator
  dropped: int = 0             # ... dropped for a non-finite gradient


class _Channel(NamedTuple):
  """The plumbing between the server (the calling thread) and its workers."""
  batches: Iterator[PyTree]
  num_updates: int
  x64: bool                     # the caller's jax.enable_x64 (thread-local)
  board: _Board
  take_lock: threading.Lock     # guards board.taken / board.dropped
  stop: threading.Event
  pushes: queue.SimpleQueue     # worker -> server: _Push or _Failure
  replies: list[queue.SimpleQueue]   # server -> worker k: _ACCEPTED, ...


def _open_channel(batches: Iterable[PyTree], num_updates: int,
                  state: TrainState, *, num_workers: int) -> _Channel:
  batch_iter = _iterate(batches)
  if hasattr(batches, '__len__') and len(batches) < num_updates:
    raise ValueError(
        f'batches has {len(batches)} batches but run(num_updates='
        f'{num_updates}) takes one batch per update; pass at least '
        f'{num_updates} batches.')
  # JAX config contexts are thread-local: run the workers with the
  # caller's precision (e.g. under `with jax.enable_x64(True)`).
  return _Channel(batch_iter, num_updates, jax.enable_x64.value,
                  _Board((int(state.step), state.params)), threading.Lock(),
                  threading.Event(), queue.SimpleQueue(),
                  [queue.SimpleQueue() for _ in range(num_workers)])


def _close_channel(channel: _Channel, threads: list[threading.Thread]) -> None:
  """Stops every worker (waiting or computing) and joins its thread."""
  channel.stop.set()
  for r in channel.replies:
    r.put(_STOP)
  for t in threads:
    t.join()


def _work(k: int, device: jax.Device, value_and_grad: Callable,
          channel: _Channel) -> None:
  """Worker ``k``: takes batches and pushes their gradients until told to
  stop or the run has taken enough; an exception goes to the server."""
  try:
    with jax.enable_x64(channel.x64):
      while (taken := _take(channel)) is not None:
        if not _push_until_settled(k, device, value_and_grad, channel,
                                   *taken):
          return
  except BaseException as e:  # pylint: disable=broad-except
    channel.pushes.put(_Failure(k, e))


def _take(channel: _Channel) -> tuple[int, PyTree] | None:
  """``(position, batch)`` of the next batch, or ``None``: enough taken."""
  with channel.take_lock:
    board = channel.board
    if channel.stop.is_set() or board.taken - board.dropped >= (
        channel.num_updates):
      return None
    batch_id = board.taken
    batch = next(channel.batches, _END)
    if batch is _END:
      raise ValueError(
          f'batches ran out after {batch_id} batches but run(num_updates='
          f'{channel.num_updates}) takes one batch per update; pass at least '
          f'{channel.num_updates} batches.')
    board.taken += 1
    return batch_id, batch


def _push_until_settled(k: int, device: jax.Device, value_and_grad: Callable,
                        channel: _Channel, batch_id: int, batch: PyTree
                        ) -> bool:
  """Pushes gradients of ``batch`` on the latest params until the server
  accepts or drops one (``True``) or says stop (``False``)."""
  batch = jax.device_put(batch, device)
  retries = 0
  while True:
    pulled, params = channel.board.latest
    loss, grads, finite = value_and_grad(jax.device_put(params, device), batch)
    # Push when the gradient exists, not when it is dispatched.
    loss = float(jax.block_until_ready((loss, grads))[0])
    if channel.stop.is_set():
      return False
    channel.pushes.put(_Push(k, pulled, batch_id, retries, loss, grads,
                             bool(finite)))
    reply = channel.replies[k].get()
    if reply in (_ACCEPTED, _DROPPED):
      return True
    if reply == _STOP:
      return False
    retries += 1


def _too_many_skipped(batch_ids: list[int], max_skipped: int, applied: int,
                      num_updates: int, version: int) -> TooManySkippedError:
  return TooManySkippedError(
      f'{len(batch_ids)} pushes in a row had a non-finite loss or '
      f'gradient (batches {batch_ids} of this run); '
      f'stopped (max_skipped={max_skipped}) after {applied} of '
      f'{num_updates} updates. The server keeps its params and '
      f'optimizer state of step {version} in .state; check the '
      'data and loss_fn for NaN/inf, lower the learning rate, or '
      'raise max_skipped.')
