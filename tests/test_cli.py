"""The command line: the demo learns, bad flags fail in one line with exit 2."""

import json
import subprocess
import sys

import pytest


def jaxpar_cli(*args, timeout=600):
  return subprocess.run([sys.executable, '-m', 'jaxpar', *args],
                        capture_output=True, text=True, timeout=timeout)


def test_demo_learns(tmp_path):
  out = tmp_path / 'run.json'
  result = jaxpar_cli('demo', '--steps', '40', '--json', str(out))
  assert result.returncode == 0, result.stderr
  record = json.loads(out.read_text())
  losses = [s['loss'] for s in record['steps']]
  assert len(losses) == 40
  assert losses[-1] < 0.5 * losses[0]
  assert 'loss' in result.stdout


@pytest.mark.parametrize('args', [['demo', '--steps', '0'], ['nonsense']])
def test_bad_flags_exit_2_without_traceback(args):
  result = jaxpar_cli(*args)
  assert result.returncode == 2
  assert 'Traceback' not in result.stderr
