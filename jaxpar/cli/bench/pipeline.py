"""Pipeline executor: memory, compile time and CPU overhead against ``m``.

Sections:

* ``pipeline_memory``: compiled ``temp_size_in_bytes`` (the scratch memory
  of one device; arguments and outputs are reported apart) of a training step
  with a fixed microbatch size as the number of microbatches ``m`` grows:
  ``pipeline_value_and_grad`` with 1F1B, interleaved 1F1B and ZB-H1 against
  GPipe-by-autodiff, ``jax.value_and_grad`` through a ``lax.scan`` over the
  pipeline iterations as MaxText and Praxis do (grows with ``m``). The
  executor's scratch (its stashes and messages) is flat in ``m``
  (``temp_vs_m8``); the batch's input cotangent is written into the
  output (``output_bytes`` grows with ``m`` like ``argument_bytes``).
* ``compile_time``: seconds to lower and compile the same steps.
* ``cpu_overhead``: median step time of ``pipeline_value_and_grad`` on simulated CPU
  devices against one device running the same microbatches in turn
  (``sequential_step``), measured in one process (ratio of medians):
  ``vs_sequential`` of wall time, ``cpu_ratio`` of process CPU time (all
  threads), which counts the work added by pipelining even where the
  simulated devices share too few cores; ``cpu_vs_1f1b`` is what GPipe's
  ``m`` live stashes cost over 1F1B's ``p`` (the same blocks otherwise).
* ``zero_bubble_blocks``: XLA ``cost_analysis`` FLOPs of one stage's ``F``,
  ``I``, ``W`` and one-piece ``B`` blocks: ``I + W = B``, no recomputation.
* ``stash_policy``: what one microbatch's stash holds under each stash
  policy (``remat_policy``), for a stage of 4 residual gelu layers
  (``x + gelu(x @ w_k)``, the ``one_core`` section's model of
  ``jaxpar.cli.bench.real_parallel``) and of the tanh layers above: arrays and
  bytes (from ``StageVJP``'s traced stash avals), and the compiled
  ``temp_size_in_bytes`` of 1F1B and GPipe steps (``p = 2``, ``m = 8``) with
  it. The executor's default, ``'dots'``, is the fastest one on
  ``one_core``.
* ``gpt_stash``: what jaxpar's GPT stage stashes per token per layer, as
  the 3D trainer runs it (``tensor`` a manual axis, params cast to the
  compute dtype inside the stage): bytes, in units of ``h / t`` next to
  Megatron's ``34 h / t`` (selective recompute, sequence parallelism, bf16).

The model is ``LAYERS`` residual tanh layers sliced from a stacked leaf.
Parallel speed is not measured here (simulated devices share the cores): see
``jaxpar.cli.bench.real_parallel``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar import tensor_parallel as tp
from jaxpar.cli.bench._timing import compile_stats, wall_and_cpu_seconds
from jaxpar.mesh import axis_size, make_mesh
from jaxpar.pipeline import schedules as sched
from jaxpar.hlo import collective_bytes
from jaxpar.models import gpt
from jaxpar.pipeline.executor import (LossFn, StageFn,
                                     pipeline_value_and_grad)
from jaxpar.pipeline.schedules import tick_table
from jaxpar.cli.bench import _real_parallel_worker as worker
from jaxpar.pipeline.executor import StageVJP
from jaxpar.train_state import REMAT_POLICIES, cast_params


def gpipe_autodiff_step(stage_fn: StageFn, loss_fn: LossFn, *,
                        num_microbatches: int, mesh: Mesh,
                        stage_axis: str = 'stage') -> Callable:
  """GPipe by autodiff: ``jax.value_and_grad`` through a forward ``lax.scan``.

  The MaxText/Praxis way: one stage per rank; iteration ``t`` of
  ``m + p - 1`` runs microbatch ``t - r`` on rank ``r`` and rotates the
  activations one rank on. Reverse-mode AD keeps the residuals of every
  iteration, so activation memory grows as ``O(m + p)``. A baseline for the
  benchmark and tests, not jaxpar API.

  Returns:
    jitted ``step(stage_params, loss_params, inputs, targets) -> (loss,
    (dstage_params, dloss_params, dinputs))`` with ``stage_params`` stacked
    ``[p, ...]``, the same maths as ``pipeline_value_and_grad``.
  """
  axis = stage_axis
  p, m = axis_size(mesh, axis), num_microbatches

  def local_loss(params, loss_params, xs, ts):
    params = jax.tree.map(lambda a: a[0], params)
    rank = jax.lax.axis_index(axis)

    def iteration(carry, t):
      state, loss = carry
      x = jnp.where(rank == 0, xs[jnp.minimum(t, m - 1)], state)
      y = stage_fn(params, x)
      done = t - (p - 1)  # the microbatch leaving the last rank
      step_loss = loss_fn(loss_params, y, ts[jnp.clip(done, 0, m - 1)])
      loss = loss + jnp.where((rank == p - 1) & (done >= 0), step_loss, 0)
      state = jax.lax.ppermute(y, axis, [(r, (r + 1) % p) for r in range(p)])
      return (state, loss), None

    init = jax.lax.pcast((jnp.zeros_like(xs[0]), jnp.zeros((), xs.dtype)),
                         axis, to='varying')
    (_, loss), _ = jax.lax.scan(iteration, init, jnp.arange(m + p - 1))
    return jax.lax.psum(loss, axis) / m

  sharded = jax.shard_map(local_loss, mesh=mesh,
                          in_specs=(P(axis), P(), P(), P()), out_specs=P(),
                          axis_names={axis})

  @jax.jit
  def step(stage_params, loss_params, inputs, targets):
    split = lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:])
    loss, (ds, dl, dx) = jax.value_and_grad(sharded, argnums=(0, 1, 2))(
        stage_params, loss_params, split(inputs), split(targets))
    return loss, (ds, dl, dx.reshape(inputs.shape))
  return step


# ---------------------------------------------------------------- the model

LAYERS = 8  # in the whole model, split evenly over the stages


def _stage(params, x):
  """Residual tanh layers ``x + tanh(x @ w[k])``, sliced from a stacked leaf.

  The layers of a stage are one ``[layers, D, D]`` leaf indexed inside the
  function, as a GPT stage does (the stash must still hold activations only).
  """
  for k in range(params['w'].shape[0]):
    x = x + jnp.tanh(x @ params['w'][k])
  return x


def _loss(params, y, target):
  return jnp.mean((y @ params['head'] - target) ** 2)


def _model(num_stages: int, batch: int, width: int, seed: int = 0):
  """Float32 ``(stage_params, loss_params, inputs, targets)``."""
  k = jax.random.split(jax.random.key(seed), 4)
  normal = lambda key, shape, fan_in: (
      jax.random.normal(key, shape, jnp.float32) / fan_in**0.5)
  stages = {'w': normal(k[0], (num_stages, LAYERS // num_stages, width, width),
                        width)}
  head = {'head': normal(k[1], (width, 8), width)}
  return (stages, head, normal(k[2], (batch, width), 1.0),
          normal(k[3], (batch, 8), 1.0))


def sequential_step(num_microbatches: int) -> Callable:
  """One device, the microbatches in turn: ``lax.scan`` of ``value_and_grad``.

  The reference a pipeline must not add work to: the whole model on each
  microbatch (forward and backward fused), gradients accumulated.

  Returns:
    jitted ``step(stage_params, loss_params, inputs, targets) -> (loss,
    (dstage_params, dloss_params, dinputs))``, the maths of ``pipeline_value_and_grad``.
  """
  m = num_microbatches

  def loss(stages, head, x, t):
    for k in range(jax.tree.leaves(stages)[0].shape[0]):
      x = _stage(jax.tree.map(lambda a, k=k: a[k], stages), x)
    return _loss(head, x, t) / m

  @jax.jit
  def step(stages, head, inputs, targets):
    split = lambda a: a.reshape((m, a.shape[0] // m) + a.shape[1:])

    def one(acc, xt):
      l, (ds, dh, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
          stages, head, *xt)
      return jax.tree.map(jnp.add, acc, (l, ds, dh)), dx
    zero = jax.tree.map(jnp.zeros_like, (jnp.zeros(()), stages, head))
    (l, ds, dh), dx = jax.lax.scan(one, zero, (split(inputs), split(targets)))
    return l, (ds, dh, dx.reshape(inputs.shape))
  return step


# ---------------------------------------------------------------- sections


def _memory_and_compile(quick: bool) -> tuple[list[dict], list[dict]]:
  p, mb, width = 4, 16, 128
  ms = (8, 64) if quick else (8, 16, 32, 64, 128)
  mesh = make_mesh(stage=p, devices=jax.devices()[:p])
  memory, compile_time = [], []
  steps = [(name, lambda m, s=s: pipeline_value_and_grad(
      _stage, _loss, schedule=s(m), mesh=mesh)) for name, s in (
          ('1F1B', lambda m: sched.one_f_one_b(p, m)),
          ('interleaved (v=2)', lambda m: sched.interleaved_one_f_one_b(p, m, 2)),
          ('ZB-H1', lambda m: sched.zero_bubble_h1(p, m)))]
  steps.append(('GPipe by autodiff', lambda m: gpipe_autodiff_step(
      _stage, _loss, num_microbatches=m, mesh=mesh)))
  for name, make in steps:
    base = None
    for m in ms:
      num_stages = 2 * p if name.startswith('interleaved') else p
      stats = compile_stats(make(m), *_model(num_stages, m * mb, width))
      base = base or stats
      memory.append({
          'step': name, 'p': p, 'm': m, 'microbatch': mb, 'width': width,
          'temp_bytes': stats['temp_bytes'],
          'temp_vs_m8': stats['temp_bytes'] / base['temp_bytes'],
          'argument_bytes': stats['argument_bytes'],
          'output_bytes': stats['output_bytes']})
      compile_time.append({
          'step': name, 'p': p, 'm': m, 'compile_s': stats['compile_s'],
          'vs_m8': stats['compile_s'] / base['compile_s']})
  return memory, compile_time


def _cpu_overhead(quick: bool) -> list[dict]:
  p, m = 4, 8
  width, mb = (256, 64) if quick else (512, 128)
  mesh = make_mesh(stage=p, devices=jax.devices()[:p])
  reference = 'sequential microbatches, one device'
  steps = {reference: (sequential_step(m), 1)}
  for name, schedule in (('1F1B', sched.one_f_one_b(p, m)),
                         ('interleaved (v=2)', sched.interleaved_one_f_one_b(p, m, 2)),
                         ('ZB-H1', sched.zero_bubble_h1(p, m)),
                         ('GPipe', sched.gpipe(p, m))):
    steps[name] = (pipeline_value_and_grad(_stage, _loss, schedule=schedule, mesh=mesh),
                   schedule.num_stages)
  # One set of arguments, in p stages; a step with more stages regroups the
  # same layers (model order is kept by the reshape).
  regroup = lambda step, n: jax.jit(lambda w, *a: step(jax.tree.map(
      lambda x: x.reshape((n, -1) + x.shape[2:]), w), *a))
  seconds = wall_and_cpu_seconds(
      {name: regroup(step, n) for name, (step, n) in steps.items()},
      _model(p, m * mb, width), repeats=7 if quick else 11)
  rows = [{'step': name, 'p': 1 if name == reference else p, 'm': m,
           'microbatch': mb, 'width': width, 'layers': LAYERS,
           'median_ms': 1e3 * wall, 'cpu_ms': 1e3 * cpu}
          for name, (wall, cpu) in seconds.items()]
  ref = rows[0]
  one_f_one_b = next(r for r in rows if r['step'] == '1F1B')
  for row in rows:
    row['vs_sequential'] = row['median_ms'] / ref['median_ms']
    row['cpu_ratio'] = row['cpu_ms'] / ref['cpu_ms']
  # GPipe's extra over 1F1B is what its m live stashes cost (same blocks,
  # other order): reported apart.
  rows[-1]['cpu_vs_1f1b'] = rows[-1]['cpu_ms'] / one_f_one_b['cpu_ms']
  return rows


def _block_flops(quick: bool) -> list[dict]:
  """XLA ``cost_analysis`` FLOPs of one stage's F, I, W and fused B blocks."""
  width, mb = (256, 64) if quick else (512, 128)
  stages, _, inputs, _ = _model(2, mb, width)
  w = jax.tree.map(lambda a: a[0], stages)
  x = inputs
  stage = StageVJP(_stage)
  no_output = lambda method: lambda *a: [method(*a)][:0]
  jax.eval_shape(no_output(stage.trace), w, x)
  _, stash = jax.jit(stage.forward)(w, x)
  jax.eval_shape(no_output(stage.split), w, stash, x)
  _, kept = jax.jit(stage.input_grad)(w, stash, x)
  flops = lambda fn, *a: float(
      jax.jit(fn).lower(*a).compile().cost_analysis()['flops'])
  blocks = {'F': flops(stage.forward, w, x),
            'I': flops(stage.input_grad, w, stash, x),
            'W': flops(stage.weight_grad, w, stash, x, kept),
            'B (one piece)': flops(stage.backward, w, stash, x)}
  return [{'block': name, 'layers': LAYERS // 2, 'width': width,
           'microbatch': mb, 'gflops': f / 1e9,
           'vs_B': f / blocks['B (one piece)']}
          for name, f in blocks.items()]


def _mixed_precision(quick: bool) -> list[dict]:
  """1F1B in float32 and with ``compute_dtype=bfloat16``: bytes per rank.

  ``temp_bytes``: compiled ``memory_analysis``. ``stash_bytes`` /
  ``mailbox_bytes``: the executor's stash and mailbox buffers (slot count of
  the tick table x the bytes of one entry, from ``StageVJP``'s traced
  stash avals). ``message_bytes``: ``collective-permute`` bytes in the HLO
  jaxpar emits (XLA:CPU widens bf16 collectives to f32 when it compiles;
  GPUs send bf16).
  """
  p, m, width = 4, 8, 128
  mb = 64 if quick else 256
  mesh = make_mesh(stage=p, devices=jax.devices()[:p])
  schedule = sched.one_f_one_b(p, m)
  table = tick_table(schedule)
  args = _model(p, m * mb, width)
  nbytes = lambda tree: sum(a.size * a.dtype.itemsize
                            for a in jax.tree.leaves(tree))
  rows = []
  for name, dtype in (('float32', None), ('bfloat16', jnp.bfloat16)):
    step = pipeline_value_and_grad(_stage, _loss, schedule=schedule, mesh=mesh,
                         compute_dtype=dtype)
    low = step.lower(*args)
    stage = StageVJP(_stage if dtype is None else cast_params(_stage, dtype))
    x = jnp.zeros((mb, width), dtype or jnp.float32)
    _, stash = stage.trace(jax.tree.map(lambda a: a[0], args[0]), x)
    rows.append({
        'compute': name, 'p': p, 'm': m, 'microbatch': mb, 'width': width,
        'temp_bytes': low.compile().memory_analysis().temp_size_in_bytes,
        'stash_bytes': table.num_stash_slots * nbytes(stash),
        'mailbox_bytes': (table.num_mailbox_slots + 1) * nbytes(x),
        'message_bytes': collective_bytes(low.as_text(dialect='hlo'))[
            'collective-permute']})
  for row in rows:
    for k in ('temp_bytes', 'stash_bytes', 'message_bytes'):
      row[k.replace('_bytes', '_vs_f32')] = row[k] / rows[0][k]
  return rows


def _stash_policies(quick: bool) -> list[dict]:
  """Stash arrays and bytes per microbatch, and compiled temp bytes, per
  stash policy (see the module doc)."""
  p, m, layers = 2, 8, 4
  width, mb = (192, 48) if quick else (384, 96)
  mesh = make_mesh(stage=p, devices=jax.devices()[:p])
  w, head, x, t = worker.model(p * layers, width, m * mb)
  stages = {'w': w.reshape((p, layers, width, width))}
  one = jax.tree.map(lambda a: a[0], stages)
  rows = []
  for variant, fn in (('gelu', worker.gelu_stage_fn),
                      ('tanh', worker.stage_fn)):
    base = None
    for policy in REMAT_POLICIES:
      _, stash = StageVJP(fn, remat_policy=policy).trace(one, x[:mb])
      nbytes = sum(a.size * a.dtype.itemsize for a in stash)
      base = base or nbytes
      temp = {name: pipeline_value_and_grad(
          fn, worker.loss_fn, schedule=make(p, m), mesh=mesh,
          remat_policy=policy).lower(stages, head, x, t).compile(
          ).memory_analysis().temp_size_in_bytes
              for name, make in (('1f1b', sched.one_f_one_b),
                                 ('gpipe', sched.gpipe))}
      rows.append({
          'variant': variant, 'policy': policy,
          'default': policy == 'dots', 'layers': layers,
          'width': width, 'microbatch': mb, 'stash_arrays': len(stash),
          'stash_bytes_per_mb': nbytes, 'vs_everything': nbytes / base,
          'temp_bytes_1f1b': temp['1f1b'], 'temp_bytes_gpipe': temp['gpipe'],
          'p': p, 'm': m})
  return rows


def _gpt_stash(quick: bool) -> list[dict]:
  """Stash bytes per token per layer of a GPT stage (module doc)."""
  config = gpt.GPTConfig(vocab_size=64, seq_len=32 if quick else 128,
                         d_model=64 if quick else 256, num_heads=4,
                         num_layers=2)
  stages = gpt.split_for_pipeline(gpt.gpt_params(gpt.GPT(
      config, rngs=nnx.Rngs(0))), num_stages=1)[0].stages
  one = jax.tree.map(lambda a: a[0], stages)
  h, mb = config.d_model, 2
  rows = []
  for name, dtype in (('float32', jnp.float32), ('bfloat16', jnp.bfloat16)):
    for t in (1, 2):
      mesh = make_mesh(tensor=t, devices=jax.devices()[:t])
      specs = tp.param_specs(one, rules=gpt.TENSOR_RULES)
      for policy in ('dots', 'nothing', 'everything'):
        stage = StageVJP(cast_params(gpt.functions(config)[1], dtype),
                         remat_policy=policy)
        found = []
        jax.eval_shape(jax.shard_map(
            lambda w, x: found.append(stage.trace(w, x)[1]) or x, mesh=mesh,
            in_specs=(specs, P()), out_specs=P()),
            tp.shard_params(one, mesh=mesh, rules=gpt.TENSOR_RULES),
            jnp.zeros((mb, config.seq_len, h), dtype))
        per = sum(a.size * a.dtype.itemsize for a in found[0]) / (
            mb * config.seq_len * config.num_layers)
        rows.append({'compute': name, 'tensor': t, 'policy': policy,
                     'h': h, 'seq': config.seq_len,
                     'layers': config.num_layers, 'arrays': len(found[0]),
                     'bytes_per_token_layer': per,
                     'in_h_over_t': per * t / h, 'megatron_h_over_t': 34})
  return rows


def run(*, quick: bool) -> dict[str, list[dict]]:
  """The memory, compile-time, CPU-overhead and block-FLOPs sections."""
  memory, compile_time = _memory_and_compile(quick)
  return {'pipeline_memory': memory, 'compile_time': compile_time,
          'mixed_precision_memory': _mixed_precision(quick),
          'cpu_overhead': _cpu_overhead(quick),
          'zero_bubble_blocks': _block_flops(quick),
          'stash_policy': _stash_policies(quick),
          'gpt_stash': _gpt_stash(quick)}
