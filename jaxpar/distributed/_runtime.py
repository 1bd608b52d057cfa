"""Joining a multi-process run: ``initialize``, ``is_main_process``, ``to_host``.

JAX scales past one process with its multi-controller runtime: every process
runs the same program, sees all devices of all processes in
``jax.devices()`` (its own in ``jax.local_devices()``), and a mesh over all
of them makes one global array out of the shards each process holds. jaxpar's
train steps work unchanged on such a mesh:

* ``jax.device_put(x, NamedSharding(mesh, spec))`` of a host (numpy) array
  works across processes, each process filling its own devices' shards from
  its copy of ``x`` -- so every process must pass the *same* global ``x``
  (same seed; JAX does not check). To load only a process's part of the
  batch, use ``jax.make_array_from_process_local_data(sharding, local_x)``.
* A replicated result (``StepStats.loss``, ``Trainer.params(state)``) is
  read with ``float()`` / ``np.asarray`` in every process; a sharded one
  (a ``TrainState`` leaf split over devices of other processes) only with
  ``to_host``, which all-gathers it.
* ``jaxpar.checkpoint`` saves and restores from all processes together.

On CPU the collectives between processes run over gloo, which is how the
tests run two processes of four simulated devices each on one machine::

  python -m jaxpar launch --num-processes 2 -- demo ...     # or, in Python:
  jaxpar.distributed.launch(2, ['demo', ...], devices_per_process=4)

and each process starts with ``jaxpar.distributed.initialize()``, which reads
the ``JAXPAR_*`` variables ``launch`` (``_launch.py``) sets.
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.experimental import multihost_utils

from jaxpar import _compat
from jaxpar._validate import check_int
from jaxpar.train_state.internal import PyTree

ENV_COORDINATOR = 'JAXPAR_COORDINATOR'
ENV_NUM_PROCESSES = 'JAXPAR_NUM_PROCESSES'
ENV_PROCESS_ID = 'JAXPAR_PROCESS_ID'
ENV_LOCAL_DEVICE_COUNT = 'JAXPAR_LOCAL_DEVICE_COUNT'
ENV_COLLECTIVE_TIMEOUT = 'JAXPAR_COLLECTIVE_TIMEOUT'
ENV_HEARTBEAT_TIMEOUT = 'JAXPAR_HEARTBEAT_TIMEOUT'
ENV_SHUTDOWN_TIMEOUT = 'JAXPAR_SHUTDOWN_TIMEOUT'


class Timeouts(NamedTuple):
  """How long a multi-process run waits for a peer that stops answering,
  in seconds (``None``: JAX's and XLA's defaults, in brackets).

  Attributes:
    collective: a CPU (gloo) collective waits this long for its peers, then
      raises ``JaxRuntimeError`` (``Gloo ... Timed out waiting ...ms``) in
      the processes waiting (XLA's ``--xla_cpu_collective_timeout_seconds``
      [1800]). GPUs' NCCL collectives have their own.
    heartbeat: a process that sent no heartbeat for this long (killed,
      frozen, unreachable) is declared dead and every process stops, naming
      it (``jax.distributed``'s ``heartbeat_timeout_seconds`` [100]). A
      process stuck in Python keeps sending heartbeats: the collective
      timeout catches it.
    shutdown: at exit each process waits this long for the others at the
      shutdown barrier, then every process stops and the error names those
      that did not arrive (``Some timed out task names: 1``;
      ``shutdown_timeout_seconds`` [300]).
  """
  collective: int | None = None
  heartbeat: int | None = None
  shutdown: int | None = None


def _env_int(name: str) -> int | None:
  value = os.environ.get(name)
  if value is None or value == '':
    return None
  try:
    return int(value)
  except ValueError:
    raise ValueError(f'environment variable {name}={value!r} must be an '
                     'integer.') from None


def _check_int(value: Any, name: str, low: int) -> None:
  if value is not None:
    check_int(name, value, minimum=low, fix='Or None.')


def _check_coordinator(coordinator: str) -> None:
  host, _, port = coordinator.rpartition(':')
  if not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ValueError(
        f'coordinator={coordinator!r} must be "host:port" (the address of '
        'process 0 and a free port on it), e.g. "10.0.0.1:1234".')


def initialize(coordinator: str | None = None, num_processes: int | None = None,
               process_id: int | None = None, *,
               local_device_count: int | None = None,
               timeouts: Timeouts | None = None) -> None:
  """Joins this process to a multi-process JAX run (before any JAX operation).

  Wraps ``jax.distributed.initialize``. Each argument left ``None`` is read
  from ``JAXPAR_COORDINATOR`` / ``JAXPAR_NUM_PROCESSES`` /
  ``JAXPAR_PROCESS_ID`` / ``JAXPAR_LOCAL_DEVICE_COUNT`` (set by ``launch``);
  what is still unset is left to ``jax.distributed``, which reads
  ``JAX_COORDINATOR_ADDRESS`` and detects Slurm, Open MPI, Kubernetes and
  Cloud TPU jobs. With nothing set at all, or ``num_processes == 1``, it is a
  single-process run and ``jax.distributed`` is not started (only
  ``local_device_count`` is applied).

  Args:
    coordinator: ``"host:port"`` of process 0's coordinator service.
    num_processes: the number of processes ``N``.
    process_id: this process's index, ``0 <= process_id < N``.
    local_device_count: CPU devices this process simulates
      (``jax_num_cpu_devices``); ``None`` keeps JAX's default. Ignored by
      GPU/TPU backends, whose devices are the hardware's.
    timeouts: ``Timeouts(collective, heartbeat, shutdown)`` in seconds: how
      long a peer that stops answering is waited for. Each field left
      ``None`` is read from ``JAXPAR_COLLECTIVE_TIMEOUT`` /
      ``JAXPAR_HEARTBEAT_TIMEOUT`` / ``JAXPAR_SHUTDOWN_TIMEOUT``, else JAX's
      default holds. A process stuck inside a step then fails the others in
      about ``collective + shutdown`` seconds, the shutdown barrier naming
      it (``docs/reliability.md``).

  On CPU, cross-process collectives use gloo
  (``jax_cpu_collectives_implementation='gloo'``). Calling it again with the
  same processes and devices is a no-op.

  Raises:
    ValueError: a bad value (argument or environment variable).
    RuntimeError: JAX already started (devices are fixed then) with other
      processes or devices; call ``initialize`` first thing in the program.

  Example:
    >>> # First thing in each process (it cannot run here: JAX has started).
    >>> import jax, jaxpar
    >>> jaxpar.distributed.initialize('10.0.0.1:1234', 2, 0,
    ...                               local_device_count=4)  # doctest: +SKIP
    >>> jax.device_count(), jax.local_device_count()         # doctest: +SKIP
    (8, 4)
  """
  if coordinator is None:
    coordinator = os.environ.get(ENV_COORDINATOR) or None
  if num_processes is None:
    num_processes = _env_int(ENV_NUM_PROCESSES)
  if process_id is None:
    process_id = _env_int(ENV_PROCESS_ID)
  if local_device_count is None:
    local_device_count = _env_int(ENV_LOCAL_DEVICE_COUNT)
  if coordinator is not None:
    if not isinstance(coordinator, str):
      raise TypeError(f'coordinator must be a "host:port" str, got '
                      f'{type(coordinator).__name__}.')
    _check_coordinator(coordinator)
  _check_int(num_processes, 'num_processes', 1)
  _check_int(process_id, 'process_id', 0)
  _check_int(local_device_count, 'local_device_count', 1)
  timeouts = _timeouts(timeouts)
  if num_processes is not None and process_id is not None and (
      process_id >= num_processes):
    raise ValueError(f'process_id={process_id} must be < num_processes='
                     f'{num_processes} (processes are numbered 0..N-1).')
  single = num_processes == 1 or (
      coordinator is None and num_processes is None and process_id is None
      and not os.environ.get('JAX_COORDINATOR_ADDRESS'))
  if single and local_device_count is None:
    return

  if _compat.backends_are_initialized() or jax.distributed.is_initialized():
    same = (local_device_count in (None, jax.local_device_count())
            and (single or jax.distributed.is_initialized()
                 and num_processes in (None, jax.process_count())
                 and process_id in (None, jax.process_index())))
    if same:
      return
    raise RuntimeError(
        f'jaxpar.distributed.initialize(coordinator={coordinator!r}, '
        f'num_processes={num_processes}, process_id={process_id}, '
        f'local_device_count={local_device_count}) was called after JAX '
        f'started ({jax.process_count()} process(es), '
        f'{jax.local_device_count()} local device(s)). Call it before any JAX '
        'operation (first lines of the program), then restart the process.')
  if local_device_count is not None:
    jax.config.update('jax_num_cpu_devices', int(local_device_count))
  if single:
    return
  if timeouts.collective is not None:   # read when the CPU backend starts
    os.environ['XLA_FLAGS'] = ' '.join(filter(None, [
        os.environ.get('XLA_FLAGS'),
        f'--xla_cpu_collective_timeout_seconds={timeouts.collective}']))
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(
      coordinator, None if num_processes is None else int(num_processes),
      None if process_id is None else int(process_id),
      **{name: int(value) for name, value in (
          ('heartbeat_timeout_seconds', timeouts.heartbeat),
          ('shutdown_timeout_seconds', timeouts.shutdown))
         if value is not None})


def _timeouts(timeouts: Timeouts | None) -> Timeouts:
  """``timeouts`` checked, its ``None`` fields read from the environment."""
  if timeouts is None:
    timeouts = Timeouts()
  if not isinstance(timeouts, Timeouts):
    raise TypeError('timeouts must be a jaxpar.distributed.Timeouts('
                    'collective, heartbeat, shutdown) in seconds, got '
                    f'{type(timeouts).__name__}.')
  env = (ENV_COLLECTIVE_TIMEOUT, ENV_HEARTBEAT_TIMEOUT, ENV_SHUTDOWN_TIMEOUT)
  values = [_env_int(name) if value is None else value
            for value, name in zip(timeouts, env)]
  for value, field in zip(values, Timeouts._fields):
    _check_int(value, f'timeouts.{field}', 1)
  return Timeouts(*values)


def is_main_process() -> bool:
  """``True`` in process 0 (the one that should print, plot, write reports).

  Example:
    >>> import jaxpar
    >>> if jaxpar.distributed.is_main_process():   # process 0 of 1 here
    ...   print('only process 0 prints')
    only process 0 prints
  """
  return jax.process_index() == 0


def to_host(tree: PyTree) -> PyTree:
  """Every ``jax.Array`` leaf of ``tree`` as a numpy array, in every process.

  Arrays this process can read whole (fully addressable, or fully
  replicated) are copied; arrays sharded over other processes' devices are
  all-gathered (``multihost_utils.process_allgather``), which is a
  collective: every process must call ``to_host`` with the same tree.
  Other leaves are returned as they are. Single-process: ``np.asarray``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> w = jax.device_put(jnp.arange(8.0),
    ...                    jax.NamedSharding(mesh, P('data')))
    >>> jaxpar.distributed.to_host({'w': w, 'step': 3})   # numpy, global
    {'step': 3, 'w': array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)}
  """
  def one(x):
    if not isinstance(x, jax.Array):
      return x
    if x.is_fully_addressable or x.is_fully_replicated:
      return np.asarray(x)
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(one, tree)
