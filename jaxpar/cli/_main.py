"""Command line: ``python -m jaxpar demo|bench|plan|launch ...``.

``demo``, ``bench`` and ``plan`` own their options (``python -m jaxpar demo --help``);
this parser only picks the command and hands them the rest of the line.
"""

from __future__ import annotations

import argparse
import sys

from jaxpar import distributed
from jaxpar.cli import bench, demo
from jaxpar.cli import plan as plan_command


def _launch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
  command = args.args[1:] if args.args[:1] == ['--'] else args.args
  if not command:
    parser.error('give the command after --, e.g. -- demo --steps 10')
  if args.num_processes < 1:
    parser.error(f'-n must be >= 1, got {args.num_processes}')
  if args.grace is not None and not 0 <= args.grace < float('inf'):
    parser.error(f'--grace must be >= 0 seconds, got {args.grace}')
  try:
    code = distributed.launch(
        args.num_processes, command,
        devices_per_process=args.devices_per_process, port=args.port,
        grace=distributed.GRACE_S if args.grace is None else args.grace,
        cores_per_process=args.cores_per_process)
  except ValueError as e:   # e.g. more cores asked for than there are
    parser.error(str(e))
  return code if code >= 0 else 128 - code   # killed by signal s: 128 + s


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
  """The top-level parser and the ``launch`` subparser."""
  parser = argparse.ArgumentParser(
      prog='python -m jaxpar',
      description='Data, tensor and pipeline parallelism for JAX.',
      epilog='`python -m jaxpar <command> --help` for the options of a '
      'command.')
  commands = parser.add_subparsers(dest='command', metavar='<command>')
  # demo and bench parse their own options (and --help) from the rest.
  commands.add_parser('demo', add_help=False, help='train a model on '
                      'simulated CPU devices (the main job)')
  commands.add_parser('bench', add_help=False, help='run the benchmarks: '
                      'python -m jaxpar bench [--quick] [--json PATH]')
  commands.add_parser('plan', add_help=False, help='rank the layouts of a '
                      'GPT on N devices: python -m jaxpar plan --devices 8 '
                      '--memory 2GiB [--json PATH] [--measure N]')
  launch = commands.add_parser(
      'launch', prog='python -m jaxpar launch',
      help='start N local processes (gloo on CPU): python -m jaxpar launch '
      '-n N [--devices-per-process K] -- demo ...',
      description='Run `python -m jaxpar <args>` in N local processes that '
      'form one jax.distributed job (gloo collectives on CPU).')
  launch.add_argument('-n', '--num-processes', type=int, required=True)
  launch.add_argument('--devices-per-process', type=int,
                      help='simulated CPU devices in each process')
  launch.add_argument('--port', type=int,
                      help='coordinator port (default: free)')
  launch.add_argument('--cores-per-process', type=int,
                      help='run process i on cores [i K, (i+1) K) of those '
                      'usable (default: the OS places them)')
  launch.add_argument('--grace', type=float,
                      help='seconds between SIGTERM and SIGKILL when the '
                      f'processes are stopped (default {distributed.GRACE_S:g})')
  launch.add_argument('args', nargs=argparse.REMAINDER,
                      help='-- followed by the jaxpar command to run')
  return parser, launch


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  parser, launch = _parser()
  if not argv:
    parser.print_help()
    return 2
  command, rest = argv[0], argv[1:]
  if command == 'demo':
    return demo.main(rest)
  if command == 'bench':
    return bench.main(rest)
  if command == 'plan':
    return plan_command.main(rest)
  args = parser.parse_args(argv)   # launch, --help, or an error (exit 2)
  return _launch(args, launch)
