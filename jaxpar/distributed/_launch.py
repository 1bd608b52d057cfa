"""Launching a multi-process run on this machine: ``launch``, ``free_port``.

``launch(N, argv)`` starts ``python -m jaxpar <argv...>`` N times with the
``JAXPAR_*`` variables that ``initialize`` (``_runtime.py``) reads, so the N
processes form one ``jax.distributed`` job with gloo collectives on CPU
(``python -m jaxpar launch -n N -- demo ...``).

The launcher owns its workers: none outlives it.

* **Dying with the launcher.** On Linux each worker first asks the kernel
  for SIGKILL when the launcher dies (``PR_SET_PDEATHSIG``), then execs its
  command, so a launcher killed by SIGKILL or the OOM killer takes its
  workers with it at once, and no worker keeps holding devices. A worker
  whose launcher died before that request exits at once. Elsewhere (macOS)
  a SIGKILLed launcher leaves its workers running; every other way it ends
  stops them.
* **Stopping.** The workers get SIGTERM; those alive ``grace`` seconds later
  get SIGABRT, on which Python's fault handler (on in every worker) prints
  every thread's stack -- where a stuck worker hangs -- and those alive
  ``_ABORT_S`` later SIGKILL. A JAX worker of a ``jax.distributed`` job
  keeps running on SIGTERM (its preemption notifier takes the signal), so it
  always takes the grace.
* **One fails, all stop**, and ``launch`` returns the failed worker's code.
* **Signals are forwarded.** SIGTERM or SIGINT to the launcher (Slurm,
  Kubernetes, ``timeout``, Ctrl-C) stops the workers the same way, that
  signal first; ``launch`` returns ``-signum`` (the command line exits with
  ``128 + signum``).
* **Own cores, on request.** With ``cores_per_process=k`` worker ``i`` runs
  on cores ``[i k, (i + 1) k)`` of those the launcher may use
  (``os.sched_setaffinity`` before exec, which keeps it): XLA sizes a CPU
  process's thread pool by the cores it may use when its backend starts, so
  N unpinned workers on one host each start a pool as wide as the host
  (two compute threads per process on 2 cores in ``bench --only
  real_parallel`` before 0.18.1).
* **Every exit is named.** On a failure, a signal or a timeout, each worker's
  exit is one line ``--- process i exited with code c (...)`` on stderr with
  the tail of its output, the first failure first (at once, before the
  others are stopped). Process 0's output also streams to this process's
  stdout/stderr as it comes; the others' is kept for the report. Workers run
  with ``PYTHONUNBUFFERED=1`` (unless set), so a killed worker's last lines
  are in its tail.
"""

from __future__ import annotations

import codecs
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from typing import IO, NamedTuple

try:
  import resource
except ImportError:   # not on Windows
  resource = None

from jaxpar.distributed._runtime import (ENV_COORDINATOR,
                                         ENV_LOCAL_DEVICE_COUNT,
                                         ENV_NUM_PROCESSES, ENV_PROCESS_ID,
                                         _check_int)

GRACE_S = 5.0     # SIGTERM -> SIGABRT (a stack dump) ...
_ABORT_S = 2.0    # ... -> SIGKILL
_POLL_S = 0.05
_TAIL_LINES = 30   # lines of each worker's output in the report ...
_TAIL_CHARS = 4000   # ... at most this many characters
_FORWARDED = (signal.SIGTERM, signal.SIGINT)
# What a worker's interpreter runs first (``_dies_with``; argv: the parent's
# pid, the worker's cores (``0,1``; empty: any), then the command). prctl
# option 1 is PR_SET_PDEATHSIG; without ctypes or prctl the worker runs all
# the same.
_DIE_WITH_PARENT = """\
import os, signal, sys
try:
  import ctypes
  ctypes.CDLL(None).prctl(1, ctypes.c_ulong(signal.SIGKILL), ctypes.c_ulong(0),
                          ctypes.c_ulong(0), ctypes.c_ulong(0))
except (ImportError, OSError, AttributeError):
  pass
if os.getppid() != int(sys.argv[1]):
  os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2]:
  os.sched_setaffinity(0, [int(core) for core in sys.argv[2].split(',')])
os.execv(sys.argv[3], sys.argv[3:])
"""


def free_port() -> int:
  """A TCP port on localhost that is free now (for a local coordinator)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


class _Worker(NamedTuple):
  process: int                        # its JAXPAR_PROCESS_ID
  popen: subprocess.Popen
  log: IO[bytes]                      # all its output (stdout and stderr)
  tees: tuple[threading.Thread, ...]  # process 0: copies to our terminal


class _Exit(NamedTuple):
  """Why the launch ends: all done, the first worker that failed, a signal
  this process got, or the timeout."""
  process: int | None   # the first process that failed, or None
  code: int             # its exit code (a signal s gives -s), -signum, or 0
  signum: int | None = None   # a signal this process got
  timed_out: bool = False


class _Caught:
  """Signals received while ``_caught_signals`` is active (``signum``)."""
  signum: int | None = None


def launch(num_processes: int, argv: Sequence[str], *,
           devices_per_process: int | None = None, port: int | None = None,
           module: str = 'jaxpar', timeout: float | None = None,
           grace: float = GRACE_S,
           cores_per_process: int | None = None) -> int:
  """Runs ``python -m <module> <argv...>`` as ``num_processes`` local processes.

  Process ``i`` gets ``JAXPAR_COORDINATOR=127.0.0.1:<port>``,
  ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID=i`` (and
  ``JAXPAR_LOCAL_DEVICE_COUNT``) in its environment, for ``initialize()`` to
  read. Process 0's output streams to this process's stdout/stderr; every
  worker's is kept, and its tail shown with a line naming the process and its
  exit code if the run fails, the first failure first. If one process exits
  with an error, the others get SIGTERM at once, SIGABRT after ``grace`` (a
  stack dump in their output) and SIGKILL (a JAX process would otherwise
  wait for the dead one in its next collective); SIGTERM or SIGINT to this
  process are forwarded the same way. On Linux the kernel SIGKILLs the
  processes if this one dies, even by SIGKILL (``PR_SET_PDEATHSIG``).

  Args:
    num_processes: ``N >= 1``.
    argv: the arguments after ``python -m <module>``, e.g.
      ``['demo', '--steps', '10']``.
    devices_per_process: simulated CPU devices per process; ``None`` leaves
      it to the program.
    port: the coordinator port on localhost; default a free one.
    module: the module to run (``python -m module``).
    timeout: seconds before all processes are stopped and ``TimeoutError``
      is raised; ``None`` waits forever.
    grace: seconds between SIGTERM (or the signal forwarded) and SIGABRT
      when the workers are stopped.
    cores_per_process: ``k``: process ``i`` runs on cores ``[i k, (i + 1)
      k)`` of ``sorted(os.sched_getaffinity(0))`` (Linux), so that each
      computes on cores of its own (module doc); ``None`` leaves placement
      to the OS.

  Returns:
    The first non-zero exit code (a signal ``s`` gives ``-s``), ``-signum``
    if this process got SIGTERM/SIGINT, or 0.

  Raises:
    ValueError / TypeError: bad arguments.
    TimeoutError: ``timeout`` expired (all processes are stopped first).

  Example:
    >>> # Two demo processes take a minute: not run as a doctest.
    >>> import jaxpar
    >>> jaxpar.distributed.launch(2, ['demo', '--steps', '20'],
    ...                           devices_per_process=4)  # doctest: +SKIP
    0
  """
  _check_launch(num_processes, argv, devices_per_process, port, timeout,
                grace)
  cores = _cores(num_processes, cores_per_process)
  port = free_port() if port is None else port
  what = f'{num_processes} processes of python -m {module} {" ".join(argv)}'
  command = [sys.executable, '-m', module, *argv]
  workers: list[_Worker] = []
  end = _Exit(None, 0)
  with _caught_signals() as caught:
    try:
      for i in range(num_processes):
        workers.append(_start(i, _dies_with(os.getpid(), command, cores[i]),
                              _process_env(i, num_processes, port,
                                           devices_per_process)))
      end = _wait(workers, timeout, caught)
    finally:
      _finish(workers, end, grace)
  if end.timed_out:
    raise TimeoutError(f'launch: {what} ran past timeout={timeout}s and were '
                       'stopped.')
  return end.code


def _check_launch(num_processes, argv, devices_per_process, port,
                  timeout, grace) -> None:
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
  if isinstance(grace, bool) or not isinstance(grace, (int, float)) or not (
      0 <= grace < float('inf')):
    raise ValueError(f'grace={grace!r} must be >= 0 seconds (between SIGTERM '
                     f'and SIGKILL), e.g. {GRACE_S}.')


def _cores(num_processes: int, cores_per_process: int | None
           ) -> list[tuple[int, ...]]:
  """Each process's cores (``launch``'s ``cores_per_process``; ``()``:
  any)."""
  if cores_per_process is None:
    return [()] * num_processes
  _check_int(cores_per_process, 'cores_per_process', 1)
  if not hasattr(os, 'sched_setaffinity'):
    raise ValueError(f'cores_per_process={cores_per_process} needs '
                     'os.sched_setaffinity (Linux); pass None here.')
  usable, k = sorted(os.sched_getaffinity(0)), cores_per_process
  if len(usable) < num_processes * k:
    raise ValueError(
        f'cores_per_process={k} for {num_processes} processes needs '
        f'{num_processes * k} cores; this process may use {len(usable)} '
        f'({usable}): lower it, or pass None to let the OS place them.')
  return [tuple(usable[i * k:(i + 1) * k]) for i in range(num_processes)]


def _dies_with(parent: int, command: list[str],
               cores: tuple[int, ...] = ()) -> list[str]:
  """``command``, run so that it dies with process ``parent`` (Linux), on
  ``cores`` (``()``: any).

  The worker's interpreter first asks the kernel for SIGKILL when its parent
  dies (``PR_SET_PDEATHSIG``, which exec keeps), kills itself if its parent
  is no longer ``parent`` (it died before the request), pins itself to
  ``cores`` (which exec keeps too), then execs ``command``: same pid, same
  command line. Elsewhere ``command`` as it is (``_cores`` gives no cores
  there).

  The kernel sends the signal when the *thread* that started the worker
  ends: ``launch`` starts them from the thread that called it and stops
  every worker before it returns. No Python runs between fork and exec (no
  ``preexec_fn``), so a process running JAX's threads may launch.
  """
  if not sys.platform.startswith('linux'):
    return command
  return [sys.executable, '-S', '-c', _DIE_WITH_PARENT, str(parent),
          ','.join(map(str, cores)), *command]


def _process_env(i: int, num_processes: int, port: int,
                 devices_per_process: int | None) -> dict[str, str]:
  """This environment plus the ``JAXPAR_*`` variables of process ``i`` (and,
  unless set, ``PYTHONUNBUFFERED=1``: a killed worker loses no output;
  ``PYTHONFAULTHANDLER=1``: SIGABRT prints its Python stacks)."""
  env = dict(os.environ)
  env.update({ENV_COORDINATOR: f'127.0.0.1:{port}',
              ENV_NUM_PROCESSES: str(num_processes),
              ENV_PROCESS_ID: str(i)})
  env.setdefault('PYTHONUNBUFFERED', '1')
  env.setdefault('PYTHONFAULTHANDLER', '1')   # SIGABRT prints the stacks
  if devices_per_process is not None:
    env[ENV_LOCAL_DEVICE_COUNT] = str(devices_per_process)
  return env


@contextlib.contextmanager
def _caught_signals() -> Iterator[_Caught]:
  """Records SIGTERM/SIGINT in the yielded ``_Caught`` instead of dying (in
  the main thread; elsewhere signals cannot be caught and keep their
  handlers); the previous handlers come back on exit."""
  caught = _Caught()
  if threading.current_thread() is not threading.main_thread():
    yield caught
    return

  def record(signum, frame):
    del frame
    if caught.signum is None:
      caught.signum = signum
  previous = {s: signal.signal(s, record) for s in _FORWARDED}
  try:
    yield caught
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _start(i: int, command: list[str], env: dict[str, str]) -> _Worker:
  """Process ``i``: its output into a temporary file (process 0's copied to
  this process's stdout/stderr as well, as it comes)."""
  log = tempfile.TemporaryFile('a+b')   # appends wherever a report reads
  if i != 0:
    popen = subprocess.Popen(command, env=env, stdout=log,
                             stderr=subprocess.STDOUT)
    return _Worker(i, popen, log, ())
  popen = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE)
  lock = threading.Lock()
  tees = tuple(threading.Thread(target=_tee, args=(pipe, out, log, lock),
                                daemon=True)
               for pipe, out in ((popen.stdout, 'stdout'),
                                 (popen.stderr, 'stderr')))
  for tee in tees:
    tee.start()
  return _Worker(i, popen, log, tees)


def _tee(pipe: IO[bytes], out: str, log: IO[bytes],
         lock: threading.Lock) -> None:
  """Copies ``pipe`` to ``sys.<out>`` (looked up per chunk: a test may swap
  it) and to ``log`` until the process closes it; a terminal that went away
  (a closed pipe) only stops the copy to it, the pipe is still drained."""
  decoder = codecs.getincrementaldecoder('utf-8')(errors='replace')
  terminal = True
  while chunk := os.read(pipe.fileno(), 65536):
    with lock:
      log.write(chunk)
      log.flush()
    if terminal:
      try:
        stream = getattr(sys, out)
        stream.write(decoder.decode(chunk))
        stream.flush()
      except (OSError, ValueError):
        terminal = False
  pipe.close()


def _wait(workers: list[_Worker], timeout: float | None,
          caught: _Caught) -> _Exit:
  """Polls until all exit, one fails, this process gets a signal or
  ``timeout`` passes (``_Exit``)."""
  deadline = None if timeout is None else time.monotonic() + timeout
  while any(w.popen.poll() is None for w in workers):
    if caught.signum is not None:
      return _Exit(None, -caught.signum, caught.signum)
    failed = [w for w in workers if w.popen.poll() not in (None, 0)]
    if failed:
      return _Exit(failed[0].process, failed[0].popen.returncode)
    if deadline is not None and time.monotonic() > deadline:
      return _Exit(None, 0, timed_out=True)
    time.sleep(_POLL_S)
  failed = [w for w in workers if w.popen.returncode != 0]
  return (_Exit(failed[0].process, failed[0].popen.returncode) if failed
          else _Exit(None, 0))


def _finish(workers: list[_Worker], end: _Exit, grace: float) -> None:
  """Reports the first failure, stops the rest (forwarding a signal this
  process got), reports their exits, closes the logs. The workers are
  stopped whatever happens to the reports."""
  failed = end.process is not None
  stopping = failed or end.signum is not None or end.timed_out or any(
      w.popen.poll() is None for w in workers)   # e.g. an exception here
  sent = {}
  try:
    if failed:
      _report(workers[end.process], 'the first to fail')
    elif end.signum is not None:
      _say(f'--- launch: got {signal.Signals(end.signum).name}; forwarding '
           f'it to the {len(workers)} processes, SIGKILL after {grace:g} s')
    elif end.timed_out:
      _say(f'--- launch: timeout; stopping the {len(workers)} processes '
           f'(SIGTERM, SIGKILL after {grace:g} s)')
  finally:
    sent = _stop(workers, end.signum or signal.SIGTERM, grace)
  for tee in (t for w in workers for t in w.tees):   # process 0's last lines
    tee.join(timeout=1.0)
  if stopping:
    for w in workers:
      if w.process != end.process:
        _report(w, sent.get(w.process, 'on its own'))
  for w in workers:
    w.log.close()


def _stop(workers: list[_Worker], signum: int, grace: float
          ) -> dict[int, str]:
  """``signum`` to the running workers; to those alive after ``grace``
  seconds SIGABRT (Python's fault handler, on in every worker, prints where
  each thread is: the report shows where a stuck worker hangs; no core
  file), then SIGKILL after ``_ABORT_S``. ``{process: what was sent}``."""
  name = signal.Signals(signum).name
  sent = {}
  for w in workers:
    if w.popen.poll() is None:
      w.popen.send_signal(signum)
      sent[w.process] = f'the launcher sent {name}'
  _wait_all(workers, grace)
  for w in workers:
    if w.popen.poll() is None:
      _no_core_file(w.popen.pid)
      w.popen.send_signal(signal.SIGABRT)
      sent[w.process] += (f', then SIGABRT after {grace:g} s: the stacks '
                          'below')
  _wait_all(workers, _ABORT_S)
  for w in workers:
    if w.popen.poll() is None:
      w.popen.kill()
      w.popen.wait()
      sent[w.process] += ', then SIGKILL'
  return sent


def _wait_all(workers: list[_Worker], seconds: float) -> None:
  """Waits up to ``seconds`` in all for the workers to exit."""
  deadline = time.monotonic() + seconds
  for w in workers:
    with contextlib.suppress(subprocess.TimeoutExpired):
      w.popen.wait(timeout=max(0.0, deadline - time.monotonic()))


def _no_core_file(pid: int) -> None:
  """A SIGABRT the launcher sends writes no core file (Linux; elsewhere the
  user's limit holds)."""
  prlimit = getattr(resource, 'prlimit', None)   # Linux
  if prlimit is not None:
    with contextlib.suppress(OSError, ValueError):
      prlimit(pid, resource.RLIMIT_CORE, (0, prlimit(
          pid, resource.RLIMIT_CORE)[1]))


def _report(worker: _Worker, why: str) -> None:
  """``--- process i exited with code c[ = SIGNAME] (why); last output:``
  and the tail of its output, on stderr."""
  for tee in worker.tees:   # process 0: the rest of its output first
    tee.join(timeout=1.0)
  code, name = worker.popen.returncode, ''
  if code is not None and code < 0:
    with contextlib.suppress(ValueError):
      name = f' = {signal.Signals(-code).name}'
  _say(f'--- process {worker.process} exited with code {code}{name} ({why}); '
       f'last output:\n{_tail(worker.log)}')


def _say(text: str) -> None:
  """``text`` on stderr, if it is still there (a closed pipe is no reason
  to leave workers behind)."""
  with contextlib.suppress(OSError, ValueError):
    print(text, file=sys.stderr, flush=True)


def _tail(log: IO[bytes]) -> str:
  """The last ``_TAIL_LINES`` lines (at most ``_TAIL_CHARS`` characters) of
  a worker's output."""
  log.seek(0, os.SEEK_END)
  size = log.tell()
  log.seek(max(0, size - 4 * _TAIL_CHARS))
  text = log.read().decode(errors='replace')
  lines = text.splitlines()[-_TAIL_LINES:]
  return '\n'.join(lines)[-_TAIL_CHARS:] or '(no output)'
