"""``jaxpar.distributed.launch``: the workers die with their launcher.

The drill runs the launcher in a process of its own with two workers that
ignore SIGTERM (``launch_probe stubborn``), SIGKILLs the launcher and checks
that the kernel ends both workers within seconds (``PR_SET_PDEATHSIG``, on
Linux). The workers are then not this process's children: a worker counts as
gone when ``/proc`` no longer shows it running (a zombie counts as gone),
checked against its start time so a reused pid is not mistaken for it.
Whatever fails, no process started here is left behind.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from jaxpar.distributed import _launch

TESTS = os.path.dirname(os.path.abspath(__file__))
START_S = 60     # the launcher imports jaxpar: slow on a loaded machine
GONE_S = 5       # the workers must be gone this soon after the launcher

linux_only = pytest.mark.skipif(not sys.platform.startswith('linux'),
                                reason='PR_SET_PDEATHSIG and /proc are Linux')


def _start_time(pid: int) -> str | None:
  """The start time of running process ``pid`` (``/proc/<pid>/stat`` field
  22), or ``None`` if it is gone or a zombie."""
  try:
    with open(f'/proc/{pid}/stat') as f:
      stat = f.read()
  except (FileNotFoundError, ProcessLookupError):
    return None
  fields = stat[stat.rindex(')') + 2:].split()   # the name may hold spaces
  state, start = fields[0], fields[19]
  return None if state in 'ZXx' else start


def _running(workers: dict[int, str]) -> list[int]:
  """The pids of ``{pid: start time}`` still running."""
  return [pid for pid, start in workers.items() if _start_time(pid) == start]


def _launcher(pid_dir) -> subprocess.Popen:
  """``launch(2, ['stubborn', pid_dir])`` in a process of its own."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [TESTS] + [p for p in [os.environ.get('PYTHONPATH')] if p]))
  return subprocess.Popen(
      [sys.executable, '-c',
       'import jaxpar.distributed as d; d.launch(2, ["stubborn", '
       f'{str(pid_dir)!r}], module="launch_probe")'],
      env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _workers(launcher: subprocess.Popen, pid_dir) -> dict[int, str]:
  """``{pid: start time}`` of the launcher's two workers, once both run."""
  files = [pid_dir / f'{i}.pid' for i in range(2)]
  deadline = time.monotonic() + START_S
  while not all(f.exists() for f in files):
    assert launcher.poll() is None, launcher.stderr.read()
    assert time.monotonic() < deadline, 'the workers did not start'
    time.sleep(0.05)
  pids = [int(f.read_text()) for f in files]
  return {pid: _start_time(pid) for pid in pids}


@linux_only
def test_sigkill_to_the_launcher_ends_its_workers(tmp_path):
  """``kill -9`` of the launcher: both workers (which ignore SIGTERM) are
  gone within ``GONE_S`` seconds."""
  launcher = _launcher(tmp_path)
  workers = {}
  try:
    workers = _workers(launcher, tmp_path)
    assert len(_running(workers)) == 2
    launcher.kill()
    launcher.wait()
    start = time.monotonic()
    while _running(workers) and time.monotonic() < start + GONE_S:
      time.sleep(0.05)
    assert _running(workers) == [], (
        f'workers still running {GONE_S} s after the launcher was SIGKILLed')
  finally:
    for pid in _running(workers):
      os.kill(pid, signal.SIGKILL)
    if launcher.poll() is None:
      launcher.kill()
    launcher.wait()
    launcher.stderr.close()


PROBE = ('import ctypes, os, sys; s = ctypes.c_int(); '   # PR_GET_PDEATHSIG
         'ctypes.CDLL(None).prctl(2, ctypes.byref(s)); '
         'print(s.value, os.getpid(), sys.argv[1:])')


def _probe(command: list[str]) -> tuple[int, str]:
  """Runs ``command``: its pid and what ``PROBE`` printed."""
  child = subprocess.Popen(command, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
  out, err = child.communicate(timeout=60)
  assert child.returncode == 0, err
  return child.pid, out.strip()


@linux_only
def test_a_worker_asks_for_sigkill_when_its_launcher_dies():
  """The worker execs its command with SIGKILL as its parent-death signal,
  in the same process (a process started plainly has none)."""
  command = [sys.executable, '-c', PROBE, 'a b', '-m']
  pid, out = _probe(_launch._dies_with(os.getpid(), command))
  assert out == f"{int(signal.SIGKILL)} {pid} ['a b', '-m']"
  pid, out = _probe(command)
  assert out == f"0 {pid} ['a b', '-m']"


@linux_only
def test_a_worker_whose_launcher_already_died_exits():
  """The launcher died before the worker's request (the worker's parent is
  not the launcher): the worker kills itself before it runs its command."""
  not_the_parent = os.getppid()
  child = subprocess.Popen(
      _launch._dies_with(not_the_parent, [sys.executable, '-c', 'print(1)']),
      stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  out, err = child.communicate(timeout=60)
  assert child.returncode == -signal.SIGKILL, err
  assert out == b''
