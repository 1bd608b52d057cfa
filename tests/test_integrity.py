"""Checkpoint integrity: damaged, incomplete and killed saves are refused in one
line, never used; non-finite params are never written."""

import glob
import importlib.metadata
import json
import os
import random
import signal
import subprocess
import sys
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint_killer
import jaxpar
from jaxpar import checkpoint
from jaxpar.checkpoint import _integrity as integrity
from jaxpar.checkpoint import CheckpointError

TESTS = os.path.dirname(os.path.abspath(__file__))


def tree(v, spec=P('data', 'tensor')):
  mesh = jaxpar.make_mesh(data=2, tensor=4)
  return {'a': jax.device_put(jnp.arange(32.0).reshape(4, 8) * v,
                              NamedSharding(mesh, spec)),
          'n': np.arange(3) * v, 'h': jnp.full((5,), v, jnp.bfloat16)}


def equal(a, b):
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


def one_line(error):
  return len(str(error).splitlines()) == 1


def damage(pattern):
  """Zeroes 16 bytes in the middle of every file matching ``pattern``."""
  files = glob.glob(pattern, recursive=True)
  assert files, pattern
  for f in files:
    data = bytearray(open(f, 'rb').read())
    mid = len(data) // 2
    data[mid:mid + 16] = bytes(16)
    open(f, 'wb').write(data)


@pytest.fixture
def saved(tmp_path):
  for step in (1, 2):
    checkpoint.save(tmp_path / 'c', tree(step), step=step)
  return tmp_path / 'c'


def test_records_versions_and_sharding_independent_checksums(saved):
  record = json.loads((saved / '2' / integrity.RECORD).read_text())
  assert record['jax'] == jax.__version__ and record['format'] == 2
  assert record['jaxpar'] == importlib.metadata.version('jaxpar')
  assert record['num_processes'] == 1 and record['step'] == 2
  assert set(record['arrays']) == {'a', 'n', 'h'}
  files = json.loads((saved / '2' / integrity.FILES.format(0)).read_text())
  assert any('ocdbt.process_0' in f for f in files['files'])
  assert '_CHECKPOINT_METADATA' in files['files']
  # The same values give the same checksums on any sharding and in numpy;
  # one changed element or a permutation changes them.
  sums = integrity.array_checksums(tree(2))[0]
  assert sums == record['arrays']
  assert integrity.array_checksums(tree(2, P(None, 'tensor')))[0] == sums
  for sharding in (P(), P(None, 'tensor')):   # the device program, as on GPU
    assert integrity.array_checksums(tree(2, sharding),
                                     on_device=True)[0] == sums
  with pytest.raises(TypeError, match='on_device=1 must be True, False'):
    integrity.array_checksums(tree(2), on_device=1)
  assert integrity.array_checksums(jax.tree.map(np.asarray, tree(2)))[0] == sums
  a = np.asarray(tree(2)['a'])
  changed, swapped = a.copy(), a[::-1]
  changed[3, 7] = np.nextafter(changed[3, 7], np.float32(np.inf))  # 1 ulp
  for other in (changed, swapped):
    other = jax.device_put(other, tree(2)['a'].sharding)
    assert integrity.array_checksums({'a': other})[0]['a'] != sums['a']


def test_damaged_array_data_is_refused_and_skipped(saved):
  damage(str(saved / '2' / 'default' / 'ocdbt.process_0' / 'd' / '*'))
  with pytest.raises(CheckpointError, match=r'checkpoint step 2 .* is damaged: '
                     r'default/ocdbt\.process_0/d/\w+ \(array data written by '
                     r'process 0\) does not match the crc32 recorded at save; '
                     r'restore an earlier step') as info:
    checkpoint.restore(saved, tree(0), step=2)
  assert one_line(info.value) and isinstance(info.value, ValueError)
  with pytest.warns(UserWarning, match='skips step 2: .* is damaged'):
    assert checkpoint.latest_step(saved) == 1
  assert checkpoint.latest_step(saved, verify=False) == 2
  with pytest.warns(UserWarning, match='skips step 2'):
    assert equal(checkpoint.restore(saved, tree(0)), tree(1))


def test_damaged_metadata_is_refused_in_one_line(saved):
  damage(str(saved / '2' / 'default' / '_sharding'))
  with pytest.raises(CheckpointError, match=r'default/_sharding \(orbax '
                     r'metadata\) does not match') as info:
    checkpoint.restore(saved, tree(0), step=2)
  assert one_line(info.value)
  # Unverified, orbax's own error surfaces as the same kind of line.
  with pytest.raises(CheckpointError, match=r'checkpoint step 2 .* cannot be '
                     r'read: \w+') as info:
    checkpoint.restore(saved, tree(0), step=2, verify=False)
  assert one_line(info.value)


def test_value_mismatch_names_the_array(saved):
  path = saved / '2' / integrity.RECORD
  record = json.loads(path.read_text())
  record['arrays']['h'] ^= 1
  path.write_text(json.dumps(record))
  with pytest.raises(CheckpointError, match=r"step 2 .* array 'h' read back "
                     r'with checksum \d+, \d+ was saved'):
    checkpoint.restore(saved, tree(0), step=2)


def test_arrays_are_named_by_slash_paths_and_format_1_still_verified(
    tmp_path):
  nested = {'params': {'w': jnp.arange(4.0)}, 'opt': [jnp.ones(2)]}
  checkpoint.save(tmp_path / 'c', nested, step=1)
  path = tmp_path / 'c' / '1' / integrity.RECORD
  record = json.loads(path.read_text())
  assert set(record['arrays']) == {'params/w', 'opt/0'}
  # jaxpar 0.1 wrote format 1, its arrays keyed by '.'-joined paths.
  record['format'] = 1
  record['arrays'] = {k.replace('/', '.'): v
                      for k, v in record['arrays'].items()}
  path.write_text(json.dumps(record))
  assert equal(checkpoint.restore(tmp_path / 'c', nested), nested)
  record['arrays']['params.w'] ^= 1
  path.write_text(json.dumps(record))
  with pytest.raises(CheckpointError, match=r"step 1 .* array 'params/w' "
                     r'read back with checksum \d+, \d+ was saved'):
    checkpoint.restore(tmp_path / 'c', nested)


@pytest.mark.parametrize('remove', [integrity.RECORD,
                                    integrity.FILES.format(0)])
def test_incomplete_step_is_skipped(saved, remove):
  os.remove(saved / '2' / remove)
  with pytest.raises(CheckpointError, match=f'step 2 .* is incomplete: '
                     f'{remove} is missing'):
    checkpoint.restore(saved, tree(0), step=2)
  with pytest.warns(UserWarning, match='incomplete'):
    assert checkpoint.latest_step(saved) == 1
  assert equal(checkpoint.restore(saved, tree(0), step=2, verify=False),
               tree(2))


def test_no_good_step_left(saved):
  for step in ('1', '2'):
    os.remove(saved / step / integrity.RECORD)
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    assert checkpoint.latest_step(saved) is None
    with pytest.raises(CheckpointError, match=r'no step of .* passes '
                       r'verification \(steps \[1, 2\]'):
      checkpoint.restore(saved, tree(0))


def test_non_finite_params_are_never_written(tmp_path):
  state = jaxpar.TrainState(jnp.array(3, jnp.int32),
                            {'w': jnp.array([1.0, jnp.nan]), 'b': jnp.ones(2)},
                            {'best': jnp.array(jnp.inf)})
  checkpoint.save(tmp_path / 'c', state._replace(
      params={'w': jnp.ones(2), 'b': jnp.ones(2)}))   # inf opt state is fine
  with pytest.raises(CheckpointError, match=r"refusing to save step 3: leaves "
                     r"params/w hold NaN or inf"):
    checkpoint.save(tmp_path / 'c', state)
  with pytest.raises(CheckpointError, match=r'leaves x hold NaN'):
    checkpoint.save(tmp_path / 'c', {'x': np.array([np.inf])}, step=4)
  assert checkpoint.latest_step(tmp_path / 'c') == 3   # untouched
  assert sorted(os.listdir(tmp_path / 'c')) == ['3']


def _killer(directory, mode):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [TESTS] + [p for p in [os.environ.get('PYTHONPATH')] if p]),
             JAX_PLATFORMS='cpu')
  return subprocess.Popen(
      [sys.executable, os.path.join(TESTS, 'checkpoint_killer.py'),
       str(directory), mode], stdout=subprocess.PIPE, text=True, env=env)


def _check_survivors(directory, at_least):
  """The newest verified step restores to its own values."""
  with warnings.catch_warnings():
    warnings.simplefilter('ignore')
    step = checkpoint.latest_step(directory)
  assert step is not None and step >= at_least
  size = 64 if step == 1 else checkpoint_killer.LOOP_SIZE
  like = checkpoint_killer.tree(0, size)
  restored = checkpoint.restore(directory, like, step=step)
  assert equal(restored, checkpoint_killer.tree(step, size))
  return step


@pytest.mark.parametrize('mode', ['commit', 'record'])
def test_kill_during_save_keeps_the_previous_step(tmp_path, mode):
  proc = _killer(tmp_path / 'c', mode)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == -signal.SIGKILL, out
  assert 'saving 2' in out
  assert _check_survivors(tmp_path / 'c', 1) == 1
  if mode == 'record':   # orbax committed step 2, jaxpar's mark is missing
    assert checkpoint.latest_step(tmp_path / 'c', verify=False) == 2
    with pytest.raises(CheckpointError, match='incomplete'):
      checkpoint.restore(tmp_path / 'c', checkpoint_killer.tree(0), step=2)
  else:          # orbax never renamed its temporary directory
    assert checkpoint.latest_step(tmp_path / 'c', verify=False) == 1


def test_kill_at_a_random_moment_keeps_a_good_step(tmp_path):
  proc = _killer(tmp_path / 'c', 'loop')
  try:
    for line in proc.stdout:
      if line.startswith('saving 3'):   # steps 1, 2 done; 3 under way
        break
    time.sleep(random.Random(os.getpid()).uniform(0.0, 0.5))
  finally:
    proc.kill()
    proc.wait()
  assert _check_survivors(tmp_path / 'c', 2) >= 2
