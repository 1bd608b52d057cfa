"""One rank of the ``real_parallel`` benchmark (``jaxpar.cli.bench.real_parallel``).

``python -m jaxpar.cli.bench._real_parallel_worker CONFIG_JSON``, started by
``jaxpar.distributed.launch`` with one CPU device per process; the config
holds ``measure``'s sizes and options, the ``cores`` and the ``out`` path.
Each rank starts on ``config['cores'][rank]`` alone (``launch``'s
``cores_per_process=1``) and adds ``config['xla_flags']`` to ``XLA_FLAGS``
before JAX starts its backend (whose thread pool then has one thread: one
compute thread per process), and with
``config['pinned']`` false lets its threads run on all ``config['cores']``
once the backend started. It joins the job (gloo) and times, in rotated
rounds (round ``r`` starts with the ``r``-th step, so that no step always
runs after the same one):

* ``sequential``: rank 0 alone runs the ``m`` microbatches one after the
  other on its core (``lax.scan`` of ``value_and_grad`` of the whole model,
  gradients accumulated); the other ranks wait at the next barrier;
* every pipeline schedule of ``SCHEDULES`` that ``jaxpar.pipeline`` defines
  (or those named in ``config['schedules']``), with ``pipeline_value_and_grad`` on the
  mesh ``stage=N``, once per stash policy of ``config['policies']``;
* plain data parallelism on the mesh ``data=N`` (``config['data_parallel']``):
  each rank runs ``m/N`` of the microbatches as ``sequential`` does, then one
  ``pmean`` of the gradients;
* with ``config['stage1']``: ``parallel.trainer`` on a mesh with one
  pipeline stage against ``data_parallel.trainer`` (Adam, the same model
  written as embed / one stage / head, the same ``m`` microbatches).
* with ``N > 1`` ranks and a pipeline: ``one message``, 32 ``ppermute``s of
  one activation ``[mb, D]`` around the ranks in turn and a scalar ``psum``:
  what one collective over gloo costs between pinned ranks. Each pipeline
  row counts its collectives (``messages``: the ticks' ``ppermute``s and row
  sums, the final ``psum``) and prices them at that cost (``comm_ms``).

A barrier (``sync_global_devices``) precedes every timed step, so all ranks
start it together; rank 0's median wall time and process CPU time are
reported. Then the pipelines of ``config['timeline']`` (constructor names)
run under ``jaxpar.pipeline.timeline`` (``timeline_steps``): their rows get
where the time went. Rank 0 checks that every step's loss equals its
baseline's loss (the steps compute the same maths) and writes the rows to
``config['out']`` as JSON.
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import distributed
from jaxpar.pipeline.executor.internal import tick_messages

# (constructor name in jaxpar.pipeline, extra positional args after (p, m));
# those the installed jaxpar lacks are left out.
SCHEDULES = (('gpipe', ()), ('one_f_one_b', ()), ('interleaved_one_f_one_b', (2,)),
             ('zero_bubble_h1', ()), ('zero_bubble_v', ()), ('dualpipe_v', ()),
             ('v_half', ()), ('v_min', ()))
# The ideal speed-up is the total work over simulate(IDEAL_COSTS).makespan:
# unit-free, since all stages of a schedule are equal.
IDEAL_COSTS = {'F': 1.0, 'B': 2.0, 'I': 1.0, 'W': 1.0}
SEQUENTIAL = 'one core, sequential'
DATA_PARALLEL = 'data parallel'
MESSAGE = 'one message'
_MESSAGES = 32   # ppermutes per MESSAGE step
_LOSS_RTOL = 1e-4   # float32 losses of the same maths, summed in other orders
_OUT_WIDTH = 8      # the loss head's output features


def pin_process(*cores: int) -> None:
  """Pins every thread of this process (and those it starts) to ``cores``."""
  for tid in os.listdir('/proc/self/task'):
    try:
      os.sched_setaffinity(int(tid), set(cores))
    except ProcessLookupError:  # the thread ended meanwhile
      pass


def _threads_pinned(core: int) -> bool:
  """Whether every live thread of this process may run on ``core`` only."""
  pinned = True
  for tid in os.listdir('/proc/self/task'):
    try:
      pinned &= os.sched_getaffinity(int(tid)) == {core}
    except ProcessLookupError:
      pass
  return pinned


# ---------------------------------------------------------------- the model


def stage_fn(params, x):
  """Residual layers ``x + tanh(x @ w[k])``, ``params['w']: [L, D, D]``."""
  for k in range(params['w'].shape[0]):
    x = x + jnp.tanh(x @ params['w'][k])
  return x


def gelu_stage_fn(params, x):
  """Residual layers ``x + gelu(x @ w[k])``, ``params['w']: [L, D, D]``."""
  for k in range(params['w'].shape[0]):
    x = x + jax.nn.gelu(x @ params['w'][k])
  return x


# The model's layer kind (``config['variant']``).
VARIANTS = {'tanh': stage_fn, 'gelu': gelu_stage_fn}


def loss_fn(head, y, target):
  """Mean squared error of the ``[D, 8]`` linear head."""
  return jnp.mean((y @ head - target) ** 2)


def model(layers: int, width: int, batch: int, seed: int = 0):
  """Float32 numpy ``(layers [L, D, D], head [D, 8], inputs, targets)``.

  ``inputs: [batch, D]``, ``targets: [batch, 8]``, the same in every process.
  """
  rng = np.random.default_rng(seed)
  normal = lambda shape, scale: (rng.standard_normal(shape) * scale).astype(
      np.float32)
  return (normal((layers, width, width), width**-0.5),
          normal((width, _OUT_WIDTH), width**-0.5),
          normal((batch, width), 1.0), normal((batch, _OUT_WIDTH), 1.0))


def accumulated_grads(layers, head, xs, ts, stage=stage_fn):
  """Mean loss and gradients over microbatches ``xs: [k, mb, D]`` in turn.

  Returns ``(loss, (dlayers, dhead))`` of the mean over the ``k``
  microbatches; only one microbatch's activations are alive at a time.
  ``stage`` is the layer stack (a ``VARIANTS`` value). No step of the bench
  computes the inputs' cotangent (the pipelines run with
  ``input_grads=False``): no layer in front of the stages needs it.
  """
  grad = jax.value_and_grad(
      lambda w, h, x, t: loss_fn(h, stage({'w': w}, x), t), argnums=(0, 1))

  def body(carry, xt):
    loss, dw, dh = carry
    l, (gw, gh) = grad(layers, head, *xt)
    return (loss + l, dw + gw, dh + gh), None

  init = (jnp.zeros_like(xs[0, 0, 0]), jnp.zeros_like(layers),
          jnp.zeros_like(head))
  (loss, dw, dh), _ = jax.lax.scan(body, init, (xs, ts))
  k = xs.shape[0]
  return loss / k, (dw / k, dh / k)


def data_parallel_grads(mesh, stage=stage_fn) -> Callable:
  """``accumulated_grads`` of each rank's ``m/N`` microbatches, a ``pmean``."""

  def local(layers, head, xs, ts):
    # Varying params: the per-rank grads are local, the pmean sums them once.
    layers, head = jax.lax.pcast((layers, head), 'data', to='varying')
    return jax.lax.pmean(accumulated_grads(layers, head, xs, ts, stage),
                         'data')

  return jax.jit(jax.shard_map(
      local, mesh=mesh, in_specs=(P(), P(), P('data'), P('data')),
      out_specs=(P(), (P(), P()))))


# ---------------------------------------------------------------- the steps


class Step(NamedTuple):
  """A step to time: ``fn(*args)``, whose first result is the loss (a
  ``PipelineResult`` or ``(loss, grads)``), on ``ranks`` ranks."""
  fn: Callable
  args: tuple
  ranks: int      # 1: rank 0 alone; the others wait at the next barrier
  stages: int
  ideal: float    # total work / simulated makespan
  policy: str = ''              # the pipeline's stash policy
  baseline: str = SEQUENTIAL    # the step its speed-up is measured against
  messages: int = 0             # collectives over the pipeline axis per step
  timeline: bool = False        # also run it under jaxpar.pipeline.timeline


def _schedules(p: int, m: int, layers: int, names: list | None
               ) -> tuple[list, list[dict]]:
  """``[((schedule, ideal), constructor name)]`` to time, and note rows for
  those that can't run."""
  found, notes = [], []
  for name, extra in SCHEDULES:
    constructor = getattr(jaxpar.pipeline, name, None)
    if constructor is None or (names is not None and name not in names):
      continue
    try:
      schedule = constructor(p, m, *extra)
    except (TypeError, ValueError) as e:  # e.g. m too small for it
      notes.append({'step': name, 'ranks': p, 'm': m, 'note': str(e)})
      continue
    if layers % schedule.num_stages:
      notes.append({'step': schedule.name, 'ranks': p, 'm': m, 'note': (
          f'{layers} layers do not split evenly over '
          f'{schedule.num_stages} stages')})
      continue
    sim = schedule.simulate(IDEAL_COSTS)
    found.append(((schedule, sum(sim.busy) / sim.makespan), name))
  return found, notes


def _stage1_steps(config: dict, stage, w, head, x, t) -> dict[str, Step]:
  """``parallel.trainer`` with one pipeline stage and
  ``data_parallel.trainer``: Adam on ``embed -> layers -> head``."""
  n, m = jax.process_count(), config['num_microbatches']
  embed = np.eye(w.shape[-1], dtype=w.dtype)   # a [D, D] input projection
  embed_fn = lambda e, x: x @ e
  head_loss = lambda h, y, t: loss_fn(h, y, t)

  def dp_loss(params, batch):
    x, t = batch
    return loss_fn(params['head'], stage({'w': params['w']},
                                         embed_fn(params['embed'], x)), t)
  mesh = jaxpar.make_mesh(data=n)
  batch = jax.device_put((x, t), NamedSharding(mesh, P('data')))
  dp = jaxpar.data_parallel.trainer(dp_loss, optax.adam(1e-3), mesh=mesh,
                                       num_microbatches=m)
  par = jaxpar.parallel.trainer(
      embed_fn, stage, head_loss, optax.adam(1e-3),
      schedule=jaxpar.pipeline.one_f_one_b(1, m), mesh=mesh)
  dp_state = dp.init({'embed': embed, 'w': w, 'head': head})
  par_state = par.init(jaxpar.parallel.PipelineParams(
      embed, {'w': w[None]}, head))
  # A train step returns (state, stats): time it from the same state.
  as_loss = lambda step: lambda state, batch: (
      lambda out: (out[1].loss, out[0]))(step(state, batch))
  dp_name = f'data_parallel.trainer (m={m})'
  return {dp_name: Step(as_loss(dp.step), (dp_state, batch), n, 1, float(n),
                        baseline=dp_name),
          f'parallel.trainer, stage=1 (m={m})': Step(
              as_loss(par.step), (par_state, batch), n, 1, float(n),
              baseline=dp_name)}


def _steps(config: dict) -> tuple[dict[str, Step], list[dict]]:
  """The steps by name, in timing order, and note rows."""
  n, m = jax.process_count(), config['num_microbatches']
  mb = config['microbatch']
  stage = VARIANTS[config.get('variant', 'tanh')]
  w, head, x, t = model(config['layers'], config['width'], m * mb)
  split = lambda a: a.reshape((m, mb) + a.shape[1:])
  local = jax.local_devices()[0]
  steps = {SEQUENTIAL: Step(
      jax.jit(functools.partial(accumulated_grads, stage=stage)),
      jax.device_put((w, head, split(x), split(t)), local), 1, 1, 1.0)}

  mesh = jaxpar.make_mesh(stage=n)
  replicated = NamedSharding(mesh, P())
  schedules, notes = _schedules(n, m, config['layers'],
                                config.get('schedules'))
  policies = config.get('policies') or ['dots']
  timed = config.get('timeline') or ()
  for (schedule, ideal), constructor in schedules:
    s = schedule.num_stages
    stages = {'w': w.reshape((s, -1) + w.shape[1:])}
    args = (jax.device_put(stages, NamedSharding(mesh, P('stage'))),
            *jax.device_put((head, x, t), replicated))
    for policy in policies:
      name = schedule.name if len(policies) == 1 else (
          f'{schedule.name} [{policy}]')
      steps[name] = Step(
          jaxpar.pipeline.pipeline_value_and_grad(
              stage, loss_fn, schedule=schedule, mesh=mesh,
              remat_policy=policy, input_grads=False),
          args, n, s, ideal, policy, messages=messages(schedule),
          timeline=n > 1 and constructor in timed and policy == policies[0])

  if config.get('data_parallel', True) and m % n:
    notes.append({'step': DATA_PARALLEL, 'ranks': n, 'm': m, 'note': (
        f'm={m} microbatches do not split evenly over {n} ranks')})
  elif config.get('data_parallel', True):
    mesh = jaxpar.make_mesh(data=n)
    by_rank = NamedSharding(mesh, P('data'))
    steps[DATA_PARALLEL] = Step(
        data_parallel_grads(mesh, stage),
        (*jax.device_put((w, head), NamedSharding(mesh, P())),
         *jax.device_put((split(x), split(t)), by_rank)),
        n, 1, float(n))
  if config.get('stage1'):
    steps.update(_stage1_steps(config, stage, w, head, x, t))
  if n > 1 and schedules:
    steps[MESSAGE] = Step(message_step(jaxpar.make_mesh(stage=n)),
                          (jax.device_put(split(x)[:n], NamedSharding(
                              jaxpar.make_mesh(stage=n), P('stage'))),),
                          n, 1, 1.0, baseline=MESSAGE,
                          messages=_MESSAGES + 1)
  return steps, notes


def messages(schedule) -> int:
  """The collectives over the pipeline axis in one ``pipeline_value_and_grad``
  without input cotangents: the ticks' ``ppermute``s (one per sending
  offset; ``jaxpar.pipeline.executor``'s ``tick_messages``), plus the final
  ``psum``."""
  if schedule.num_ranks == 1:   # no ticks (the executor runs them in turn)
    return 0
  table = jaxpar.pipeline.tick_table(schedule)
  code, patterns = tick_messages(table, False)
  return int(sum(sum(map(bool, patterns[c])) for c in code)) + 1


def message_step(mesh) -> Callable:
  """``_MESSAGES`` ``ppermute``s of one microbatch's activation ``[mb, D]``
  in turn around the ranks (each waits for the one before), and a ``psum``
  of a scalar: the cost of a message between pinned ranks over gloo."""
  n = mesh.shape['stage']
  ring = [(r, (r + 1) % n) for r in range(n)]

  def local(x):
    x, _ = jax.lax.scan(lambda x, _: (jax.lax.ppermute(x, 'stage', ring),
                                      None), x[0], length=_MESSAGES)
    return jax.lax.psum(x[0, 0], 'stage'), x[None]

  return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P('stage'),
                               out_specs=(P(), P('stage'))))


def _barrier() -> None:
  multihost_utils.sync_global_devices('jaxpar real_parallel')


class Timing(NamedTuple):
  """One step's timed rounds on this rank (empty where it did not run)."""
  seconds: tuple[float, ...]      # wall, one per round
  cpu_seconds: tuple[float, ...]  # process CPU time, all threads
  loss: float | None              # the last run's


def time_steps(steps: dict[str, Step], *, repeats: int, warmup: int
               ) -> dict[str, Timing]:
  """Each step's ``Timing`` on this rank: ``repeats`` rounds over the steps
  after ``warmup`` untimed ones.

  Round ``r`` runs the steps starting from the ``r``-th (all ranks in the
  same order), so that no step always runs after the same one. Every rank
  passes the same barriers; a step on one rank runs on rank 0 only.
  """
  me = jax.process_index()
  names = list(steps)
  wall = {name: [] for name in steps}
  cpu = {name: [] for name in steps}
  losses = {}
  for rep in range(warmup + repeats):
    turn = rep % len(names)
    for name in names[turn:] + names[:turn]:
      step = steps[name]
      _barrier()
      if me < step.ranks:
        start, start_cpu = time.perf_counter(), time.process_time()
        loss = jax.block_until_ready(step.fn(*step.args))[0]
        if rep >= warmup:
          wall[name].append(time.perf_counter() - start)
          cpu[name].append(time.process_time() - start_cpu)
        losses[name] = float(loss)
  _barrier()
  return {name: Timing(tuple(wall[name]), tuple(cpu[name]), losses.get(name))
          for name in steps}


def paired(base: tuple[float, ...], times: tuple[float, ...]) -> float:
  """The median over rounds of ``base[r] / times[r]``: one step's speed over
  another's, each pair timed in the same round, seconds apart (load that
  comes and goes over a run falls on both alike).

  Example:
    >>> paired((2.0, 4.0, 2.2), (1.0, 2.0, 1.0))   # the load doubled once
    2.0
  """
  return statistics.median(b / t for b, t in zip(base, times, strict=True))


# The split of a step under a timeline (``jaxpar.pipeline.RankTotals``'
# fields), in ms per step, averaged over the ranks: the row's ``<part>_ms``
# columns.
SPLIT = ('compute', 'messages', 'waiting', 'bubble', 'overhead', 'outside')


def timeline_steps(steps: dict[str, Step], *, repeats: int
                   ) -> dict[str, dict[str, float]]:
  """Where the time of each ``timeline`` step went
  (``jaxpar.pipeline.timeline``, ``repeats`` steps after one warm-up):
  ``<part>_ms`` of ``SPLIT`` and ``timeline_ms`` (the ranks' mean wall time
  under the timeline, host callbacks included: the sum of the parts but
  ``bubble``, which is a part of ``waiting``). Every rank calls it, in the
  same order."""
  out = {}
  for name, step in steps.items():
    if step.timeline:
      totals = jaxpar.pipeline.timeline(step.fn, *step.args,
                                        steps=repeats).totals()
      out[name] = {f'{part}_ms': 1e3 * float(np.mean(
          [getattr(t, part) for t in totals])) for part in (*SPLIT, 'wall')}
      out[name]['timeline_ms'] = out[name].pop('wall_ms')
  return out


def ratios(timing: Timing, base: Timing) -> tuple[float, float]:
  """``(speedup, cpu_ratio)`` of a step against its baseline, each paired by
  round: the baseline's wall time over the step's, the step's CPU time over
  the baseline's.

  Example:
    >>> base, step = Timing((2.0, 4.0), (2.0, 4.0), 1.0), Timing(
    ...     (1.0, 2.0), (3.0, 6.0), 1.0)
    >>> ratios(step, base)
    (2.0, 1.5)
  """
  return (paired(base.seconds, timing.seconds),
          paired(timing.cpu_seconds, base.cpu_seconds))


def rows(config: dict) -> list[dict]:
  """Rank 0's table rows, ``[]`` elsewhere (all ranks call it together)."""
  steps, notes = _steps(config)
  timed = time_steps(steps, repeats=config['repeats'], warmup=config['warmup'])
  split = timeline_steps(steps, repeats=config['repeats'])
  if jax.process_index() != 0:
    return []
  out = []
  for name, (seconds, cpu_seconds, loss) in timed.items():
    step = steps[name]
    base = timed[step.baseline]
    if not np.isclose(loss, base.loss, rtol=_LOSS_RTOL):
      raise RuntimeError(f'real_parallel: {name} computed loss {loss}, '
                         f'{step.baseline} {base.loss}: not the same model.')
    speedup, cpu_ratio = ratios(timed[name], base)
    out.append({'step': name, 'policy': step.policy, 'ranks': step.ranks,
                'stages': step.stages, 'm': config['num_microbatches'],
                'width': config['width'], 'microbatch': config['microbatch'],
                'layers': config['layers'],
                'variant': config.get('variant', 'tanh'),
                'median_ms': 1e3 * statistics.median(seconds),
                'p10_ms': 1e3 * float(np.percentile(seconds, 10)),
                'p90_ms': 1e3 * float(np.percentile(seconds, 90)),
                'cpu_ms': 1e3 * statistics.median(cpu_seconds),
                'speedup': speedup, 'ideal': step.ideal,
                'efficiency': speedup / step.ideal,
                'cpu_ratio': cpu_ratio,
                'vs': step.baseline,
                'cores': ','.join(map(str, config['cores'][:step.ranks])),
                'messages': step.messages, 'pinned': config.get('pinned', True),
                **split.get(name, {})})
  return _relative(out, steps, timed) + notes


def _relative(out: list[dict], steps: dict[str, Step],
              timed: dict[str, Timing]) -> list[dict]:
  """Adds the measures the targets are set on, each round's pair in turn
  (``paired``): a pipeline's efficiency over DP's (``eff_vs_dp``) and its
  speed over 1F1B's with the same stash policy (``vs_1f1b``); and what its
  collectives cost at ``MESSAGE``'s time each (``comm_ms``), where those rows
  exist."""
  by_name = {row['step']: row for row in out}
  dp, message = by_name.get(DATA_PARALLEL), by_name.get(MESSAGE)
  for row in out:
    if not steps[row['step']].policy:   # not a pipeline
      continue
    seconds = timed[row['step']].seconds
    if message is not None:
      row['comm_ms'] = row['messages'] * (message['median_ms'] /
                                          message['messages'])
    if dp is not None:
      row['eff_vs_dp'] = (paired(timed[DATA_PARALLEL].seconds, seconds)
                          * dp['ideal'] / row['ideal'])
    one_f_one_b = next((r for r in out if r['policy'] == row['policy'] and
                        r['step'].split(' [')[0] == '1F1B'), None)
    if one_f_one_b is not None:
      row['vs_1f1b'] = paired(timed[one_f_one_b['step']].seconds, seconds)
  return out


def main(argv: list[str]) -> int:
  config = json.loads(argv[0])
  os.dup2(2, 1)  # keep the bench's stdout (its tables) free of gloo's chatter
  rank = int(os.environ[distributed.ENV_PROCESS_ID])
  core = config['cores'][rank]
  pin = config.get('pinned', True)
  # launch started this rank on its core alone (cores_per_process=1): JAX
  # starts its thread pools there, one compute thread each.
  if config.get('xla_flags'):   # read when the backend starts, below
    os.environ['XLA_FLAGS'] = ' '.join(
        [os.environ.get('XLA_FLAGS', ''), config['xla_flags']]).strip()
  jax.config.update('jax_platforms', 'cpu')  # cores, even on a GPU host
  distributed.initialize()
  if not pin:   # the backend started: the OS may now place its threads
    jax.devices()
    pin_process(*config['cores'])
  result = rows(config)
  pinned = multihost_utils.process_allgather(
      np.array([_threads_pinned(core) or not pin]))
  if not pinned.all():
    raise RuntimeError(
        f'real_parallel: threads of ranks {np.flatnonzero(~pinned).tolist()} '
        'escaped their core.')
  if rank == 0:
    with open(config['out'], 'w') as f:
      json.dump(result, f)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
