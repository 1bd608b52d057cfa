"""Sections ``data_parallel_vs_gspmd`` and ``parallel_vs_data_parallel``.

``data_parallel_vs_gspmd``: jaxpar's DP step (``zero_stage`` 0, 1, 3) against
what XLA does by itself. Both train the same MLP with Adam on the same batch
sharded over ``data``; the baseline is a plain jitted single-device step whose
inputs carry ``NamedSharding``s on an ``Auto`` mesh -- the batch over
``data``, and for ZeRO the optimizer state (1) and the params (3) in the ZeRO
layout -- so XLA's partitioner inserts every collective itself. jaxpar's step
also computes ``StepStats`` (global norm, non-finite skip); the baseline only
the loss.

``parallel_vs_data_parallel``: ``parallel.trainer`` on a mesh with only
``data > 1`` (stage = tensor = 1, 1F1B with one stage and one microbatch)
against ``data_parallel.trainer`` for the same model written as embed /
one stage / head, same optimizer and ZeRO stage.

Steps take turns within each repetition (``_timing.wall_and_cpu_seconds``),
so load from other processes hits them alike; ``ratio`` is jaxpar's wall
time over the baseline's, ``cpu_ratio`` the same for process CPU time (all
threads: the work, less sensitive to a loaded machine than wall time),
``*_collectives`` count the compiled programs'
collectives (``AR`` all-reduce, ``AG`` all-gather, ``RS`` reduce-scatter).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import hlo
from jaxpar.cli.bench._timing import wall_and_cpu_seconds
from jaxpar.data_parallel.internal import ZERO_STAGES
from jaxpar.train_state.internal import auto_view

_SHORT = {'all-reduce': 'AR', 'all-gather': 'AG', 'reduce-scatter': 'RS',
          'collective-permute': 'CP', 'all-to-all': 'A2A'}


def _embed(w, x):
  return x @ w


def _stage(p, h):
  return h + jax.nn.gelu(h @ p['w1']) @ p['w2']


def _head(w, h, y):
  return optax.losses.squared_error(h @ w, y).mean()


def _loss(params, batch):
  """The model of both sections: embed, one residual MLP block, head."""
  x, y = batch
  return _head(params['head'], _stage(params['block'],
                                      _embed(params['embed'], x)), y)


def _params(width: int) -> dict:
  k = jax.random.split(jax.random.key(0), 4)
  init = lambda key, shape: jax.random.normal(key, shape) / shape[0]**0.5
  return {'embed': init(k[0], (width, width)),
          'block': {'w1': init(k[1], (width, 4 * width)),
                    'w2': init(k[2], (4 * width, width))},
          'head': init(k[3], (width, width))}


def _collectives(compiled) -> str:
  counts = hlo.collective_counts(compiled)
  return ' '.join(f'{c}{_SHORT[k]}' for k, c in counts.items() if c) or '-'


def _gspmd_step(optimizer, state_shardings, batch_sharding):
  """Plain ``jit`` of the single-device step; XLA partitions everything."""
  def step(state, batch):
    loss, grads = jax.value_and_grad(_loss)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state._replace(params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state, step=state.step + 1), loss
  return jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                 out_shardings=(state_shardings, None))


def _batch(n: int, per_device: int, width: int) -> tuple:
  rng = np.random.default_rng(0)
  return tuple(rng.normal(size=(n * per_device, width)).astype(np.float32)
               for _ in range(2))


def _vs_gspmd(width, per_device, zero_stage, repeats) -> dict:
  n = jax.device_count()
  mesh = jaxpar.make_mesh(data=n)
  auto = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
  optimizer = optax.adam(1e-3)
  trainer = jaxpar.data_parallel.trainer(_loss, optimizer, mesh=mesh,
                                            zero_stage=zero_stage)
  state = trainer.init(_params(width))
  batch = jax.device_put(_batch(n, per_device, width),
                         NamedSharding(mesh, P('data')))
  # The same shards on the Auto mesh: GSPMD decides every collective.
  auto_state = auto_view(state)
  state_sh = jax.tree.map(lambda x: x.sharding, auto_state)
  batch_sh = NamedSharding(auto, P('data'))
  auto_batch = jax.device_put(batch, batch_sh)
  gspmd = _gspmd_step(optimizer, state_sh, batch_sh)
  return {'zero_stage': zero_stage, 'devices': n, 'width': width,
          'batch': n * per_device,
          **_compare(('jaxpar', trainer.step, (state, batch)),
                     ('gspmd', gspmd, (auto_state, auto_batch)), repeats)}


def _compare(first, second, repeats) -> dict:
  """Columns of two steps ``(name, jitted step, args)`` timed interleaved:
  ``<name>_ms`` (wall medians), ``ratio`` and ``cpu_ratio`` (first over
  second) and ``<name>_collectives`` of each compiled program."""
  times = wall_and_cpu_seconds(
      {name: lambda step=step, args=args: step(*args)
       for name, step, args in (first, second)}, (), repeats)
  (a, *_), (b, *_) = first, second
  return {f'{a}_ms': 1e3 * times[a][0], f'{b}_ms': 1e3 * times[b][0],
          'ratio': times[a][0] / times[b][0],
          'cpu_ratio': times[a][1] / times[b][1],
          **{f'{name}_collectives': _collectives(step.lower(*args).compile())
             for name, step, args in (first, second)}}


def _parallel_vs_dp(width, per_device, zero_stage, schedule, repeats) -> dict:
  n = jax.device_count()
  mesh = jaxpar.make_mesh(data=n)
  optimizer = optax.adam(1e-3)
  params = _params(width)
  dp = jaxpar.data_parallel.trainer(_loss, optimizer, mesh=mesh,
                                       zero_stage=zero_stage)
  par = jaxpar.parallel.trainer(
      _embed, _stage, _head, optimizer, schedule=schedule, mesh=mesh,
      zero_stage=zero_stage)
  dp_state = dp.init(params)
  par_state = par.init(jaxpar.parallel.PipelineParams(
      params['embed'], jax.tree.map(lambda x: x[None], params['block']),
      params['head']))
  batch = jax.device_put(_batch(n, per_device, width),
                         NamedSharding(mesh, P('data')))
  return {'zero_stage': zero_stage, 'schedule': schedule.name, 'devices': n,
          'width': width, 'batch': n * per_device,
          **_compare(('parallel', par.step, (par_state, batch)),
                     ('data_parallel', dp.step, (dp_state, batch)), repeats)}


def run(*, quick: bool) -> dict[str, list[dict]]:
  width = 256 if quick else 1024
  sizes = (64, 256) if quick else (64, 256, 1024)
  repeats = 9 if quick else 7
  gspmd = [_vs_gspmd(width, per_device, zero_stage, repeats)
           for per_device in sizes for zero_stage in ZERO_STAGES]
  # GPipe(1, 1) lowers to the same two ticks (F, B) as 1F1B(1, 1).
  schedule = jaxpar.pipeline.one_f_one_b(1, 1)
  parallel = [_parallel_vs_dp(width, per_device, zero_stage, schedule, repeats)
              for per_device in sizes for zero_stage in ZERO_STAGES]
  return {'data_parallel_vs_gspmd': gspmd,
          'parallel_vs_data_parallel': parallel}
