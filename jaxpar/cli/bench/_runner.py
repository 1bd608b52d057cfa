"""The runner of ``python -m jaxpar bench``: every topic module, one table each.

Each public module ``jaxpar/cli/bench/<topic>.py`` defines ``run(*, quick)
-> {section: [row, ...]}`` with rows of JSON scalars; ``main`` runs them
(or those of ``--only``), prints each section as a markdown table
(``markdown_table``) and writes them all to JSON.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pathlib
import pkgutil
import platform
import sys
import time

import jax

from jaxpar import mesh

_TOPICS_DIR = str(pathlib.Path(__file__).parent)


def markdown_table(rows: list[dict]) -> str:
  """Rows of flat dicts as a markdown table (columns in first-seen order).

  Example:
    >>> from jaxpar.cli.bench import markdown_table
    >>> print(markdown_table([{'n': 1, 's': 0.5}, {'n': 2, 'x': 'a'}]))
    | n | s | x |
    |---|---|---|
    | 1 | 0.5 |  |
    | 2 |  | a |
  """
  columns = list(dict.fromkeys(k for row in rows for k in row))
  fmt = lambda v: f'{v:.4g}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(columns) + ' |',
           '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt(row.get(c, '')) for c in columns) + ' |'
            for row in rows]
  return '\n'.join(lines)


def main(argv: list[str] | None = None) -> int:
  """``python -m jaxpar bench [--quick] [--json PATH] [--only TOPIC]``."""
  parser = argparse.ArgumentParser(
      prog='python -m jaxpar bench',
      description='every benchmark section, as markdown tables and JSON')
  parser.add_argument('--quick', action='store_true',
                      help='small sizes: a few minutes on 2 CPU cores')
  parser.add_argument('--json', metavar='PATH', help='also write JSON here')
  parser.add_argument('--only', metavar='TOPIC', action='append',
                      help='run only this module (repeatable), e.g. pipeline')
  parser.add_argument('--devices', type=int, default=8,
                      help='simulated CPU devices (default 8)')
  args = parser.parse_args(argv)

  mesh.simulate_cpu_devices(args.devices)
  if jax.device_count() < args.devices:   # a GPU/TPU host with fewer chips
    parser.error(
        f'the benchmarks run on {args.devices} devices but the '
        f'{jax.default_backend()} backend has {jax.device_count()}; run them '
        f'on simulated CPU devices (JAX_PLATFORMS=cpu python -m jaxpar '
        'bench ...) or on a host with that many')

  topics = sorted(m.name for m in pkgutil.iter_modules([_TOPICS_DIR])
                  if not m.name.startswith('_'))
  unknown = set(args.only or ()) - set(topics)
  if unknown:
    parser.error(f'unknown --only {sorted(unknown)}; choose from {topics}')
  machine = {'platform': platform.platform(),
             'python': platform.python_version(),
             'jax': jax.__version__, 'backend': jax.default_backend(),
             'devices': jax.device_count(), 'quick': args.quick}
  print(f'# jaxpar bench ({"quick" if args.quick else "full"})\n')
  print(markdown_table([machine]) + '\n')
  results = {'machine': machine}
  for topic in args.only or topics:
    start = time.perf_counter()
    sections = importlib.import_module(f'jaxpar.cli.bench.{topic}').run(
        quick=args.quick)
    for name, rows in sections.items():
      results[name] = rows
      print(f'## {name}\n\n{markdown_table(rows)}\n', flush=True)
    print(f'({topic}: {time.perf_counter() - start:.1f} s)\n', file=sys.stderr)
  if args.json:
    with open(args.json, 'w') as f:
      json.dump(results, f, indent=1)
  return 0
