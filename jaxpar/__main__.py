"""Command line: ``python -m jaxpar demo|bench ...``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m jaxpar <command> [options]

commands:
  demo    train a model on simulated CPU devices (the main job)
  bench   run the benchmarks: python -m jaxpar bench [--quick] [--json PATH]
  launch  start N local processes (gloo on CPU):
          python -m jaxpar launch -n N [--devices-per-process K] -- demo ...

`python -m jaxpar <command> --help` for the options of a command."""


def _launch(argv: list[str]) -> int:
  import argparse  # pylint: disable=g-import-not-at-top
  parser = argparse.ArgumentParser(
      prog='python -m jaxpar launch',
      description='Run `python -m jaxpar <args>` in N local processes that '
      'form one jax.distributed job (gloo collectives on CPU).')
  parser.add_argument('-n', '--num-processes', type=int, required=True)
  parser.add_argument('--devices-per-process', type=int,
                      help='simulated CPU devices in each process')
  parser.add_argument('--port', type=int, help='coordinator port (default: free)')
  parser.add_argument('args', nargs=argparse.REMAINDER,
                      help='-- followed by the jaxpar command to run')
  args = parser.parse_args(argv)
  command = args.args[1:] if args.args[:1] == ['--'] else args.args
  if not command:
    parser.error('give the command after --, e.g. -- demo --steps 10')
  if args.num_processes < 1:
    parser.error(f'-n must be >= 1, got {args.num_processes}')
  from jaxpar import distributed  # pylint: disable=g-import-not-at-top
  return distributed.launch(args.num_processes, command,
                            devices_per_process=args.devices_per_process,
                            port=args.port)


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if not argv or argv[0] in ('-h', '--help'):
    print(USAGE)
    return 0 if argv else 2
  command, rest = argv[0], argv[1:]
  if command == 'demo':
    from jaxpar import demo  # pylint: disable=g-import-not-at-top
    return demo.main(rest)
  if command == 'bench':
    from jaxpar import bench  # pylint: disable=g-import-not-at-top
    return bench.main(rest)
  if command == 'launch':
    return _launch(rest)
  print(f'jaxpar: unknown command {command!r}\n\n{USAGE}', file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main())
