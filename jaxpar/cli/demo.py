"""``python -m jaxpar demo``: train a GPT with data x pipeline x tensor parallelism.

Without ``--data`` the task is generated in-process and learnable: each
sequence is an arithmetic progression modulo the vocabulary,
``x_t = (x_0 + t*c) mod V`` with random ``x_0`` and ``c``. Only the first
next-token prediction (which needs ``c``) is a guess; every later one
follows from two tokens, so the loss falls from ``log V`` towards
``log(V) / S``.

With ``--data PATH`` the GPT learns the bytes of a text file (vocabulary
256, ``jaxpar.cli.text_data``): the last 10% is held out, its loss is evaluated every
``--eval-every`` steps on the same mesh (no gradients) and compared with the
held-out bytes' unigram entropy, and ``--sample N`` prints what the model
writes (``jaxpar.models.sampling``). The summary reports tokens/s, model
FLOPs per token (``jaxpar.models.flops``) and the FLOP/s achieved: against the
GPU's peak (MFU) where it is known, and on CPU against a plain jitted step
of the same model on one device.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import NamedTuple

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

import jaxpar
from jaxpar import pipeline
from jaxpar.cli import text_data as data
from jaxpar.cli.demo_args import make_schedule, parse_args
from jaxpar.models import flops, gpt, sampling

def make_batch(seed: int, step: int, batch: int, seq_len: int, vocab: int):
  """The batch of ``step``: a pure function of ``(seed, step)`` (resumable)."""
  rng = np.random.default_rng([seed, step])
  start = rng.integers(0, vocab, (batch, 1))
  stride = rng.integers(1, vocab, (batch, 1))
  seq = (start + stride * np.arange(seq_len + 1)) % vocab
  return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32)


def held_out_loss(trainer, split, config: gpt.GPTConfig, text: data.TextData,
                  *, batch: int):
  """``state -> float``: the mean loss on a fixed held-out batch, no gradients.

  The dense ``gpt_loss`` of ``merge_from_pipeline(trainer.params(state),
  split)`` (``split``: the ``jaxpar.parallel.LayerSplit`` of the layers)
  under ``jit``: the params stay sharded on the train mesh (XLA partitions
  the forward) and the held-out batch is split over ``data``.
  """
  held = data.held_out_batch(text.held_out, batch=batch, seq_len=config.seq_len)
  loss = jax.jit(lambda params, held: gpt.gpt_loss(
      gpt.merge_from_pipeline(params, split), held, config=config))

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


def write_sample(trainer, state, split, config, args, text) -> tuple[str, str]:
  """(prompt, continuation) as text: ``--sample`` bytes from the model."""
  prompt = _prompt(args, text)
  params = gpt.merge_from_pipeline(trainer.params(state), split)
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


class _Setup(NamedTuple):
  """What a run trains, built from the flags."""
  mesh: Mesh
  schedule: pipeline.Schedule
  config: gpt.GPTConfig
  params: dict               # dense, as the GPT was initialised
  pipeline_params: jaxpar.parallel.PipelineParams   # the same, cut in stages
  split: jaxpar.parallel.LayerSplit                 # the layers of each stage
  trainer: jaxpar.Trainer
  text: data.TextData | None   # --data, or None: the synthetic task


class _Run(NamedTuple):
  """What training gave."""
  state: jaxpar.TrainState
  first: int            # the step training started from (> 0: resumed)
  history: list[dict]   # per step: step, loss, grad_norm, skipped, seconds
  evals: list[dict]     # held-out losses: step, loss
  stopped: jaxpar.TooManySkippedError | None   # too many skipped steps


def main(argv: list[str] | None = None) -> int:
  """``python -m jaxpar demo ...``; the exit code: 0, 2 (a bad flag), 3 (too
  many non-finite steps in a row), 4 (a damaged checkpoint to resume)."""
  args, parser = parse_args(argv)
  text = _load_text(args, parser)
  _join_job(args)
  setup = _set_up(args, text, parser)
  try:
    state = _first_state(setup, args, parser)
  except jaxpar.checkpoint.CheckpointError as e:
    print(f'{parser.prog}: error: {e}', file=sys.stderr)
    return 4
  run = _train(setup, state, args)
  if args.checkpoint and not run.stopped:   # every process writes its shards
    jaxpar.checkpoint.save(args.checkpoint, run.state, schedule=setup.schedule)
  # Placing the batch is collective across processes: lower in all of them.
  mem = setup.trainer.step.lower(
      run.state, _batch(setup, args, 0)).compile().memory_analysis()
  # Generating is collective too (the params are sharded over processes).
  sample = None if args.sample is None else write_sample(
      setup.trainer, run.state, setup.split, setup.config, args, text)
  main_process = jaxpar.distributed.is_main_process()
  if main_process:
    _report(args, setup, run, mem, sample)
  if run.stopped:
    if main_process:
      print(f'{parser.prog}: error: {run.stopped}', file=sys.stderr)
    return 3
  return 0


def _load_text(args, parser) -> data.TextData | None:
  """``--data``, read and split (a bad file: exit 2 in one line)."""
  if args.data is None:
    return None
  try:
    return data.load_text(args.data, seq_len=args.seq_len)
  except ValueError as e:
    parser.error(f'--data {e}')


def _join_job(args) -> None:
  """One process, or one of several (flags, ``launch``'s environment, or what
  jax.distributed detects); 8 simulated CPU devices unless told otherwise."""
  local_devices = args.devices or (
      None if os.environ.get(jaxpar.distributed.ENV_LOCAL_DEVICE_COUNT) else 8)
  jaxpar.distributed.initialize(args.coordinator, args.num_processes,
                                args.process_id,
                                local_device_count=local_devices)


def _config(args, text: data.TextData | None) -> gpt.GPTConfig:
  return gpt.GPTConfig(
      vocab_size=32 if text is None else data.VOCAB_SIZE, seq_len=args.seq_len,
      d_model=args.d_model, num_heads=args.heads, num_layers=args.layers,
      dropout=args.dropout)


def _use_plan(args, config: gpt.GPTConfig) -> pipeline.Schedule:
  """``--plan``: the mesh, microbatches and ZeRO stage of ``jaxpar.plan``'s
  best layout (the demo's remat policy) on the devices; returns its
  schedule (a searched one included)."""
  plan = jaxpar.plan(config, optax.adam(args.lr), batch=args.batch,
                     devices=jax.devices(), remat_policies=('dots',))
  best = plan.best.layout
  if jaxpar.distributed.is_main_process():
    print(plan.table(5))
  args.mesh = {'data': best.data, 'stage': best.stage, 'tensor': best.tensor}
  args.schedule, args.microbatches = best.schedule_name, best.num_microbatches
  args.virtual_stages, args.zero = best.virtual_stages, best.zero_stage
  return best.schedule()


def _set_up(args, text: data.TextData | None, parser) -> _Setup:
  """The mesh, schedule, GPT and trainer the flags ask for."""
  config = _config(args, text)
  planned = _use_plan(args, config) if args.plan else None
  n = math.prod(args.mesh.values())
  if n > jax.device_count():
    sizes = ','.join(f'{k}={v}' for k, v in args.mesh.items())
    parser.error(f'--mesh {sizes} needs {n} devices but only '
                 f'{jax.device_count()} exist; use a smaller mesh or --devices')
  mesh = jaxpar.make_mesh(**args.mesh, devices=jax.devices()[:n])
  schedule = planned or make_schedule(args)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(args.seed)))
  pipeline_params, split = gpt.split_for_pipeline(
      params, num_stages=schedule.num_stages)
  trainer = jaxpar.parallel.trainer(
      *gpt.functions(config), optax.adam(args.lr), schedule=schedule,
      mesh=mesh, stage_mask=split.mask, max_grad_norm=1.0,
      tensor_rules=gpt.TENSOR_RULES, zero_stage=args.zero,
      compute_dtype=None if args.dtype == 'float32' else args.dtype,
      key=jax.random.key(args.seed) if args.dropout else None)
  return _Setup(mesh, schedule, config, params, pipeline_params, split,
                trainer, text)


def _first_state(setup: _Setup, args, parser) -> jaxpar.TrainState:
  """The initial state, or with ``--resume`` the newest checkpoint's
  (``CheckpointError`` if it is damaged: never skipped for an older one)."""
  try:
    state = setup.trainer.init(setup.pipeline_params)
  except ValueError as e:   # e.g. heads not divisible by the tensor size
    parser.error(str(e).splitlines()[0])
  if not args.resume:
    return state
  newest = jaxpar.checkpoint.latest_step(args.checkpoint, verify=False)
  if newest is None:
    return state
  return jaxpar.checkpoint.restore(args.checkpoint, state, step=newest,
                                   schedule=setup.schedule)


def _batch(setup: _Setup, args, step: int):
  """The batch of ``step``: synthetic, or windows of the --data bytes."""
  if setup.text is None:
    return make_batch(args.seed, step, args.batch, setup.config.seq_len,
                      setup.config.vocab_size)
  return data.text_batch(setup.text.train, seed=args.seed, step=step,
                         batch=args.batch, seq_len=setup.config.seq_len)


def _train(setup: _Setup, state: jaxpar.TrainState, args) -> _Run:
  """Steps from ``state.step`` to ``--steps`` with a progress bar and the
  held-out loss every ``--eval-every`` steps; stops after ``--max-skipped``
  non-finite steps in a row."""
  evaluate = None if setup.text is None else held_out_loss(
      setup.trainer, setup.split, setup.config, setup.text,
      batch=4 * args.batch)
  run = _Run(state, int(state.step), [], [], None)
  tokens = args.batch * setup.config.seq_len
  skips = jaxpar.SkipCount()
  bar = tqdm(range(run.first, args.steps), desc=f'GPT {setup.schedule.name}',
             unit='step', disable=not jaxpar.distributed.is_main_process(),
             file=sys.stdout)
  _evaluate_at(run.first, evaluate, run, args)
  for i in bar:
    start = time.perf_counter()
    state, stats = setup.trainer.step(run.state, _batch(setup, args, i))
    run = run._replace(state=state)
    loss, seconds = float(stats.loss), time.perf_counter() - start
    run.history.append({'step': i, 'loss': loss, 'grad_norm': float(
        stats.grad_norm), 'skipped': bool(stats.skipped), 'seconds': seconds})
    _evaluate_at(i + 1, evaluate, run, args)
    bar.set_postfix(loss=f'{loss:.3f}', **(
        {'held_out': f'{run.evals[-1]["loss"]:.3f}'} if run.evals else {}),
                    tokens_s=f'{tokens / seconds:,.0f}',
                    skipped=sum(h['skipped'] for h in run.history))
    try:
      skips = jaxpar.count_skipped(skips, stats, step=i,
                                   max_skipped=args.max_skipped)
    except jaxpar.TooManySkippedError as e:
      run = run._replace(stopped=e)
      break
  bar.close()
  return run


def _evaluate_at(step: int, evaluate, run: _Run, args) -> None:
  """Appends the held-out loss to ``run.evals`` every ``--eval-every`` steps
  and at the last step (``--data`` only)."""
  if evaluate and (step % args.eval_every == 0 or step == args.steps):
    run.evals.append({'step': step, 'loss': evaluate(run.state)})


def _report(args, setup: _Setup, run: _Run, mem, sample) -> None:
  """The summary on stdout, ``--json`` and ``--plot`` (process 0 only)."""
  history, config, text = run.history, setup.config, setup.text
  steady = history[1:] or history
  rate = (args.batch * config.seq_len * len(steady)
          / max(sum(h['seconds'] for h in steady), 1e-9))
  single = (single_device_rate(
      setup.params, _batch(setup, args, 0), config=config,
      optimizer=optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adam(args.lr)))
            if history and args.baseline and jax.default_backend() == 'cpu'
            else None)
  speed = throughput(rate, config, single) if history else None
  print(summary(args, setup, run, mem, speed, sample,
                held=jaxpar.data_parallel.bytes_per_device(run.state)))
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'config': {**vars(args), 'schedule_name': setup.schedule.name},
                 'skipped': sum(h['skipped'] for h in history),
                 'stopped': str(run.stopped) if run.stopped else None,
                 'throughput': speed,
                 'unigram_entropy': None if text is None else
                                    data.unigram_entropy(text.held_out),
                 'sample': None if sample is None else ''.join(sample),
                 'steps': history, 'eval': run.evals}, f, indent=1)
  if args.plot:
    _plot(args.plot, history, run.evals, setup.schedule)


def summary(args, setup: _Setup, run: _Run, mem, speed: dict | None,
            sample: tuple[str, str] | None, held=None) -> str:
  """The lines printed at the end of a run (``mem``: the step's compiled
  memory analysis; ``speed``: ``throughput``; ``held``:
  ``jaxpar.data_parallel.bytes_per_device``)."""
  mesh, schedule, config, text = (setup.mesh, setup.schedule, setup.config,
                                  setup.text)
  history, first, evals = run.history, run.first, run.evals
  sim = schedule.simulate()
  shape = ' '.join(f'{k}={v}' for k, v in mesh.shape.items())
  lines = [
      f'mesh          {shape} ({mesh.size} {jax.default_backend()} devices, '
      f'{jax.process_count()} process(es))',
      f'model         GPT {args.layers} layers, d={config.d_model}, '
      f'{config.num_heads} heads, seq {config.seq_len}, vocab '
      f'{config.vocab_size}, {args.dtype} compute, dropout {args.dropout}; '
      f'stage slots {setup.split.counts}',
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
