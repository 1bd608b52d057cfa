"""``python -m jaxpar plan``: rank the layouts of a GPT on N devices.

Prints ``jaxpar.plan``'s table for jaxpar's GPT with the given sizes: every
``data x stage x tensor``, schedule, microbatch count, ZeRO stage and remat
policy, with predicted step time and memory per device (``--memory``
caps it). Times come from a micro-benchmark of the devices here, or from
``--profile NAME`` (a datasheet profile, for devices that are not here).
``--measure N`` also trains the N best for a few steps and prints
predicted against measured time and memory, and their rank correlation.
Under ``python -m jaxpar launch -n P`` every process takes part.

Example:
  >>> from jaxpar.cli import plan
  >>> plan.parse_size('2GiB'), plan.parse_size('512MiB'), plan.parse_size('1e9')
  (2147483648, 536870912, 1000000000)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import optax

import jaxpar
from jaxpar import planner
from jaxpar.models import gpt

_UNITS = {'KiB': 2**10, 'MiB': 2**20, 'GiB': 2**30, 'TiB': 2**40,
          'KB': 1e3, 'MB': 1e6, 'GB': 1e9, 'TB': 1e12, 'B': 1}


def parse_size(text: str) -> int:
  """``'2GiB'`` -> bytes; ``argparse.ArgumentTypeError`` if unreadable."""
  for unit, scale in _UNITS.items():
    if text.endswith(unit):
      number = text[:-len(unit)]
      break
  else:
    number, scale = text, 1
  try:
    value = float(number) * scale
  except ValueError:
    value = -1.0
  if not value > 0:
    raise argparse.ArgumentTypeError(
        f'{text!r} is not a size: use e.g. 2GiB, 512MiB or 1e9 (bytes)')
  return int(value)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m jaxpar plan',
                              description=__doc__.splitlines()[0])
  p.add_argument('--devices', type=int, help='devices (simulated CPU '
                 'devices here; with --profile, devices on paper); default 8')
  p.add_argument('--memory', type=parse_size, help='bytes per device, '
                 'e.g. 2GiB (default: what the device or profile has)')
  p.add_argument('--layers', type=int, default=8)
  p.add_argument('--d-model', type=int, default=256)
  p.add_argument('--heads', type=int, default=8)
  p.add_argument('--seq-len', type=int, default=64)
  p.add_argument('--vocab', type=int, default=256)
  p.add_argument('--batch', type=int, default=64, help='global batch')
  p.add_argument('--profile', choices=sorted(planner.PROFILES),
                 help='plan for these devices on paper (no benchmark)')
  p.add_argument('--compile', type=int, default=0, metavar='K',
                 help='compile K stage shapes for their memory')
  p.add_argument('--measure', type=int, default=0, metavar='N',
                 help='also time the N best for real')
  p.add_argument('--search', type=int, default=0, metavar='K',
                 help='add pipeline.search schedules for the K best '
                 'pipelined meshes and microbatch counts (default 0: none)')
  p.add_argument('--rows', type=int, default=15, help='table rows')
  p.add_argument('--json', metavar='PATH', help='write the plan as JSON')
  args = p.parse_args(argv)
  for name in ('layers', 'd_model', 'heads', 'seq_len', 'vocab', 'batch'):
    if getattr(args, name) < 1:
      p.error(f'--{name.replace("_", "-")} must be >= 1')
  if args.d_model % args.heads:
    p.error(f'--d-model {args.d_model} must divide by --heads {args.heads}')
  if args.devices is not None and args.devices < 1:
    p.error('--devices must be >= 1')
  for name in ('compile', 'measure', 'search'):
    if getattr(args, name) < 0:
      p.error(f'--{name} must be >= 0')
  return args


def _join(args: argparse.Namespace) -> None:
  """One process (``--devices`` simulated CPU devices) or ``launch``'s."""
  if args.profile:
    return
  launched = os.environ.get(jaxpar.distributed.ENV_LOCAL_DEVICE_COUNT)
  jaxpar.distributed.initialize(
      local_device_count=None if launched else (args.devices or 8))


def _measured(plan, args, config) -> dict:
  ids = np.random.default_rng(0).integers(
      0, config.vocab_size, (args.batch, config.seq_len + 1)).astype(np.int32)
  rows = [m.row() for m in planner.measure(
      plan, args.measure, optax.adam(1e-3), (ids[:, :-1], ids[:, 1:]))]
  order = planner.spearman([r['predicted_s'] for r in rows],
                           [r['measured_s'] for r in rows])
  fastest = min(r['measured_s'] for r in rows)
  return {'rows': rows, 'spearman': order,
          'best_vs_fastest': rows[0]['measured_s'] / fastest - 1}


def _print_measured(found: dict) -> None:
  print('\npredicted vs measured (fastest of 5 rounds, each the second of two steps; compiled arguments + temp):')
  for r in found['rows']:
    print(f"  {r['layout']:<42} {1e3 * r['predicted_s']:9.3f} ms "
          f"{1e3 * r['measured_s']:9.3f} ms ({r['time_error']:+.0%})  "
          f"{r['predicted_bytes'] / 2**20:8.3f} MiB vs "
          f"{r['compiled_bytes'] / 2**20:8.3f} ({r['memory_error']:+.1%})")
  print(f"  Spearman rank correlation {found['spearman']:.2f}; the predicted "
        f"best is {found['best_vs_fastest']:+.1%} from the fastest measured")


def main(argv: list[str] | None = None) -> int:
  """``python -m jaxpar plan ...``; exit 0, or 2 (bad flags, nothing fits)."""
  args = parse_args(argv)
  _join(args)
  config = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len,
                         d_model=args.d_model, num_heads=args.heads,
                         num_layers=args.layers)
  devices = (args.devices or 8) if args.profile else None
  try:
    plan = jaxpar.plan(config, optax.adam(1e-3), batch=args.batch,
                       devices=devices, memory_per_device=args.memory,
                       profile=args.profile, compile=args.compile,
                       search=args.search)
  except ValueError as e:
    print(f'python -m jaxpar plan: error: {e}', file=sys.stderr)
    return 2
  out = {'profile': plan.profile._asdict(), 'rows': plan.rows(),
         'memory_per_device': plan.memory_per_device}
  if args.measure:
    out['measured'] = _measured(plan, args, config)
  if jaxpar.distributed.is_main_process():
    print(plan.table(args.rows))
    if args.measure:
      _print_measured(out['measured'])
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(out, f, indent=1)
  return 0
