"""``python -m jaxpar plan``: rank the layouts of a model on N devices.

Prints ``jaxpar.plan``'s table for jaxpar's GPT with the given sizes
(``--layers --d-model --heads --seq-len --vocab --batch``) or for a model
of your own (``--model module:factory``): every ``data x stage x tensor``,
schedule, microbatch count, ZeRO stage and remat policy, with predicted
step time and memory per device (``--memory`` caps it; ``compiled``: the
figure of a compiled step). Times come from a micro-benchmark of the
devices here, or from ``--profile NAME`` (a datasheet profile, for devices
that are not here). ``--measure N`` also trains N candidates spread over
the predicted range and the best's runners-up (``planner.measure``) for a
few steps and prints predicted against measured
time and memory, the mean absolute time error and the rank correlation.
Under ``python -m jaxpar launch -n P`` every process takes part.

``--model module:factory`` (or ``path/to/file.py:factory``): ``factory()``
returns a dict of ``jaxpar.plan``'s keywords, at least ``model`` and
``batch`` (``(inputs, targets)`` of one step), e.g. ``blocks``, ``embed``,
``head_loss``, ``tensor_rules``, ``optimizer`` for an NNX model. Every
process calls it: it must build the same model (seed its ``nnx.Rngs``).

Example:
  >>> from jaxpar.cli import plan
  >>> plan.parse_size('2GiB'), plan.parse_size('512MiB'), plan.parse_size('1e9')
  (2147483648, 536870912, 1000000000)
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import optax

import jaxpar
from jaxpar import planner
from jaxpar.models import gpt

_GPT_FLAGS = {'layers': 8, 'd_model': 256, 'heads': 8, 'seq_len': 64,
              'vocab': 256, 'batch': 64}
# What a --model factory may set: jaxpar.plan's model keywords and ranges
# (the devices, cap, profile, compile and search come from the flags).
FACTORY_KEYS = ('model', 'batch', 'optimizer', 'blocks', 'embed',
                'head_loss', 'tensor_rules', 'zero_stages', 'remat_policies',
                'max_microbatches', 'where', 'prefer_as_written')


def parse_size(text: str) -> int:
  """``'2GiB'`` -> bytes; ``argparse.ArgumentTypeError`` if unreadable."""
  try:
    return int(planner.parse_size(text, '--memory'))
  except ValueError as e:
    raise argparse.ArgumentTypeError(str(e)) from None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = argparse.ArgumentParser(prog='python -m jaxpar plan',
                              description=__doc__.splitlines()[0])
  p.add_argument('--devices', type=int, help='devices (simulated CPU '
                 'devices here; with --profile, devices on paper); default 8')
  p.add_argument('--memory', type=parse_size, help='bytes per device, '
                 'e.g. 2GiB (default: what the device or profile has)')
  p.add_argument('--model', metavar='MODULE:FACTORY', help='plan your own '
                 'model: factory() returns a dict of jaxpar.plan keywords '
                 '(model, batch, blocks, embed, head_loss, tensor_rules, '
                 '...); instead of the GPT flags')
  for name, default in _GPT_FLAGS.items():
    p.add_argument(f'--{name.replace("_", "-")}', type=int,
                   help=f'GPT {"global batch" if name == "batch" else name}'
                   f' (default {default})')
  p.add_argument('--profile', choices=sorted(planner.PROFILES),
                 help='plan for these devices on paper (no benchmark)')
  p.add_argument('--compile', type=int, metavar='K', help='compile K stage '
                 'shapes for their memory (default: '
                 f'{planner.DEFAULT_COMPILES} with the devices here)')
  p.add_argument('--measure', type=int, default=0, metavar='N',
                 help='also time N candidates spread over the predicted '
                 "range, and the best's runners-up, for real")
  p.add_argument('--search', type=int, default=0, metavar='K',
                 help='add pipeline.search schedules for the K best '
                 'pipelined meshes and microbatch counts (default 0: none)')
  p.add_argument('--rows', type=int, default=15, help='table rows')
  p.add_argument('--json', metavar='PATH', help='write the plan as JSON')
  args = p.parse_args(argv)
  given = [n for n in _GPT_FLAGS if getattr(args, n) is not None]
  if args.model and given:
    p.error(f'--model plans your model: leave out the GPT flags '
            f'{", ".join("--" + n.replace("_", "-") for n in given)} (its '
            'factory gives the model and the batch)')
  for name, default in _GPT_FLAGS.items():
    if getattr(args, name) is None:
      setattr(args, name, default)
    if getattr(args, name) < 1:
      p.error(f'--{name.replace("_", "-")} must be >= 1')
  if args.d_model % args.heads:
    p.error(f'--d-model {args.d_model} must divide by --heads {args.heads}')
  if args.devices is not None and args.devices < 1:
    p.error('--devices must be >= 1')
  for name in ('compile', 'measure', 'search'):
    if (getattr(args, name) or 0) < 0:
      p.error(f'--{name} must be >= 0')
  return args


def load_factory(spec: str) -> dict[str, Any]:
  """``factory()``'s keywords for ``'module:factory'`` or
  ``'file.py:factory'``, checked: a mapping with ``model`` and ``batch``
  and only keys of ``FACTORY_KEYS``."""
  module_name, sep, attr = spec.rpartition(':')
  if not sep or not module_name or not attr:
    raise ValueError(f'--model {spec!r} must be MODULE:FACTORY or '
                     'FILE.py:FACTORY, e.g. --model my_models:llama_tiny.')
  if module_name.endswith('.py'):
    found = importlib.util.spec_from_file_location('_jaxpar_plan_model',
                                                   module_name)
    if found is None or not os.path.exists(module_name):
      raise ValueError(f'--model {spec!r}: no file {module_name!r}.')
    module = importlib.util.module_from_spec(found)
    found.loader.exec_module(module)
  else:
    sys.path.insert(0, os.getcwd())
    module = importlib.import_module(module_name)
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise ValueError(f'--model {spec!r}: {module_name} has no function '
                     f'{attr!r}.')
  out = factory()
  if not isinstance(out, Mapping) or not {'model', 'batch'} <= set(out):
    raise ValueError(
        f'--model {spec!r}: {attr}() must return a dict of jaxpar.plan '
        "keywords with 'model' and 'batch' ((inputs, targets) of one "
        f'step), e.g. dict(model=net, batch=(x, y), blocks=..., embed=..., '
        f'head_loss=...); got {type(out).__name__}.')
  unknown = sorted(set(out) - set(FACTORY_KEYS))
  if unknown:
    raise ValueError(f'--model {spec!r}: {attr}() returned {unknown}, not '
                     f'keywords it may set: {FACTORY_KEYS} (the devices, '
                     'memory, profile, compile and search are flags).')
  return dict(out)


def _join(args: argparse.Namespace) -> None:
  """One process (``--devices`` simulated CPU devices) or ``launch``'s."""
  if args.profile:
    return
  launched = os.environ.get(jaxpar.distributed.ENV_LOCAL_DEVICE_COUNT)
  jaxpar.distributed.initialize(
      local_device_count=None if launched else (args.devices or 8))


def _keywords(args: argparse.Namespace) -> dict[str, Any]:
  """``jaxpar.plan``'s keywords: the factory's (``--model``) or the GPT's
  of the flags (its batch as token ids: ``--measure`` steps it)."""
  if args.model:
    kw = load_factory(args.model)
  else:
    config = gpt.GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len,
                           d_model=args.d_model, num_heads=args.heads,
                           num_layers=args.layers)
    ids = np.random.default_rng(0).integers(
        0, args.vocab, (args.batch, args.seq_len + 1)).astype(np.int32)
    kw = {'model': config, 'batch': (ids[:, :-1], ids[:, 1:])}
  kw.setdefault('optimizer', optax.adam(1e-3))
  return kw


def _print_measured(found: dict) -> None:
  print(f"\npredicted vs measured ({found['how']}):")
  for r in found['rows']:
    print(f"  {r['layout']:<42} {1e3 * r['predicted_s']:9.3f} ms "
          f"{1e3 * r['measured_s']:9.3f} ms ({r['time_error']:+.0%})  "
          f"{r['predicted_bytes'] / 2**20:8.3f} MiB vs "
          f"{r['compiled_bytes'] / 2**20:8.3f} ({r['memory_error']:+.1%})")
  print(f"  {len(found['rows'])} candidates: mean absolute time error "
        f"{found['mean_abs_error']:.1%}, Spearman rank correlation "
        f"{found['spearman']:.2f}; the predicted best is "
        f"{found['best_vs_fastest']:+.1%} from the fastest measured; load "
        f"average {', '.join(f'{x:.1f}' for x in found['load_average'])}")
  if found['mean_abs_retimed_error'] is not None:
    print(f"  with the block rates timed again beside the steps: mean "
          f"absolute time error {found['mean_abs_retimed_error']:.1%}")


def main(argv: list[str] | None = None) -> int:
  """``python -m jaxpar plan ...``; exit 0, or 2 (bad flags or model,
  nothing fits)."""
  args = parse_args(argv)
  _join(args)
  devices = (args.devices or 8) if args.profile else None
  try:
    kw = _keywords(args)
    plan = jaxpar.plan(**kw, devices=devices, memory_per_device=args.memory,
                       profile=args.profile, compile=args.compile,
                       search=args.search)
  except (ValueError, TypeError) as e:
    print(f'python -m jaxpar plan: error: {e}', file=sys.stderr)
    return 2
  out = {'profile': plan.profile._asdict(), 'rows': plan.rows(),
         'memory_per_device': plan.memory_per_device}
  if args.measure:
    out['measured'] = planner.summary(planner.measure(
        plan, args.measure, kw['optimizer'], kw['batch']))
    # The machine's load (1, 5, 15 minutes) as the timing ended.
    out['measured']['load_average'] = os.getloadavg()
  if jaxpar.distributed.is_main_process():
    print(plan.table(args.rows))
    if args.measure:
      _print_measured(out['measured'])
    if args.json:
      with open(args.json, 'w') as f:
        json.dump(out, f, indent=1, default=str)
  return 0
