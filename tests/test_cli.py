"""The command line (jaxpar.cli): the parser's commands, help and errors; the
demo learns, any mesh gives the same losses, bad flags fail in one line with
exit code 2, runs of non-finite steps stop with exit code 3, damaged
checkpoints are refused with exit code 4; the demo's held-out loss is the
dense model's.

``python -m jaxpar`` runs as a process where the process is the point (the
default demo end to end, ``launch``, an exit code with nothing else on
stderr); the other runs call the same ``main`` in this process, their
output and exit code read the same way (``capfd``: file descriptors, so
what JAX, orbax or absl print is caught as in a subprocess).
"""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import __main__ as cli
from jaxpar.cli import demo, demo_args, text_data
from jaxpar.models import gpt
from helpers import random_gpt_params


def jaxpar_cli(*args, timeout=600, env=None):
  """``python -m jaxpar ARGS`` as a process."""
  return subprocess.run([sys.executable, '-m', 'jaxpar', *args],
                        capture_output=True, text=True, timeout=timeout,
                        env=env)


def llvm_optimised():
  """The environment without conftest.py's LLVM level 0 and fusion emitters
  off, for a process that runs more than it compiles: the default demo's
  150 steps took 85 s of CPU at level 0 and 58 s at XLA's default level (2
  cores), and no less without the fusion emitters (81 s against 76)."""
  flags = os.environ.get('XLA_FLAGS', '').split()
  return dict(os.environ, XLA_FLAGS=' '.join(
      f for f in flags if f not in ('--xla_backend_optimization_level=0',
                                    '--xla_cpu_use_fusion_emitters=false')))


def run_cli(capfd, *args):
  """``python -m jaxpar ARGS`` in this process: (exit code, stdout, stderr)."""
  capfd.readouterr()
  try:
    code = cli.main(list(args))
  except SystemExit as e:   # argparse errors
    code = e.code
  out, err = capfd.readouterr()
  return code, out, err


def losses(report):
  return [s['loss'] for s in report['steps']]


# A small model for the runs whose point is not its size or speed: 4 layers
# (ZB-V on stage=2 has 4 stages), 1 microbatch on one device, no throughput
# baseline (one more program; the text run checks it).
TINY = ('--layers', '4', '--d-model', '16', '--heads', '2', '--seq-len', '8',
        '--batch', '8', '--no-baseline')
ONE_DEVICE = ('--mesh', 'data=1,stage=1,tensor=1', '--microbatches', '1',
              *TINY)


@pytest.fixture(scope='module', autouse=True)
def cache_every_program(monkeypatch_module):
  """Every program these runs compile goes to the run's compilation cache,
  not only those over JAX's 1 s: the in-process runs repeat each other's
  programs (a run and its resume, the checkpoint drills)."""
  monkeypatch_module.setenv('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
  before = jax.config.jax_persistent_cache_min_compile_time_secs
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  yield
  jax.config.update('jax_persistent_cache_min_compile_time_secs', before)


@pytest.fixture(scope='module')
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


@pytest.fixture(scope='module')
def one_device_run(tmp_path_factory):
  """3 steps of the small model on one device, in this process:
  ``(losses, checkpoint directory)``."""
  tmp = tmp_path_factory.mktemp('one')
  assert cli.main(['demo', '--steps', '3', *ONE_DEVICE, '--json',
                   str(tmp / 'one.json'), '--checkpoint',
                   str(tmp / 'ckpt')]) == 0
  return losses(json.loads((tmp / 'one.json').read_text())), tmp / 'ckpt'


@pytest.fixture
def one_device_losses(one_device_run):
  return one_device_run[0]


@pytest.fixture
def good_checkpoint(one_device_run):
  """The one-device run's checkpoint (step 3)."""
  return one_device_run[1]


def test_default_demo_learns(tmp_path):
  """The README's first command, as a process: 150 steps of 1F1B on
  data=2 x stage=2 x tensor=2 (its losses against one device: the launch
  test below), with the one-device throughput contrast."""
  plot, out = tmp_path / 'run.png', tmp_path / 'run.json'
  result = jaxpar_cli('demo', '--plot', str(plot), '--json', str(out),
                      env=llvm_optimised())
  assert result.returncode == 0, result.stderr[-3000:]
  assert '(8 cpu devices, 1 process(es))' in result.stdout
  report = json.loads(out.read_text())
  got = losses(report)
  assert len(got) == 150 and got[-1] < 0.4 * got[0]
  assert plot.stat().st_size > 10_000
  # The throughput contrast on CPU: a plain jitted step on one device.
  assert report['throughput']['single_device_tokens_per_s'] > 0
  assert 'one device    ' in result.stdout


def test_two_processes_give_the_losses_of_one_device(tmp_path,
                                                     one_device_losses):
  """``launch``: 2 processes x 4 devices, ZB-V with ZeRO-3 on 2x2x2 (the
  library tests cover every mesh, schedule and ZeRO stage) == one device
  in one process."""
  out = tmp_path / 'launch.json'
  result = jaxpar_cli('launch', '-n', '2', '--devices-per-process', '4', '--',
                      'demo', '--steps', '3', *TINY, '--schedule', 'zero_bubble_v',
                      '--microbatches', '2', '--zero', '3', '--json', str(out))
  assert result.returncode == 0, result.stdout[-3000:]
  assert '(8 cpu devices, 2 process(es))' in result.stdout
  np.testing.assert_allclose(losses(json.loads(out.read_text())),
                             one_device_losses, rtol=1e-4)


def _snapshot(directory):
  return {str(p.relative_to(directory)): p.read_bytes()
          for p in sorted(directory.rglob('*')) if p.is_file()}


def test_non_finite_steps_stop_with_exit_3(tmp_path, good_checkpoint, capfd):
  """lr=1e30 blows the params up at step 3: steps 4, 5 are skipped, the run
  stops (exit 3, one line), the checkpoint stays at step 3."""
  ckpt = tmp_path / 'ckpt'
  shutil.copytree(good_checkpoint, ckpt)
  before = _snapshot(ckpt)
  out = tmp_path / 'nan.json'
  code, stdout, err = run_cli(capfd, 'demo', '--steps', '10', *ONE_DEVICE, '--lr',
                              '1e30', '--max-skipped', '2', '--checkpoint',
                              str(ckpt), '--resume', '--json', str(out))
  assert code == 3, err[-3000:]
  assert len(err.strip().splitlines()) == 1, err
  assert '2 consecutive steps were skipped' in err
  assert 'skipped       2 steps' in stdout
  report = json.loads(out.read_text())
  assert report['skipped'] == 2 and report['stopped']
  assert [s['skipped'] for s in report['steps']] == [False, True, True]
  assert _snapshot(ckpt) == before   # nothing written over the good step


@pytest.mark.parametrize('target', ['default/ocdbt.process_0/d/*',
                                    'default/_sharding'])
def test_damaged_checkpoint_is_refused_in_one_line(tmp_path, good_checkpoint,
                                                   target, capfd):
  ckpt = tmp_path / 'ckpt'
  shutil.copytree(good_checkpoint, ckpt)
  for f in (ckpt / '3').glob(target):
    data = bytearray(f.read_bytes())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(16)
    f.write_bytes(data)
  before = _snapshot(ckpt)
  code, _, err = run_cli(capfd, 'demo', '--steps', '5', *ONE_DEVICE,
                         '--checkpoint', str(ckpt), '--resume')
  assert code == 4
  assert len(err.strip().splitlines()) == 1, err
  assert 'checkpoint step 3' in err and 'damaged' in err
  assert _snapshot(ckpt) == before   # not trained from, not overwritten


def test_mesh_larger_than_the_devices_exits_2_in_one_line():
  """As a process: the exit code, and nothing on stderr but the line."""
  result = jaxpar_cli('demo', '--mesh', 'data=4,stage=4,tensor=4')
  assert result.returncode == 2
  assert result.stderr.strip().splitlines() == [
      'python -m jaxpar demo: error: --mesh data=4,stage=4,tensor=4 needs 64 '
      'devices but only 8 exist; use a smaller mesh or --devices']


@pytest.mark.parametrize('args, message', [
    (['--layers', '1'], '--layers 1 is fewer than the 2 pipeline stages of '
     'one_f_one_b on stage=2; use --layers 2 or more'),
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
    (['--schedule', '1f1b'], "invalid choice: '1f1b'"),
    (['--schedule', 'interleaved_one_f_one_b', '--microbatches', '3',
      '--batch', '6'], '--schedule interleaved_one_f_one_b needs '
     '--microbatches divisible by stage=2'),
    (['--schedule', 'auto'], '--schedule auto needs --memory-limit X'),
    (['--memory-limit', '2'], '--schedule auto needs --memory-limit X'),
    (['--schedule', 'auto', '--memory-limit', '0.5'],
     'minimum feasible memory is 1'),
])
def test_bad_flags_exit_2_in_one_line(capsys, args, message):
  """Flag errors stop before any JAX work: one line naming the rule."""
  with pytest.raises(SystemExit) as exit_:
    demo_args.parse_args(args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and err.startswith(
      'python -m jaxpar demo: error: '), err
  assert message in err, err


@pytest.mark.parametrize('name', [n for n in demo_args.SCHEDULES if n != 'auto'])
def test_schedule_flag_names_the_constructor(name):
  """``--schedule NAME`` builds ``jaxpar.pipeline.NAME``; the stage count the
  flags are checked against is the schedule's."""
  args, _ = demo_args.parse_args(['--schedule', name, '--layers', '8'])
  s = demo_args.make_schedule(args)
  extra = (2,) if name == 'interleaved_one_f_one_b' else ()
  assert s == getattr(jaxpar.pipeline, name)(2, 4, *extra)
  assert demo_args.num_stages(args) == s.num_stages


def test_schedule_flag_auto_picks_the_searched_schedule():
  args, _ = demo_args.parse_args(['--mesh', 'data=1,stage=4,tensor=1', '--schedule',
                             'auto', '--memory-limit', '2', '--layers', '8',
                             '--microbatches', '8', '--batch', '8'])
  s = demo_args.make_schedule(args)
  assert max(jaxpar.pipeline.peak_memory(s)) <= 2 and s.num_ranks == 4
  assert demo_args.num_stages(args) == s.num_stages


TEXT = str(__import__('pathlib').Path(__file__).parent.parent / 'README.md')
TEXT_TINY = ('--data', TEXT, '--layers', '2', '--seq-len', '16', '--d-model',
             '16', '--heads', '2', '--batch', '4', '--microbatches', '2',
             '--mesh', 'data=1,stage=2,tensor=1', '--eval-every', '2')


def test_text_run_evaluates_samples_and_resumes_bit_exactly(tmp_path, capfd):
  """4 steps straight (bfloat16, dropout, a sample at the end) == 2 steps, a
  checkpoint, and 2 more resumed from it: the same losses, gradient norms
  and held-out losses, bit for bit."""
  ckpt = str(tmp_path / 'ckpt')
  runs = []
  for args in (('--steps', '4', '--sample', '24', '--prompt', 'The '),
               ('--steps', '2', '--checkpoint', ckpt),
               ('--steps', '4', '--checkpoint', ckpt, '--resume')):
    out = tmp_path / f'{len(runs)}.json'
    code, stdout, err = run_cli(capfd, 'demo', *TEXT_TINY, *args, '--json',
                                str(out), '--dtype', 'bfloat16', '--dropout',
                                '0.1', '--no-baseline')
    assert code == 0, err[-3000:]
    runs.append((json.loads(out.read_text()), stdout))
  (straight, stdout), (first, _), (rest, _) = runs

  assert [e['step'] for e in straight['eval']] == [0, 2, 4]
  assert straight['eval'][-1]['loss'] < straight['eval'][0]['loss']
  assert 0 < straight['unigram_entropy'] < np.log(256)
  assert straight['sample'].startswith('The ')
  speed = straight['throughput']
  # 6N + 12LdS, L=2, d=16, S=16, V=256: N = 2 * 3280 (blocks) + 32 (final
  # LayerNorm) + 4352 (LM head) = 10944 (tests/test_models.py: by hand).
  assert speed["flops_per_token"] == 6 * 10944 + 12 * 2 * 16 * 16
  assert speed['flop_per_s'] == speed['tokens_per_s'] * speed['flops_per_token']
  # The one-device contrast (--baseline): the default demo's test.
  assert speed['mfu'] is None and speed['single_device_tokens_per_s'] is None
  for line in ('bfloat16 compute, dropout 0.1', 'held-out      ',
               'unigram entropy', 'tokens/s', 'GFLOP/s',
               "sample        24 bytes (greedy) after the prompt 'The '"):
    assert line in stdout, stdout

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
    demo_args.parse_args(args)
  assert exit_.value.code == 2
  err = capsys.readouterr().err
  assert err.count('\n') == 1 and message in err, err


# -- python -m jaxpar: the command parser, in this process -----------------


def test_help_lists_every_command(capfd):
  code, out, _ = run_cli(capfd, '--help')
  assert code == 0
  for command in ('demo', 'bench', 'launch'):
    assert command in out
  code, out, _ = run_cli(capfd)
  assert code == 2 and 'usage: python -m jaxpar' in out


@pytest.mark.parametrize('command', ['demo', 'bench', 'launch'])
def test_command_help_is_the_commands_own(capfd, command):
  code, out, _ = run_cli(capfd, command, '--help')
  assert code == 0
  assert f'usage: python -m jaxpar {command}' in out


@pytest.mark.parametrize('argv, message', [
    (['nonsense'], "invalid choice: 'nonsense'"),
    (['launch', '-n', '2'], 'give the command after --'),
    (['launch', '-n', '0', '--', 'demo'], '-n must be >= 1, got 0'),
    (['launch', '--', 'demo'], 'the following arguments are required: '
     '-n/--num-processes'),
])
def test_errors_exit_2_with_the_rule(capfd, argv, message):
  code, _, err = run_cli(capfd, *argv)
  assert code == 2
  assert message in err, err


# -- the demo's evaluation ---------------------------------------------------


def test_held_out_loss_on_the_mesh_is_the_dense_loss(x64):
  """The demo's evaluation: the dense loss of the sharded params (ZeRO-3,
  interleaved stages on 2x2x2) equals gpt_loss on one device, float64."""
  config = gpt.GPTConfig(vocab_size=256, seq_len=8, d_model=16, num_heads=2,
                         num_layers=4)
  params = random_gpt_params(config, np.float64)
  pp, layout = gpt.split_for_pipeline(params, num_stages=4)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
      schedule=jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, zero_stage=3, tensor_rules=gpt.TENSOR_RULES)
  text = text_data.split(np.frombuffer(open(__file__, 'rb').read(), np.uint8))
  evaluate = demo.held_out_loss(trainer, layout, config, text, batch=8)
  held = text_data.held_out_batch(text.held_out, batch=8, seq_len=8)
  np.testing.assert_allclose(evaluate(trainer.init(pp)),
                             gpt.gpt_loss(params, held, config=config),
                             rtol=1e-10)
