"""Launching a multi-process run on this machine: ``launch``, ``free_port``.

``launch(N, argv)`` starts ``python -m jaxpar <argv...>`` N times with the
``JAXPAR_*`` variables that ``initialize`` (``_runtime.py``) reads, so the N
processes form one ``jax.distributed`` job with gloo collectives on CPU
(``python -m jaxpar launch -n N -- demo ...``). One failing process stops
them all; its exit code is returned.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import NamedTuple

from jaxpar.distributed._runtime import (ENV_COORDINATOR,
                                         ENV_LOCAL_DEVICE_COUNT,
                                         ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                                         _check_int)

_GRACE_S = 5.0     # SIGTERM -> SIGKILL
_POLL_S = 0.05
_LOG_TAIL = 4000   # characters of a failed process's output shown


def free_port() -> int:
  """A TCP port on localhost that is free now (for a local coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _stop(procs: list[subprocess.Popen]) -> None:
  """SIGTERM the running processes, SIGKILL those alive after a grace time."""
  for p in procs:
    if p.poll() is None:
      p.terminate()
  deadline = time.monotonic() + _GRACE_S
  for p in procs:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      p.kill()
      p.wait()


class _Exit(NamedTuple):
  process: int | None   # the first process that failed, or None
  code: int             # its exit code (a signal s gives -s), or 0


def launch(num_processes: int, argv: Sequence[str], *,
           devices_per_process: int | None = None, port: int | None = None,
           module: str = 'jaxpar', timeout: float | None = None) -> int:
  """Runs ``python -m <module> <argv...>`` as ``num_processes`` local processes.

  Process ``i`` gets ``JAXPAR_COORDINATOR=127.0.0.1:<port>``,
  ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID=i`` (and
  ``JAXPAR_LOCAL_DEVICE_COUNT``) in its environment, for ``initialize()`` to
  read. Process 0 writes to this process's stdout/stderr; the others' output
  is kept and shown (its tail) only if they fail. If one process exits with
  an error, the others are terminated at once (a JAX process would otherwise
  wait for the dead one in its next collective).

  Args:
    num_processes: ``N >= 1``.
    argv: the arguments after ``python -m <module>``, e.g.
      ``['demo', '--steps', '10']``.
    devices_per_process: simulated CPU devices per process; ``None`` leaves
      it to the program.
    port: the coordinator port on localhost; default a free one.
    module: the module to run (``python -m module``).
    timeout: seconds before all processes are killed and ``TimeoutError`` is
      raised; ``None`` waits forever.

  Returns:
    The first non-zero exit code (a signal ``s`` gives ``-s``), or 0.

  Raises:
    ValueError / TypeError: bad arguments.
    TimeoutError: ``timeout`` expired (all processes are killed first).

  Example:
    >>> # Two demo processes take a minute: not run as a doctest.
    >>> import jaxpar
    >>> jaxpar.distributed.launch(2, ['demo', '--steps', '20'],
    ...                           devices_per_process=4)  # doctest: +SKIP
    0
  """
  _check_launch(num_processes, argv, devices_per_process, port, timeout)
  port = free_port() if port is None else port
  procs, logs = [], []
  first_failure = _Exit(None, 0)
  try:
    for i in range(num_processes):
      log = None if i == 0 else tempfile.TemporaryFile()
      logs.append(log)
      procs.append(subprocess.Popen(
          [sys.executable, '-m', module, *argv],
          env=_process_env(i, num_processes, port, devices_per_process),
          stdout=log, stderr=None if log is None else subprocess.STDOUT))
    first_failure = _wait(procs, timeout, what=(
        f'{num_processes} processes of python -m {module} {" ".join(argv)}'))
  finally:
    _stop(procs)
    _show_output(first_failure, logs)
    for log in logs:
      if log is not None:
        log.close()
  return first_failure.code


def _check_launch(num_processes, argv, devices_per_process, port,
                  timeout) -> None:
  _check_int(num_processes, 'num_processes', 1)
  if isinstance(argv, str) or not isinstance(argv, Sequence) or not all(
      isinstance(a, str) for a in argv):
    raise TypeError(f'argv must be a list of str (e.g. ["demo", "--steps", '
                    f'"10"]), got {argv!r}.')
  _check_int(devices_per_process, 'devices_per_process', 1)
  _check_int(port, 'port', 1)
  if port is not None and port > 65535:
    raise ValueError(f'port={port!r} must be an int in 1..65535, or None for '
                     'a free one.')
  if timeout is not None and not timeout > 0:
    raise ValueError(f'timeout={timeout!r} must be > 0 seconds, or None.')


def _process_env(i: int, num_processes: int, port: int,
                 devices_per_process: int | None) -> dict[str, str]:
  """This environment plus the ``JAXPAR_*`` variables of process ``i``."""
  env = dict(os.environ)
  env.update({ENV_COORDINATOR: f'127.0.0.1:{port}',
              ENV_NUM_PROCESSES: str(num_processes),
              ENV_PROCESS_ID: str(i)})
  if devices_per_process is not None:
    env[ENV_LOCAL_DEVICE_COUNT] = str(devices_per_process)
  return env


def _wait(procs: list[subprocess.Popen], timeout: float | None, *,
          what: str) -> _Exit:
  """Polls until all exit or one fails; ``TimeoutError`` past ``timeout``."""
  deadline = None if timeout is None else time.monotonic() + timeout
  while any(p.poll() is None for p in procs):
    bad = [i for i, p in enumerate(procs) if p.poll() not in (None, 0)]
    if bad:
      return _Exit(bad[0], procs[bad[0]].returncode)
    if deadline is not None and time.monotonic() > deadline:
      _stop(procs)
      raise TimeoutError(f'launch: {what} ran past timeout={timeout}s and '
                         'were killed.')
    time.sleep(_POLL_S)
  bad = [i for i, p in enumerate(procs) if p.returncode != 0]
  return _Exit(bad[0], procs[bad[0]].returncode) if bad else _Exit(None, 0)


def _show_output(failure: _Exit, logs: list) -> None:
  """The tail of the failed process's output on stderr (process 0's is
  there already)."""
  if failure.process is not None and logs[failure.process] is not None:
    log = logs[failure.process]
    log.seek(0)
    tail = log.read().decode(errors='replace')[-_LOG_TAIL:]
    print(f'--- process {failure.process} exited with code {failure.code}; '
          f'last output:\n{tail}', file=sys.stderr)
