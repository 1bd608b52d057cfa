"""The command line: the demo learns, any mesh gives the same losses, bad flags
fail in one line with exit code 2, runs of non-finite steps stop with exit
code 3, damaged checkpoints are refused with exit code 4."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from jaxpar import demo


def jaxpar_cli(*args, timeout=600):
  return subprocess.run([sys.executable, '-m', 'jaxpar', *args],
                        capture_output=True, text=True, timeout=timeout)


def demo_losses(tmp_path, *args):
  out = tmp_path / f'run{len(list(tmp_path.iterdir()))}.json'
  result = jaxpar_cli('demo', '--json', str(out), *args)
  assert result.returncode == 0, result.stderr[-3000:]
  return [s['loss'] for s in json.loads(out.read_text())['steps']]


def test_default_demo_learns(tmp_path):
  plot = tmp_path / 'run.png'
  losses = demo_losses(tmp_path, '--plot', str(plot))
  assert losses[-1] < 0.4 * losses[0]
  assert plot.stat().st_size > 10_000


SMALL = ('--steps', '3', '--layers', '4')


def test_any_mesh_gives_the_losses_of_one_device(tmp_path):
  """One CLI case (the library tests cover every mesh, schedule and ZeRO
  stage): ZB-V with ZeRO-3 on 2x2x2 against one device."""
  one = demo_losses(tmp_path, *SMALL, '--mesh', 'data=1,stage=1,tensor=1',
                    '--schedule', '1f1b')
  three_d = demo_losses(tmp_path, *SMALL, '--mesh', 'data=2,stage=2,tensor=2',
                        '--schedule', 'zbv', '--zero', '3')
  np.testing.assert_allclose(three_d, one, rtol=1e-4)
  assert one[-1] < one[0]


def test_launch_two_processes_gives_the_same_losses(tmp_path):
  out = tmp_path / 'launch.json'
  result = jaxpar_cli('launch', '-n', '2', '--devices-per-process', '4', '--',
                      'demo', *SMALL, '--json', str(out))
  assert result.returncode == 0, result.stdout[-3000:]
  launched = [s['loss'] for s in json.loads(out.read_text())['steps']]
  single = demo_losses(tmp_path, *SMALL)
  np.testing.assert_allclose(launched, single, rtol=1e-5)


TINY = ('--layers', '2', '--mesh', 'data=1,stage=1,tensor=1')


@pytest.fixture(scope='module')
def good_checkpoint(tmp_path_factory):
  """A 2-step tiny demo checkpoint (step 2)."""
  ckpt = tmp_path_factory.mktemp('good') / 'ckpt'
  result = jaxpar_cli('demo', '--steps', '2', *TINY, '--checkpoint', str(ckpt))
  assert result.returncode == 0, result.stderr[-3000:]
  return ckpt


def _snapshot(directory):
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob('*')) if p.is_file()}


def test_non_finite_steps_stop_with_exit_3(tmp_path, good_checkpoint):
  """lr=1e30 blows the params up at step 2: steps 3, 4 are skipped, the run
  stops (exit 3, one line), the checkpoint stays at step 2."""
  ckpt = tmp_path / 'ckpt'
  shutil.copytree(good_checkpoint, ckpt)
  before = _snapshot(ckpt)
  out = tmp_path / 'nan.json'
  result = jaxpar_cli('demo', '--steps', '10', *TINY, '--lr', '1e30',
                      '--max-skipped', '2', '--checkpoint', str(ckpt),
                      '--resume', '--json', str(out))
  assert result.returncode == 3, result.stderr[-3000:]
  assert 'Traceback' not in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert '2 consecutive steps were skipped' in result.stderr
  assert 'skipped       2 steps' in result.stdout
  report = json.loads(out.read_text())
  assert report['skipped'] == 2 and report['stopped']
  assert [s['skipped'] for s in report['steps']] == [False, True, True]
  assert _snapshot(ckpt) == before   # nothing written over the good step


@pytest.mark.parametrize('target', ['default/ocdbt.process_0/d/*',
                                    'default/_sharding'])
def test_damaged_checkpoint_is_refused_in_one_line(tmp_path, good_checkpoint,
                                                   target):
  ckpt = tmp_path / 'ckpt'
  shutil.copytree(good_checkpoint, ckpt)
  for f in (ckpt / '2').glob(target):
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(16)
    f.write_bytes(data)
  before = _snapshot(ckpt)
  result = jaxpar_cli('demo', '--steps', '4', *TINY, '--checkpoint',
                      str(ckpt), '--resume')
  assert result.returncode == 4
  assert 'Traceback' not in result.stderr
  assert len(result.stderr.strip().splitlines()) == 1, result.stderr
  assert 'checkpoint step 2' in result.stderr and 'damaged' in result.stderr
  assert _snapshot(ckpt) == before   # not trained from, not overwritten


def test_mesh_larger_than_the_devices_exits_2_in_one_line():
  result = jaxpar_cli('demo', '--mesh', 'data=4,stage=4,tensor=4')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'python -m jaxpar demo: error: --mesh data=4,stage=4,tensor=4 needs 64 '
      'devices but only 8 exist; use a smaller mesh or --devices']


@pytest.mark.parametrize('args, message', [
    (['--layers', '1'], '--layers 1 is fewer than the 2 pipeline stages of '
     '1f1b on stage=2; use --layers 2 or more'),
    (['--schedule', 'pipedream'], "invalid choice: 'pipedream'"),
    (['--steps', '0'], '--steps must be >= 1, got 0'),
    (['--max-skipped', '0'], '--max-skipped must be >= 1, got 0'),
    (['--zero', '2'], 'argument --zero: invalid choice: 2 (choose from 0, 1, '
     '3)'),
    (['--lr', 'nan'], '--lr must be a finite number > 0, got nan'),
    (['--lr', '-1'], '--lr must be a finite number > 0, got -1.0'),
    (['--dropout', '1'], '--dropout must be a rate in [0, 1), got 1.0'),
    (['--dropout', 'nan'], '--dropout must be a rate in [0, 1), got nan'),
    (['--dtype', 'float16'], "argument --dtype: invalid choice: 'float16'"),
    (['--resume'], '--resume needs --checkpoint DIR'),
    (['--batch', '30'], '--batch 30 must be a multiple of data x microbatches '
     '= 8'),
])
def test_bad_flags_exit_2_in_one_line(capsys, args, message):
  """Flag errors stop before any JAX work: one line naming the rule."""
  with pytest.raises(SystemExit) as exit_:
    demo.parse_args(args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and err.startswith(
      'python -m jaxpar demo: error: '), err
  assert message in err, err


TEXT = str(__import__('pathlib').Path(__file__).parent.parent / 'README.md')
TEXT_TINY = ('--data', TEXT, '--layers', '2', '--seq-len', '16', '--d-model',
             '16', '--heads', '2', '--batch', '4', '--microbatches', '2',
             '--mesh', 'data=1,stage=2,tensor=1', '--eval-every', '2')


def test_text_run_evaluates_and_writes_a_sample(tmp_path):
  out = tmp_path / 'text.json'
  result = jaxpar_cli('demo', *TEXT_TINY, '--steps', '4', '--sample', '24',
                      '--prompt', 'The ', '--json', str(out),
                      '--dtype', 'bfloat16', '--dropout', '0.1')
  assert result.returncode == 0, result.stderr[-3000:]
  report = json.loads(out.read_text())
  assert [e['step'] for e in report['eval']] == [0, 2, 4]
  assert report['eval'][-1]['loss'] < report['eval'][0]['loss']
  assert 0 < report['unigram_entropy'] < np.log(256)
  assert report['sample'].startswith('The ')
  speed = report['throughput']
  # 6N + 12LdS, L=2, d=16, S=16, V=256: N = 2 * 3280 (blocks) + 32 (final
  # LayerNorm) + 4352 (LM head) = 10944 (tests/test_text_data.py: by hand).
  assert speed["flops_per_token"] == 6 * 10944 + 12 * 2 * 16 * 16
  assert speed['flop_per_s'] == speed['tokens_per_s'] * speed['flops_per_token']
  assert speed['mfu'] is None and speed['single_device_tokens_per_s'] > 0
  for line in ('bfloat16 compute, dropout 0.1', 'held-out      ',
               'unigram entropy', 'tokens/s', 'GFLOP/s',
               'one device    ', "sample        24 bytes (greedy) after the "
               "prompt 'The '"):
    assert line in result.stdout, result.stdout


def test_resume_with_text_data_continues_bit_exactly(tmp_path):
  ckpt = str(tmp_path / 'ckpt')
  runs = []
  for args in (('--steps', '4'), ('--steps', '2', '--checkpoint', ckpt),
               ('--steps', '4', '--checkpoint', ckpt, '--resume')):
    out = tmp_path / f'{len(runs)}.json'
    result = jaxpar_cli('demo', *TEXT_TINY, *args, '--json', str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    runs.append(json.loads(out.read_text()))
  straight, first, rest = runs
  strip = lambda steps: [{k: s[k] for k in ('step', 'loss', 'grad_norm')}
                         for s in steps]
  assert strip(first['steps'] + rest['steps']) == strip(straight['steps'])
  assert first['eval'] + rest['eval'][1:] == straight['eval']
  assert rest['eval'][0] == first['eval'][-1]   # step 2, evaluated twice


@pytest.mark.parametrize('case,message', [
    ('missing', 'no such file; give the path of a text file'),
    ('directory', 'is a directory; give the path of a text file'),
    ('empty', 'has 0 bytes; sequences of 64 bytes need at least 650'),
    ('short', 'has 649 bytes; sequences of 64 bytes need at least 650'),
    ('unreadable', 'cannot be read (Not a directory)'),
])
def test_bad_data_exits_2_in_one_line(capsys, tmp_path, case, message):
  """Checked before any JAX work: one line naming the path and the fix."""
  path = tmp_path / case
  if case == 'directory':
    path.mkdir()
  elif case in ('empty', 'short'):
    path.write_bytes(b'x' * (649 if case == 'short' else 0))
  elif case == 'unreadable':   # as root, a chmod would not stop a read
    (tmp_path / 'file').write_bytes(b'x' * 1000)
    path = tmp_path / 'file' / 'text.txt'
  with pytest.raises(SystemExit) as exit_:
    demo.main(['--data', str(path)])
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1, err
  assert f'--data {path}' in err and message in err, err


@pytest.mark.parametrize('args,message', [
    (['--sample', '10'], '--sample needs --data PATH'),
    (['--eval-every', '5'], '--eval-every needs --data PATH'),
    (['--data', TEXT, '--prompt', 'x'], '--prompt and --temperature need '
     '--sample N'),
    (['--data', TEXT, '--sample', '5', '--temperature', '-1'],
     '--temperature must be a finite number >= 0'),
    (['--data', TEXT, '--sample', '0'], '--sample must be >= 1'),
    (['--d-model', '30', '--heads', '4'], 'not divisible by --heads 4'),
])
def test_bad_text_flags_exit_2_in_one_line(capsys, args, message):
  with pytest.raises(SystemExit) as exit_:
    demo.parse_args(args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and message in err, err
