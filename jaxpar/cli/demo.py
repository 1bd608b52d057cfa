"""``python -m jaxpar demo``: train a GPT with data x pipeline x tensor parallelism.

Without ``--data`` the task is generated in-process and learnable: each
sequence is an arithmetic progression modulo the vocabulary,
``x_t = (x_0 + t*c) mod V`` with random ``x_0`` and ``c``. Only the first
next-token prediction (which needs ``c``) is a guess; every later one
follows from two tokens, so the loss falls from ``log V`` towards
``log(V) / S``.

With ``--data PATH`` the GPT learns the bytes of a text file (vocabulary
256, ``jaxpar.data``): the last 10% is held out, its loss is evaluated every
``--eval-every`` steps on the same mesh (no gradients) and compared with the
held-out bytes' unigram entropy, and ``--sample N`` prints what the model
writes (``jaxpar.models.sampling``). The summary reports tokens/s, model
FLOPs per token (``jaxpar.models.flops``) and the FLOP/s achieved: against the
GPU's peak (MFU) where it is known, and on CPU against a plain jitted step
of the same model on one device.
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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import jaxpar
from jaxpar.cli import text_data as data
from jaxpar.models import flops
from jaxpar import pipeline
from jaxpar.models import gpt, sampling

# Model defaults: (synthetic task, --data text). The text model learns
# below the unigram entropy in a few minutes on 2 CPU cores (README).
DEFAULTS = {'seq_len': (16, 64), 'heads': (8, 4),
            'eval_every': (None, 50)}
SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb_h1', 'zero_bubble_v', 'dualpipe_v',
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
  p.add_argument('--seq-len', type=int, help='tokens per sequence (default '
                 '16; 64 with --data)')
  p.add_argument('--d-model', type=int, default=64, help='model width')
  p.add_argument('--heads', type=int, help='attention heads (default 8; 4 '
                 'with --data)')
  p.add_argument('--data', metavar='PATH', help='train on the bytes of this '
                 'text file (vocab 256); its last 10%% is held out')
  p.add_argument('--eval-every', type=int, metavar='N', help='--data: '
                 'held-out loss every N steps (default 50) and at the end')
  p.add_argument('--sample', type=int, metavar='N', help='--data: print N '
                 'bytes the model writes after --prompt at the end')
  p.add_argument('--prompt', help='--sample: the text to continue (default: '
                 'the start of a held-out line)')
  p.add_argument('--temperature', type=float, metavar='T',
                 help='--sample: 0 greedy (default), T > 0 samples '
                 'softmax(logits / T) with a key from --seed')
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
  p.add_argument('--dtype', choices=('float32', 'bfloat16'), default='float32',
                 help='compute dtype of the stages (activations, stashes, '
                 'messages); params, optimizer state and loss stay float32')
  p.add_argument('--dropout', type=float, default=0.0, metavar='P',
                 help='residual and embedding dropout rate while training '
                 '(masks from --seed and the step: resumable)')
  p.add_argument('--max-skipped', type=int, default=5, metavar='K',
                 help='stop (exit code 3) after K consecutive steps skipped '
                 'for non-finite loss or gradients')
  p.add_argument('--baseline', action=argparse.BooleanOptionalAction,
                 default=True, help='on CPU, also time a plain jitted step '
                 'of the dense model on one device, for contrast')
  p.add_argument('--coordinator', metavar='HOST:PORT',
                 help='jax.distributed coordinator (multi-process runs)')
  p.add_argument('--num-processes', type=int)
  p.add_argument('--process-id', type=int)
  args = p.parse_args(argv)
  if isinstance(args.mesh, str):
    args.mesh = _mesh_flag(args.mesh)
  text = int(args.data is not None)
  for name, values in DEFAULTS.items():
    if getattr(args, name) is None:
      setattr(args, name, values[text])
  if not text:
    for flag in ('eval_every', 'sample', 'prompt'):
      if getattr(args, flag) is not None:
        p.error(f'--{flag.replace("_", "-")} needs --data PATH (a text file '
                'to train on); the synthetic task has no held-out text')
  for name in ('microbatches', 'virtual_stages', 'steps', 'layers', 'batch',
               'devices', 'max_skipped', 'seq_len', 'd_model', 'heads',
               'eval_every', 'sample'):
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
  if args.d_model % args.heads:
    p.error(f'--d-model {args.d_model} is not divisible by --heads '
            f'{args.heads}; use a multiple of {args.heads}')
  if args.sample is None and (args.prompt is not None
                              or args.temperature is not None):
    p.error('--prompt and --temperature need --sample N (bytes to write), '
            "e.g. --sample 200 --prompt 'def ' --temperature 0.8")
  if args.prompt == '':
    p.error("--prompt is empty; give the text to continue, e.g. --prompt 'def '")
  if args.temperature is not None and not (
      math.isfinite(args.temperature) and args.temperature >= 0):
    p.error(f'--temperature must be a finite number >= 0 (0: greedy), got '
            f'{args.temperature}')
  if not math.isfinite(args.lr) or args.lr <= 0:
    p.error(f'--lr must be a finite number > 0, got {args.lr}')
  if not 0 <= args.dropout < 1:
    p.error(f'--dropout must be a rate in [0, 1), got {args.dropout}')
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
  return {'interleaved': p * args.virtual_stages, 'zero_bubble_v': 2 * p,
          'dualpipe_v': 2 * p, 'v_half': 2 * p, 'v_min': 2 * p}.get(
              args.schedule, p)


def make_schedule(args):
  p, m = args.mesh['stage'], args.microbatches
  if args.schedule == 'interleaved':
    return pipeline.interleaved_one_f_one_b(p, m, args.virtual_stages)
  if args.schedule == 'auto':
    return pipeline.search(p, m, memory_limit=args.memory_limit)
  return {'gpipe': pipeline.gpipe, '1f1b': pipeline.one_f_one_b,
          'zb_h1': pipeline.zero_bubble_h1, 'zero_bubble_v': pipeline.zero_bubble_v,
          'dualpipe_v': pipeline.dualpipe_v, 'v_half': pipeline.v_half,
          'v_min': pipeline.v_min}[args.schedule](p, m)


def make_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int):
  """The batch of ``step``: a pure function of ``(seed, step)`` (resumable)."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, (batch, 1))
  stride = rng.integers(1, vocab, (batch, 1))
  seq = (start + stride * np.arange(seq_len + 1)) % vocab
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def held_out_loss(trainer, layout, config: gpt.GPTConfig, text: data.TextData,
                  *, batch: int):
  """``state -> float``: the mean loss on a fixed held-out batch, no gradients.

  The dense ``gpt_loss`` of ``merge_from_pipeline(trainer.params(state))``
  under ``jit``: the params stay sharded on the train mesh (XLA partitions
  the forward) and the held-out batch is split over ``data``.
  """
  held = data.held_out_batch(text.held_out, batch=batch, seq_len=config.seq_len)
  loss = jax.jit(lambda params, held: gpt.gpt_loss(
      gpt.merge_from_pipeline(params, layout), held, config=config))

  def evaluate(state) -> float:
    params = trainer.params(state)
    mesh = jax.tree.leaves(params)[0].sharding.mesh
    return float(loss(params, jax.device_put(held, NamedSharding(mesh,
                                                                 P('data')))))
  return evaluate


def single_device_rate(params: dict, batch, *, config: gpt.GPTConfig,
                       optimizer, steps: int = 3) -> float:
  """Tokens/s of a plain jitted train step of the dense model on one device.

  The contrast for the parallel step: ``value_and_grad(gpt_loss)`` and the
  same optimizer, the same batch, on ``jax.local_devices()[0]``; timed over
  ``steps`` steps after one that compiles.
  """
  @jax.jit
  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(gpt.gpt_loss)(params, batch, config=config)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  # Every input committed to the device, as the outputs will be: one compile.
  *state, batch = jax.device_put((params, optimizer.init(params), batch),
                                 jax.local_devices()[0])
  state = jax.block_until_ready(step(*state, batch)[:2])   # compiles
  start = time.perf_counter()
  for _ in range(steps):
    state = step(*state, batch)[:2]
  jax.block_until_ready(state)
  return batch[0].size * steps / (time.perf_counter() - start)


def _prompt(args, text: data.TextData) -> bytes:
  """--prompt, or the first 32 bytes of a held-out line."""
  if args.prompt is not None:
    return args.prompt.encode()
  held = text.held_out.tobytes()
  line = held.find(b'\n') + 1
  return (held[line:line + 32] if len(held) - line >= 8 else held[:32])


def write_sample(trainer, state, layout, config, args, text) -> tuple[str, str]:
  """(prompt, continuation) as text: ``--sample`` bytes from the model."""
  prompt = _prompt(args, text)
  params = gpt.merge_from_pipeline(trainer.params(state), layout)
  out = sampling.generate(
      params, np.frombuffer(prompt, np.uint8), config=config,
      length=args.sample, temperature=args.temperature or 0.0,
      key=jax.random.key(args.seed))
  new = bytes(np.asarray(out).astype(np.uint8).tolist())
  return (prompt.decode('utf-8', 'replace'), new.decode('utf-8', 'replace'))


def throughput(rate: float, config: gpt.GPTConfig, single: float | None
               ) -> dict:
  """tokens/s, model FLOPs/token, achieved FLOP/s, MFU (known GPUs only)."""
  per_token = flops.gpt_flops_per_token(config)
  peak = flops.peak_flops(jax.devices()[0])
  return {'tokens_per_s': rate, 'flops_per_token': per_token,
          'flops_formula': '6 N + 12 L d S (PaLM appendix B)',
          'flop_per_s': rate * per_token,
          'peak_flop_per_s': peak,
          'mfu': rate * per_token / peak if peak else None,
          'device_kind': jax.devices()[0].device_kind,
          'single_device_tokens_per_s': single,
          'single_device_flop_per_s': single and single * per_token}


def main(argv: list[str] | None = None) -> int:
  args, parser = parse_args(argv)
  text = None
  if args.data is not None:
    try:
      text = data.load_text(args.data, seq_len=args.seq_len)
    except ValueError as e:
      parser.error(f'--data {e}')
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
  config = gpt.GPTConfig(
      vocab_size=32 if text is None else data.VOCAB_SIZE, seq_len=args.seq_len,
      d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
      dropout=args.dropout)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(args.seed)))
  pipeline_params, layout = gpt.split_for_pipeline(
      params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.trainer(
      *gpt.functions(config), optax.adam(args.lr), schedule=schedule,
      mesh=mesh, stage_mask=layout.mask, max_grad_norm=1.0,
      zero_stage=args.zero,
      compute_dtype=None if args.dtype == 'float32' else args.dtype,
      key=jax.random.key(args.seed) if args.dropout else None)
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

  def batch_of(step: int):
    if text is None:
      return make_batch(args.seed, step, args.batch, config.seq_len,
                        config.vocab_size)
    return data.text_batch(text.train, seed=args.seed, step=step,
                           batch=args.batch, seq_len=config.seq_len)

  evaluate = None if text is None else held_out_loss(
      trainer, layout, config, text, batch=4 * args.batch)
  first = int(state.step)
  tokens = args.batch * config.seq_len
  history, evals, skips, stopped = [], [], jaxpar.SkipCount(), None
  bar = tqdm(range(first, args.steps), desc=f'GPT {schedule.name}',
             unit='step', disable=not main_process, file=sys.stdout)

  def maybe_evaluate(step: int):
    if evaluate and (step % args.eval_every == 0 or step == args.steps):
      evals.append({'step': step, 'loss': evaluate(state)})

  maybe_evaluate(first)
  for i in bar:
    start = time.perf_counter()
    state, stats = trainer.step(state, batch_of(i))
    loss = float(stats.loss)
    seconds = time.perf_counter() - start
    history.append({'step': i, 'loss': loss, 'grad_norm': float(
        stats.grad_norm), 'skipped': bool(stats.skipped), 'seconds': seconds})
    maybe_evaluate(i + 1)
    bar.set_postfix(loss=f'{loss:.3f}', **(
        {'held_out': f'{evals[-1]["loss"]:.3f}'} if evals else {}),
                    tokens_s=f'{tokens / seconds:,.0f}',
                    skipped=sum(h['skipped'] for h in history))
    try:
      skips = jaxpar.count_skipped(skips, stats, step=i,
                                         max_skipped=args.max_skipped)
    except jaxpar.TooManySkippedError as e:
      stopped = e
      break
  bar.close()
  if args.checkpoint and not stopped:   # every process writes its shards
    jaxpar.checkpoint.save(args.checkpoint, state, schedule=schedule)
  # Placing the batch is collective across processes: lower in all of them.
  mem = trainer.step.lower(state, batch_of(0)).compile().memory_analysis()
  # Generating is collective too (the params are sharded over processes).
  sample = None if args.sample is None else write_sample(
      trainer, state, layout, config, args, text)

  if main_process:
    steady = history[1:] or history
    rate = tokens * len(steady) / max(sum(h['seconds'] for h in steady), 1e-9)
    single = (single_device_rate(
        params, batch_of(0), config=config, optimizer=optax.chain(
            optax.clip_by_global_norm(1.0), optax.adam(args.lr)))
              if history and args.baseline and jax.default_backend() == 'cpu'
              else None)
    speed = throughput(rate, config, single) if history else None
    print(summary(args, mesh, schedule, config, layout, mem, history, first,
                  text, evals, speed, sample,
                  held=jaxpar.data_parallel.bytes_per_device(state)))
    if args.json:
      with open(args.json, 'w') as f:
        json.dump({'config': {**vars(args), 'schedule_name': schedule.name},
                   'skipped': sum(h['skipped'] for h in history),
                   'stopped': str(stopped) if stopped else None,
                   'throughput': speed,
                   'unigram_entropy': None if text is None else
                                      data.unigram_entropy(text.held_out),
                   'sample': None if sample is None else ''.join(sample),
                   'steps': history, 'eval': evals}, f, indent=1)
    if args.plot:
      _plot(args.plot, history, evals, schedule)
  if stopped:
    if main_process:
      print(f'{parser.prog}: error: {stopped}', file=sys.stderr)
    return 3
  return 0


def summary(args, mesh, schedule, config, layout, mem, history, first, text,
            evals, speed, sample, held=None) -> str:
  """The lines printed at the end of a run (``held``: ``zero.StateBytes``)."""
  sim = schedule.simulate()
  shape = ' '.join(f'{k}={v}' for k, v in mesh.shape.items())
  lines = [
      f'mesh          {shape} ({mesh.size} {jax.default_backend()} devices, '
      f'{jax.process_count()} process(es))',
      f'model         GPT {args.layers} layers, d={config.d_model}, '
      f'{config.num_heads} heads, seq {config.seq_len}, vocab '
      f'{config.vocab_size}, {args.dtype} compute, dropout {args.dropout}; '
      f'stage slots {layout.counts}',
      f'schedule      {schedule.name}: p={schedule.num_ranks}, '
      f'm={schedule.num_microbatches}, {schedule.num_stages} stages; '
      f'bubble {sim.bubble_fraction:.1%} (simulated)',
      f'memory        {mem.temp_size_in_bytes / 2**20:.2f} MiB temp + '
      f'{mem.argument_size_in_bytes / 2**20:.2f} MiB arguments per device '
      '(compiled program)']
  if held is not None:
    lines.append(f'state         {held.params / 2**20:.2f} MiB params + '
                 f'{held.opt_state / 2**20:.2f} MiB optimizer state on the '
                 f'fullest device (ZeRO-{args.zero}; jaxpar.data_parallel.'
                 'bytes_per_device)')
  if text:
    lines.append(f'data          {args.data}: {len(text.train):,} bytes to '
                 f'train on, {len(text.held_out):,} held out')
  if not history:
    return '\n'.join(['', *lines, f'nothing to do: already at step {first}'])
  losses = [h['loss'] for h in history]
  lines.append(f'loss          {losses[0]:.3f} -> {losses[-1]:.3f} over steps '
               f'{first}..{history[-1]["step"]}')
  if evals:
    lines.append(
        f'held-out      {evals[0]["loss"]:.3f} -> {evals[-1]["loss"]:.3f} at '
        f'step {evals[-1]["step"]}; unigram entropy of the held-out bytes '
        f'{data.unigram_entropy(text.held_out):.3f} (nats/byte)')
  flop_s = f'{speed["flop_per_s"] / 1e9:,.2f} GFLOP/s'
  lines.append(
      f'throughput    {speed["tokens_per_s"]:,.0f} tokens/s (steady state) x '
      f'{speed["flops_per_token"] / 1e6:,.2f} MFLOP/token (6N + 12LdS) = '
      f'{flop_s}' + (f', MFU {speed["mfu"]:.1%} of '
                     f'{speed["peak_flop_per_s"] / 1e12:,.0f} TFLOP/s ('
                     f'{speed["device_kind"]} bf16 dense peak)'
                     if speed['mfu'] is not None else ''))
  if speed['single_device_tokens_per_s']:
    lines.append(
        f'one device    {speed["single_device_tokens_per_s"]:,.0f} tokens/s = '
        f'{speed["single_device_flop_per_s"] / 1e9:,.2f} GFLOP/s: a plain '
        'jitted step of the same model and batch on one CPU device')
  lines.append(f'skipped       {sum(h["skipped"] for h in history)} steps '
               '(non-finite loss or gradients)')
  if sample:
    how = (f'temperature {args.temperature}' if args.temperature
           else 'greedy')
    lines += [f'sample        {args.sample} bytes ({how}) after the prompt '
              f'{sample[0]!r}:', sample[0] + sample[1]]
  return '\n'.join(['', *lines])


def _plot(path, history, evals, schedule):
  import matplotlib  # pylint: disable=g-import-not-at-top
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
  fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4))
  left.plot([h['step'] for h in history], [h['loss'] for h in history],
            label='train')
  if evals:
    left.plot([e['step'] for e in evals], [e['loss'] for e in evals], 'o-',
              label='held-out')
    left.legend()
  left.set(xlabel='step', ylabel='loss', title='training loss', yscale='log')
  schedule.plot(ax=right)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
