"""jaxpar.distributed: 2 processes x 4 CPU devices (gloo) == one process."""

import functools
import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import distributed_worker as worker
import launch_probe
import jaxpar
from jaxpar import checkpoint
from jaxpar import cli
from jaxpar import distributed
from jaxpar.models import gpt
from helpers import tree_allclose

TESTS = os.path.dirname(os.path.abspath(__file__))
ENV = (distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES,
       distributed.ENV_PROCESS_ID, distributed.ENV_LOCAL_DEVICE_COUNT,
       'JAX_COORDINATOR_ADDRESS')


@pytest.fixture
def worker_path(monkeypatch):
  """``python -m distributed_worker`` / ``launch_probe`` in launched processes."""
  monkeypatch.setenv('PYTHONPATH', os.pathsep.join(
      [TESTS] + [p for p in [os.environ.get('PYTHONPATH')] if p]))


@pytest.fixture
def own_cache(tmp_path, monkeypatch):
  """The launched processes' compilation cache, for this test alone, every
  program in it (not only those over JAX's 1 s): the resumed launch loads
  what the killed one compiled. The processes of one launch must reach their
  collectives together (gloo waits 30 s): a cache shared with a launch of
  the same programs running beside it, or with the other process (each
  process has its own folder in it: ``distributed_worker.main``), can hand
  one process a hit while the other compiles."""
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', str(tmp_path / 'jit_cache'))
  monkeypatch.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')


@pytest.fixture
def clean_env(monkeypatch):
  for name in ENV:
    monkeypatch.delenv(name, raising=False)


def _dense_gpt_reference():
  """Single-device optax training of the dense GPT on the drill's batches:
  the losses of steps 0..DRILL_STEPS-1, the final params."""
  cfg, params, opt = worker.gpt_setup()
  tx = optax.chain(optax.clip_by_global_norm(1.0), opt)

  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(
        functools.partial(gpt.gpt_loss, config=cfg))(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  opt_state, losses = tx.init(params), []
  for i in range(worker.DRILL_STEPS):
    params, opt_state, loss = step(params, opt_state, worker.gpt_batch(i))
    losses.append(float(loss))
  return losses, json.loads(json.dumps(jax.tree.map(
      lambda x: np.asarray(x).tolist(), params)))


def _losses(path):
  lines = [json.loads(line) for line in path.read_text().splitlines()]
  return lines[0]['resumed_from'], {r['step']: r['loss'] for r in lines[1:]}


def test_two_processes_match_one_process_through_a_kill_and_resume(
    tmp_path, worker_path, clean_env, own_cache, x64):
  """2 processes x 4 devices train the 3D GPT (data=2 x stage=2 x tensor=2,
  float64), saving at steps 2 and 4. SIGKILL process 1 after step 3, before
  the save of step 4: the launcher stops process 0 within seconds and
  returns -9. Both resume from the last checkpoint (step 2) and repeat steps
  2, 3 with bit-identical losses; every loss and the final params are those
  of dense single-device optax, and the final checkpoint restores bit for
  bit. Data parallel on data=8 over the 2
  processes == the same steps in one process."""
  killed, resumed, ckpt = tmp_path / 'killed', tmp_path / 'resumed', str(
      tmp_path / 'ckpt')
  killed.mkdir()
  resumed.mkdir()
  code = distributed.launch(2, [str(killed), ckpt, 'kill'],
                            devices_per_process=4, module='distributed_worker',
                            timeout=400)
  returned = time.time()
  assert code == -signal.SIGKILL
  kill_time = json.loads((killed / 'killed.jsonl').read_text())['time']
  assert returned - kill_time < 10.0   # SIGTERM, or SIGKILL after 5 s grace
  start, before = _losses(killed / 'losses.jsonl')
  assert start == 0 and sorted(before) == [0, 1, 2, 3]
  assert checkpoint.latest_step(ckpt) == 2

  code = distributed.launch(2, [str(resumed), ckpt],
                            devices_per_process=4, module='distributed_worker',
                            timeout=400)
  assert code == 0
  start, after = _losses(resumed / 'losses.jsonl')
  assert start == 2 and sorted(after) == [2, 3]
  assert [after[2], after[3]] == [before[2], before[3]]   # bit for bit
  assert checkpoint.latest_step(ckpt) == worker.DRILL_STEPS

  result = json.loads((resumed / 'result.json').read_text())
  assert (result['process_count'], result['local_device_count']) == (2, 4)
  assert result['restored_equal'] and result['gathered_equal']
  losses, params = _dense_gpt_reference()
  np.testing.assert_allclose([before[i] for i in range(4)], losses,
                             rtol=1e-10)
  tree_allclose(result['gpt'], params, rtol=1e-10, atol=1e-9)

  dp = worker.train_dp()
  np.testing.assert_allclose(result['dp']['losses'], dp['losses'], rtol=1e-12)
  tree_allclose(result['dp']['params'], dp['params'], rtol=1e-12, atol=0)


def test_launch_sets_the_environment(tmp_path, worker_path):
  code = distributed.launch(3, ['env', str(tmp_path)], devices_per_process=2,
                            port=12345, module='launch_probe', timeout=60)
  assert code == 0
  for i in range(3):
    env = json.loads((tmp_path / f'{i}.json').read_text())
    assert env == {'JAXPAR_COORDINATOR': '127.0.0.1:12345',
                   'JAXPAR_NUM_PROCESSES': '3', 'JAXPAR_PROCESS_ID': str(i),
                   'JAXPAR_LOCAL_DEVICE_COUNT': '2',
                   'cores': sorted(os.sched_getaffinity(0))}


def test_launch_runs_each_process_on_cores_of_its_own(tmp_path, worker_path,
                                                      capfd):
  """``cores_per_process=1`` (``--cores-per-process 1``): process ``i`` may
  run on the ``i``-th usable core alone."""
  usable = sorted(os.sched_getaffinity(0))
  if len(usable) < 2:
    pytest.skip(f'{len(usable)} usable core(s)')
  code = distributed.launch(2, ['env', str(tmp_path)], module='launch_probe',
                            timeout=60, cores_per_process=1)
  assert code == 0
  assert [json.loads((tmp_path / f'{i}.json').read_text())['cores']
          for i in range(2)] == [[usable[0]], [usable[1]]]
  with pytest.raises(SystemExit) as exit_:   # argparse's error, before any
    cli.main(['launch', '-n', '2', '--cores-per-process', str(len(usable)),
              '--', 'demo'])
  assert exit_.value.code == 2
  assert f'needs {2 * len(usable)} cores' in capfd.readouterr().err


def test_launch_stops_the_others_when_one_fails(worker_path, capfd):
  # The others sleep 120 s: only killing them returns before the timeout.
  code = distributed.launch(3, ['fail', '1'], module='launch_probe',
                            timeout=60)
  assert code == launch_probe.FAIL_CODE
  assert (f'process 1 exited with code {launch_probe.FAIL_CODE}'
          in capfd.readouterr().err)


def test_launch_timeout_kills_all(worker_path):
  with pytest.raises(TimeoutError, match='timeout=2'):
    distributed.launch(2, ['sleep'], module='launch_probe', timeout=2)


# -- Drills: the launcher in its own process, workers that ignore SIGTERM ---
# (as JAX workers of a jax.distributed job do), a 1 s grace.

DRILL_GRACE_S = 1.0


def _launcher(pid_dir):
  """``launch(2, ['stubborn', pid_dir], grace=1)`` in a process of its own
  (it prints what ``launch`` returned), and the workers' pids."""
  launcher = subprocess.Popen(
      [sys.executable, '-c',
       'import jaxpar.distributed as d; print("launch returned", d.launch('
       f'2, ["stubborn", {str(pid_dir)!r}], module="launch_probe", '
       f'grace={DRILL_GRACE_S}))'],
      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 60
  files = [pid_dir / f'{i}.pid' for i in range(2)]
  while not all(f.exists() for f in files):
    assert launcher.poll() is None and time.monotonic() < deadline, (
        launcher.communicate())
    time.sleep(0.05)
  return launcher, [int(f.read_text()) for f in files]


def _alive(pids):
  alive = []
  for pid in pids:
    try:
      os.kill(pid, 0)
      alive.append(pid)
    except ProcessLookupError:
      pass
  return alive


def _exits(err):
  """The report's ``--- process i exited with code c ...`` lines."""
  return [line for line in err.splitlines()
          if line.startswith('--- process ')]


def test_sigterm_to_the_launcher_leaves_no_worker_alive(tmp_path,
                                                        worker_path):
  """SIGTERM to the launcher goes to the workers, which ignore it; after the
  grace they get SIGABRT (a stack dump), each exit is named, ``launch``
  returns -15."""
  launcher, pids = _launcher(tmp_path)
  start = time.monotonic()
  launcher.send_signal(signal.SIGTERM)
  out, err = launcher.communicate(timeout=30)
  took = time.monotonic() - start
  assert _alive(pids) == []
  assert DRILL_GRACE_S <= took < DRILL_GRACE_S + 3, took
  assert 'launch returned -15' in out, (out, err)
  assert 'got SIGTERM' in err
  assert _exits(err) == [
      f'--- process {i} exited with code -6 = SIGABRT (the launcher sent '
      f'SIGTERM, then SIGABRT after {DRILL_GRACE_S:g} s: the stacks below); '
      'last output:' for i in range(2)]
  assert 'probe 1 ignores SIGTERM' in err     # the tails, with the stacks
  assert 'launch_probe.py", line' in err


def test_sigterm_with_the_terminal_gone(tmp_path, worker_path):
  """``launch ... | tee log`` and Ctrl-C stops ``tee`` too: the launcher's
  reports then meet a closed pipe, and it still stops every worker."""
  launcher, pids = _launcher(tmp_path)
  launcher.stdout.close()
  launcher.stderr.close()
  launcher.send_signal(signal.SIGTERM)
  launcher.wait(timeout=30)
  assert _alive(pids) == []


@pytest.mark.parametrize('rank', [0, 1])
def test_a_killed_worker_is_named_first(tmp_path, worker_path, rank):
  """``kill -9`` of worker 0 (the coordinator) or 1: the launcher names it
  first, stops the other (SIGTERM, SIGABRT after the grace) and returns
  -9."""
  launcher, pids = _launcher(tmp_path)
  start = time.monotonic()
  os.kill(pids[rank], signal.SIGKILL)
  out, err = launcher.communicate(timeout=30)
  took = time.monotonic() - start
  assert _alive(pids) == []
  assert took < DRILL_GRACE_S + 3, took
  assert 'launch returned -9' in out, (out, err)
  other = 1 - rank
  assert _exits(err) == [
      f'--- process {rank} exited with code -9 = SIGKILL (the first to '
      'fail); last output:',
      f'--- process {other} exited with code -6 = SIGABRT (the launcher sent '
      f'SIGTERM, then SIGABRT after {DRILL_GRACE_S:g} s: the stacks below); '
      'last output:']
  assert f'probe {rank} ignores SIGTERM' in err


def test_a_worker_stuck_inside_a_step_fails_the_run_in_bounded_time(
    worker_path, capfd):
  """Process 1 sleeps forever inside a step (an ``io_callback``) while
  process 0 waits in the step's all-reduce. With ``Timeouts(collective=5,
  shutdown=3)`` process 0's all-reduce raises after 5 s, its shutdown
  barrier gives up 3 s later naming process 1, every process stops, and the
  launcher names both exits with their tails (process 1's with its stack)."""
  start = time.monotonic()
  code = distributed.launch(2, ['stuck', '1'], module='launch_probe',
                            devices_per_process=1, grace=DRILL_GRACE_S,
                            timeout=300)
  took = time.monotonic() - start
  err = capfd.readouterr().err
  assert code != 0
  assert took < 120, took    # start-up and compile, 5 s, 3 s, the grace
  assert 'Timed out waiting 5000ms' in err
  assert 'Some timed out task names:\n1' in err   # the shutdown barrier
  assert sorted(line.split()[2] for line in _exits(err)) == ['0', '1']


@pytest.mark.parametrize('returned, status', [(0, 0), (3, 3), (-9, 137),
                                              (-15, 143)])
def test_launch_command_exit_status(monkeypatch, returned, status):
  """``python -m jaxpar launch`` exits with the code, 128 + s for signal s."""
  monkeypatch.setattr(distributed, 'launch', lambda *a, **k: returned)
  assert cli.main(['launch', '-n', '2', '--grace', '1', '--',
                          'demo']) == status


@pytest.mark.parametrize('kwargs, error, match', [
    (dict(num_processes=0), ValueError, 'num_processes=0'),
    (dict(argv='demo'), TypeError, 'list of str'),
    (dict(argv=['demo', 3]), TypeError, 'list of str'),
    (dict(devices_per_process=0), ValueError, 'devices_per_process=0'),
    (dict(port=70000), ValueError, 'port=70000'),
    (dict(timeout=0), ValueError, 'timeout=0'),
    (dict(grace=-1), ValueError, 'grace=-1'),
    (dict(cores_per_process=0), ValueError, 'cores_per_process=0'),
    (dict(cores_per_process=10_000), ValueError, 'needs 20000 cores'),
])
def test_launch_errors(kwargs, error, match):
  args = dict(num_processes=2, argv=['demo'])
  args.update(kwargs)
  with pytest.raises(error, match=match):
    distributed.launch(args.pop('num_processes'), args.pop('argv'), **args)


def test_initialize_single_process_is_a_no_op(clean_env):
  assert distributed.initialize() is None
  distributed.initialize(num_processes=1)
  distributed.initialize(local_device_count=jax.local_device_count())
  assert not jax.distributed.is_initialized()
  assert distributed.is_main_process()


@pytest.mark.parametrize('args, env, error, match', [
    (dict(coordinator='localhost'), {}, ValueError, 'host:port'),
    (dict(coordinator=1234), {}, TypeError, 'coordinator'),
    (dict(num_processes=0), {}, ValueError, 'num_processes=0'),
    (dict(num_processes=2, process_id=2), {}, ValueError, 'process_id=2'),
    (dict(local_device_count=0), {}, ValueError, 'local_device_count=0'),
    ({}, {distributed.ENV_NUM_PROCESSES: 'two'}, ValueError,
     'JAXPAR_NUM_PROCESSES'),
    (dict(timeouts=(5, 5, 5)), {}, TypeError, 'Timeouts'),
    (dict(timeouts=distributed.Timeouts(collective=0)), {}, ValueError,
     'timeouts.collective'),
    ({}, {distributed.ENV_SHUTDOWN_TIMEOUT: '0'}, ValueError,
     'timeouts.shutdown'),
    # Valid, but JAX already runs here with another layout.
    (dict(coordinator='127.0.0.1:1234', num_processes=2, process_id=0), {},
     RuntimeError, 'before any JAX operation'),
    (dict(local_device_count=4), {}, RuntimeError, 'before any JAX operation'),
])
def test_initialize_errors(args, env, error, match, clean_env, monkeypatch):
  for name, value in env.items():
    monkeypatch.setenv(name, value)
  with pytest.raises(error, match=match):
    distributed.initialize(**args)
  assert not jax.distributed.is_initialized()


def test_to_host():
  mesh = jaxpar.make_mesh(data=2, tensor=4)
  x = np.arange(32.0).reshape(4, 8)
  tree = {'x': jax.device_put(x, NamedSharding(mesh, P('data', 'tensor'))),
          'n': 3}
  host = distributed.to_host(tree)
  assert isinstance(host['x'], np.ndarray)
  np.testing.assert_array_equal(host['x'], x)
  assert host['n'] == 3
