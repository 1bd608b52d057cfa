"""Command line: ``python -m jaxpar demo|bench ...``."""

from __future__ import annotations

import sys

USAGE = """usage: python -m jaxpar <command> [options]

commands:
  demo    train a model on simulated CPU devices (the main job)
  bench   run the benchmarks: python -m jaxpar bench [--quick] [--json PATH]

`python -m jaxpar <command> --help` for the options of a command."""


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
  print(f'jaxpar: unknown command {command!r}\n\n{USAGE}', file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main())
