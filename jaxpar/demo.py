"""``python -m jaxpar demo``: train a GPT with data x pipeline x tensor parallelism.

The task is generated in-process and learnable: each sequence is an
arithmetic progression modulo the vocabulary, ``x_t = (x_0 + t*c) mod V``
with random ``x_0`` and ``c``. Only the first next-token prediction (which
needs ``c``) is a guess; every later one follows from two tokens, so the
loss falls from ``log V`` towards ``log(V) / S``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

import jaxpar
from jaxpar import pipeline
from jaxpar.models import gpt

SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb_h1', 'zbv', 'dualpipev',
             'v_half', 'v_min', 'auto')


class _Parser(argparse.ArgumentParser):
  """Bad flags: one line on stderr and exit code 2, no usage dump."""

  def error(self, message):
    self.exit(2, f'{self.prog}: error: {message}\n')


def _mesh_flag(text: str) -> dict[str, int]:
  sizes = {}
  for part in text.split(','):
    name, _, value = part.partition('=')
    if name not in ('data', 'stage', 'tensor') or not value.isdigit() or int(
        value) < 1:
      raise argparse.ArgumentTypeError(
          f'--mesh {text!r}: use data=D,stage=S,tensor=T with positive sizes')
    sizes[name] = int(value)
  return {k: sizes.get(k, 1) for k in ('data', 'stage', 'tensor')}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  p = _Parser(prog='python -m jaxpar demo', description=__doc__.splitlines()[0])
  p.add_argument('--mesh', type=_mesh_flag, default='data=2,stage=2,tensor=2',
                 help='mesh sizes; uses the first D*S*T devices')
  p.add_argument('--schedule', choices=SCHEDULES, default='1f1b')
  p.add_argument('--microbatches', type=int, default=4)
  p.add_argument('--virtual-stages', type=int, default=2,
                 help='stages per rank for --schedule interleaved')
  p.add_argument('--memory-limit', type=float, metavar='X',
                 help='--schedule auto: the fastest schedule holding at most '
                 'X stages of activations per rank (1F1B needs stage=S)')
  p.add_argument('--steps', type=int, default=150)
  p.add_argument('--layers', type=int, default=4)
  p.add_argument('--batch', type=int, default=32, help='sequences per step')
  p.add_argument('--lr', type=float, default=3e-3)
  p.add_argument('--seed', type=int, default=0)
  p.add_argument('--devices', type=int,
                 help='simulated CPU devices per process (default 8)')
  p.add_argument('--json', metavar='PATH', help='write config and per-step stats')
  p.add_argument('--plot', metavar='PATH', help='loss curve + schedule chart (PNG)')
  p.add_argument('--checkpoint', metavar='DIR', help='save the state here at the end')
  p.add_argument('--resume', action='store_true',
                 help='continue from the latest checkpoint in --checkpoint')
  p.add_argument('--zero', type=int, choices=(0, 1, 3), default=0,
                 help='ZeRO stage: 1 shards the optimizer state over data, '
                 '3 the params too (FSDP)')
  p.add_argument('--max-skipped', type=int, default=5, metavar='K',
                 help='stop (exit code 3) after K consecutive steps skipped '
                 'for non-finite loss or gradients')
  p.add_argument('--coordinator', metavar='HOST:PORT',
                 help='jax.distributed coordinator (multi-process runs)')
  p.add_argument('--num-processes', type=int)
  p.add_argument('--process-id', type=int)
  args = p.parse_args(argv)
  if isinstance(args.mesh, str):
    args.mesh = _mesh_flag(args.mesh)
  for name in ('microbatches', 'virtual_stages', 'steps', 'layers', 'batch',
               'devices', 'max_skipped'):
    if getattr(args, name) is not None and getattr(args, name) < 1:
      p.error(f'--{name.replace("_", "-")} must be >= 1, got {getattr(args, name)}')
  if (args.schedule == 'auto') != (args.memory_limit is not None):
    p.error('--schedule auto needs --memory-limit X and --memory-limit needs '
            '--schedule auto, e.g. --schedule auto --memory-limit 1.5')
  if args.memory_limit is not None and not args.memory_limit >= 1:
    p.error(f'--memory-limit {args.memory_limit}: the minimum feasible memory '
            'is 1 (one stage of activations per rank); use 1 or more')
  stages = num_stages(args)
  if args.layers < stages:
    p.error(f'--layers {args.layers} is fewer than the {stages} pipeline '
            f'stages of {args.schedule} on stage={args.mesh["stage"]}; use '
            f'--layers {stages} or more')
  if not math.isfinite(args.lr) or args.lr <= 0:
    p.error(f'--lr must be a finite number > 0, got {args.lr}')
  if args.resume and not args.checkpoint:
    p.error('--resume needs --checkpoint DIR')
  need = args.mesh['data'] * args.microbatches
  if args.batch % need:
    p.error(f'--batch {args.batch} must be a multiple of data x microbatches '
            f'= {need}')
  if args.schedule == 'interleaved' and args.microbatches % args.mesh['stage']:
    p.error(f'--schedule interleaved needs --microbatches divisible by '
            f'stage={args.mesh["stage"]}')
  return args, p


def num_stages(args) -> int:
  p = args.mesh['stage']
  if args.schedule == 'auto':
    return make_schedule(args).num_stages
  return {'interleaved': p * args.virtual_stages, 'zbv': 2 * p,
          'dualpipev': 2 * p, 'v_half': 2 * p, 'v_min': 2 * p}.get(
              args.schedule, p)


def make_schedule(args):
  p, m = args.mesh['stage'], args.microbatches
  if args.schedule == 'interleaved':
    return pipeline.interleaved_1f1b(p, m, args.virtual_stages)
  if args.schedule == 'auto':
    return pipeline.search(p, m, memory_limit=args.memory_limit)
  return {'gpipe': pipeline.gpipe, '1f1b': pipeline.one_f_one_b,
          'zb_h1': pipeline.zero_bubble_h1, 'zbv': pipeline.zbv,
          'dualpipev': pipeline.dualpipev, 'v_half': pipeline.v_half,
          'v_min': pipeline.v_min}[args.schedule](p, m)


def make_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int):
  """The batch of ``step``: a pure function of ``(seed, step)`` (resumable)."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, (batch, 1))
  stride = rng.integers(1, vocab, (batch, 1))
  seq = (start + stride * np.arange(seq_len + 1)) % vocab
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def main(argv: list[str] | None = None) -> int:
  args, parser = parse_args(argv)
  # One process, or one of several (flags, `launch`'s environment, or what
  # jax.distributed detects); 8 simulated CPU devices unless told otherwise.
  local_devices = args.devices or (
      None if os.environ.get(jaxpar.distributed.ENV_LOCAL_DEVICE_COUNT) else 8)
  jaxpar.distributed.initialize(args.coordinator, args.num_processes,
                                args.process_id,
                                local_device_count=local_devices)

  main_process = jaxpar.distributed.is_main_process()
  n = math.prod(args.mesh.values())
  if n > jax.device_count():
    sizes = ','.join(f'{k}={v}' for k, v in args.mesh.items())
    parser.error(f'--mesh {sizes} needs {n} devices but only '
                 f'{jax.device_count()} exist; use a smaller mesh or --devices')
  mesh = jaxpar.make_mesh(**args.mesh, devices=jax.devices()[:n])
  schedule = make_schedule(args)
  config = gpt.GPTConfig(vocab_size=32, seq_len=16, d_model=64, num_heads=8,
                         num_layers=args.layers)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(args.seed)))
  pipeline_params, layout = gpt.split_for_pipeline(
      params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn,
      optax.adam(args.lr), schedule=schedule, mesh=mesh,
      stage_mask=layout.mask, max_grad_norm=1.0, zero_stage=args.zero)
  try:
    state = trainer.init(pipeline_params)
  except ValueError as e:   # e.g. heads not divisible by the tensor size
    parser.error(str(e).splitlines()[0])
  if args.resume:   # the newest step or nothing: a damaged one is refused
    newest = jaxpar.checkpoint.latest_step(args.checkpoint, verify=False)
    try:
      if newest is not None:
        state = jaxpar.checkpoint.restore(args.checkpoint, state,
                                          step=newest, schedule=schedule)
    except jaxpar.checkpoint.CheckpointError as e:
      print(f'{parser.prog}: error: {e}', file=sys.stderr)
      return 4
  first = int(state.step)
  tokens = args.batch * config.seq_len
  history, skips, stopped = [], jaxpar.guard.SkipCount(), None
  bar = tqdm(range(first, args.steps), desc=f'GPT {schedule.name}',
             unit='step', disable=not main_process, file=sys.stdout)
  for i in bar:
    batch = make_batch(args.seed, i, args.batch, config.seq_len,
                       config.vocab_size)
    start = time.perf_counter()
    state, stats = trainer.step(state, batch)
    loss = float(stats.loss)
    seconds = time.perf_counter() - start
    history.append({'step': i, 'loss': loss, 'grad_norm': float(
        stats.grad_norm), 'skipped': bool(stats.skipped), 'seconds': seconds})
    bar.set_postfix(loss=f'{loss:.3f}', tokens_s=f'{tokens / seconds:,.0f}',
                    skipped=sum(h['skipped'] for h in history))
    try:
      skips = jaxpar.guard.count_skipped(skips, stats, step=i,
                                         max_skipped=args.max_skipped)
    except jaxpar.guard.TooManySkippedError as e:
      stopped = e
      break
  bar.close()
  if args.checkpoint and not stopped:   # every process writes its shards
    jaxpar.checkpoint.save(args.checkpoint, state, schedule=schedule)
  # Placing the batch is collective across processes: lower in all of them.
  mem = trainer.step.lower(state, make_batch(
      args.seed, 0, args.batch, config.seq_len, config.vocab_size)
                           ).compile().memory_analysis()

  if main_process:
    sim = schedule.simulate()
    steady = history[1:] or history
    rate = tokens * len(steady) / max(sum(h['seconds'] for h in steady), 1e-9)
    losses = [h['loss'] for h in history]
    print(f'\nmesh          data={args.mesh["data"]} stage={args.mesh["stage"]} '
          f'tensor={args.mesh["tensor"]} ({n} {jax.default_backend()} devices, '
          f'{jax.process_count()} process(es))\n'
          f'model         GPT {args.layers} layers, d={config.d_model}, '
          f'{config.num_heads} heads, vocab {config.vocab_size}; stage slots '
          f'{layout.counts}\n'
          f'schedule      {schedule.name}: p={schedule.num_ranks}, '
          f'm={schedule.num_microbatches}, {schedule.num_stages} stages; '
          f'bubble {sim.bubble_fraction:.1%} (simulated)\n'
          f'memory        {mem.temp_size_in_bytes / 2**20:.2f} MiB temp + '
          f'{mem.argument_size_in_bytes / 2**20:.2f} MiB arguments per device '
          f'(compiled program)\n'
          + (f'loss          {losses[0]:.3f} -> {losses[-1]:.3f} over steps '
             f'{first}..{history[-1]["step"]}\n'
             f'throughput    {rate:,.0f} tokens/s (steady state)\n'
             f'skipped       {sum(h["skipped"] for h in history)} steps '
             '(non-finite loss or gradients)'
             if history else f'nothing to do: already at step {first}'))
    if args.json:
      with open(args.json, 'w') as f:
        json.dump({'config': {**vars(args), 'schedule_name': schedule.name},
                   'skipped': sum(h['skipped'] for h in history),
                   'stopped': str(stopped) if stopped else None,
                   'steps': history}, f, indent=1)
    if args.plot:
      _plot(args.plot, history, schedule)
  if stopped:
    if main_process:
      print(f'{parser.prog}: error: {stopped}', file=sys.stderr)
    return 3
  return 0


def _plot(path, history, schedule):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
  left.plot([h['step'] for h in history], [h['loss'] for h in history])
  left.set(xlabel='step', ylabel='loss', title='training loss', yscale='log')
  schedule.plot(ax=right)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
