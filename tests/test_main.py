"""``python -m jaxpar``: the command parser (commands, help, errors).

In-process: ``main`` only parses here; running the commands is
``test_cli.py``'s job.
"""

import pytest

from jaxpar import __main__ as cli


def exit_code_and_output(capsys, *argv):
  try:
    code = cli.main(list(argv))
  except SystemExit as e:
    code = e.code
  out = capsys.readouterr()
  return code, out.out, out.err


def test_help_lists_every_command(capsys):
  code, out, _ = exit_code_and_output(capsys, '--help')
  assert code == 0
  for command in ('demo', 'bench', 'launch'):
    assert command in out
  code, out, _ = exit_code_and_output(capsys)
  assert code == 2 and 'usage: python -m jaxpar' in out


@pytest.mark.parametrize('command', ['demo', 'bench', 'launch'])
def test_command_help_is_the_commands_own(capsys, command):
  code, out, _ = exit_code_and_output(capsys, command, '--help')
  assert code == 0
  assert f'usage: python -m jaxpar {command}' in out


@pytest.mark.parametrize('argv, message', [
    (['nonsense'], "invalid choice: 'nonsense'"),
    (['launch', '-n', '2'], 'give the command after --'),
    (['launch', '-n', '0', '--', 'demo'], '-n must be >= 1, got 0'),
    (['launch', '--', 'demo'], 'the following arguments are required: '
     '-n/--num-processes'),
])
def test_errors_exit_2_with_the_rule(capsys, argv, message):
  code, _, err = exit_code_and_output(capsys, *argv)
  assert code == 2
  assert message in err, err
