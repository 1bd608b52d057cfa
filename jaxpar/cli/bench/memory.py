"""Sections ``memory_data_parallel``, ``memory_3d``: compiled memory per device.

Every figure is the compiled step's ``memory_analysis()`` on one device, in
MiB: ``argument`` (the state and batch going in), ``temp`` (scratch: the
gradients, the activations the backward keeps, gathered params) and their
sum. Float32, Adam, all devices simulated on the CPU.

``memory_data_parallel``: a residual MLP ``h + relu(h @ w1 + b1) @ w2 + b2``
(width ``d``, FFN ``4 d``) trained by ``data_parallel.trainer`` on all
devices as one ``data`` axis, written two ways: ``scanned`` (the layers'
params stacked ``[L, ...]`` and run by one ``lax.scan``, as MaxText and
``nnx.scan`` models are) and ``unrolled`` (a Python loop over a list of
layers). ``gspmd_fsdp`` is the reference a JAX user would write: ``jax.jit``
of the single-device step with the params and Adam moments split over
``data`` (the stacked weights on their second dim, the first after the layer
dim; unrolled ones as ZeRO-3 splits them) and the batch over ``data``, the
same model and the same optax update; XLA places every collective.

``memory_3d``: ``parallel.trainer`` on jaxpar's GPT (``models.gpt``, the
stage's layers in one ``lax.scan``) at ``stage=1`` (the planner's
data-parallel rows) against ``data_parallel.trainer`` on the same model
(``gpt.gpt_loss``, its layers unrolled), at ZeRO-1 and ZeRO-3, and the 3D
step on ``data x stage=2`` with 1F1B at ZeRO-1 and ZeRO-3.

``memory_remat``: ``data_parallel.trainer`` on the scanned stack with a
pre-norm gelu layer (``normed_scanned_loss``; the larger batch) under each
``remat_policy``, at ZeRO-1 and ZeRO-3: the policy applies per layer, so the
temp memory orders ``'nothing'`` <= ``'dots'`` <= ``'everything'``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.models import gpt

_MIB = 2.0**20


def _layer(h: jax.Array, p: dict) -> jax.Array:
  return h + jax.nn.relu(h @ p['w1'] + p['b1']) @ p['w2'] + p['b2']


def scanned_loss(params: dict, batch: tuple) -> jax.Array:
  """The stacked model: ``params`` leaves ``[L, ...]``, one ``lax.scan``."""
  x, y = batch
  h = jax.lax.scan(lambda h, p: (_layer(h, p), None), x, params)[0]
  return jnp.mean((h - y) ** 2)


def _normed_layer(h: jax.Array, p: dict) -> jax.Array:
  n = (h - h.mean(-1, keepdims=True)) * jax.lax.rsqrt(
      h.var(-1, keepdims=True) + 1e-6)
  return h + jax.nn.gelu(n @ p['w1'] + p['b1']) @ p['w2'] + p['b2']


def normed_scanned_loss(params: dict, batch: tuple) -> jax.Array:
  """``scanned_loss`` with a pre-norm gelu layer ``h + gelu(norm(h) @ w1 +
  b1) @ w2 + b2``: elementwise work for a remat policy to drop."""
  x, y = batch
  h = jax.lax.scan(lambda h, p: (_normed_layer(h, p), None), x, params)[0]
  return jnp.mean((h - y) ** 2)


def unrolled_loss(params: list, batch: tuple) -> jax.Array:
  """The same layers as a list, run by a Python loop."""
  h, y = batch
  for p in params:
    h = _layer(h, p)
  return jnp.mean((h - y) ** 2)


def stacked_params(layers: int, width: int) -> dict:
  """``{'w1': [L, d, 4d], 'b1': [L, 4d], 'w2': [L, 4d, d], 'b2': [L, d]}``."""
  rng = np.random.default_rng(0)
  ffn = 4 * width
  normal = lambda *shape: (rng.standard_normal(shape, np.float32)
                           / shape[-2]**0.5)
  return {'w1': normal(layers, width, ffn), 'b1': np.zeros((layers, ffn),
                                                           np.float32),
          'w2': normal(layers, ffn, width), 'b2': np.zeros((layers, width),
                                                           np.float32)}


def _batch(size: int, width: int) -> tuple:
  rng = np.random.default_rng(1)
  return tuple(rng.standard_normal((size, width), np.float32)
               for _ in range(2))


def _row(compiled) -> dict:
  m = compiled.memory_analysis()
  return {'argument_MiB': m.argument_size_in_bytes / _MIB,
          'temp_MiB': m.temp_size_in_bytes / _MIB,
          'total_MiB': (m.argument_size_in_bytes + m.temp_size_in_bytes)
                       / _MIB}


def _gspmd_specs(params: Any, stacked: bool, mesh) -> Any:
  """FSDP's layout: stacked leaves split on dim 1, others as ZeRO-3's."""
  if stacked:
    return jax.tree.map(lambda _: P(None, 'data'), params)
  return jaxpar.data_parallel.data_specs(params, mesh=mesh)


def gspmd_fsdp(loss_fn: Callable, params: Any, batch: tuple, *,
               stacked: bool):
  """The compiled ``jax.jit`` FSDP step of ``loss_fn`` (Adam) on ``Auto``
  axes: params and moments split over ``data``, batch over ``data``."""
  n = jax.device_count()
  mesh = jax.make_mesh((n,), ('data',), axis_types=(AxisType.Auto,))
  optimizer = optax.adam(1e-3)
  state = jaxpar.TrainState.create(jax.tree.map(jnp.asarray, params),
                                   optimizer)
  specs = jaxpar.data_parallel.state_specs(
      state, zero_stage=3, param_specs=jax.tree.map(lambda _: P(), params),
      zero_specs=_gspmd_specs(params, stacked, mesh))
  state_sh = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                          is_leaf=lambda x: isinstance(x, P))

  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    updates, opt_state = optimizer.update(grads, state.opt_state,
                                          state.params)
    return state._replace(params=optax.apply_updates(state.params, updates),
                          opt_state=opt_state, step=state.step + 1), loss
  batch_sh = NamedSharding(mesh, P('data'))
  return jax.jit(step, in_shardings=(state_sh, batch_sh),
                 out_shardings=(state_sh, None)).lower(state, batch).compile()


def jaxpar_step(loss_fn: Callable, params: Any, batch: tuple, *,
                zero_stage: int, remat_policy: str = 'everything'):
  """The compiled ``data_parallel.trainer`` step (Adam) on all devices."""
  trainer = jaxpar.data_parallel.trainer(
      loss_fn, optax.adam(1e-3), mesh=jaxpar.make_mesh(
          data=jax.device_count()), zero_stage=zero_stage,
      remat_policy=remat_policy)
  return trainer.step.lower(trainer.init(params), batch).compile()


def _data_parallel_rows(model: str, layers: int, width: int,
                        batch_size: int) -> list[dict]:
  stacked = model == 'scanned'
  params = stacked_params(layers, width)
  loss_fn = scanned_loss
  if not stacked:
    params = [jax.tree.map(lambda a: a[i], params) for i in range(layers)]
    loss_fn = unrolled_loss
  batch = _batch(batch_size, width)
  head = {'model': model, 'layers': layers, 'width': width,
          'batch': batch_size}
  rows = [{**head, 'step': 'gspmd_fsdp',
           **_row(gspmd_fsdp(loss_fn, params, batch, stacked=stacked))}]
  for zero_stage in (1, 3):
    rows.append({**head, 'step': f'zero{zero_stage}', **_row(jaxpar_step(
        loss_fn, params, batch, zero_stage=zero_stage))})
  return rows


def gpt_model(layers: int, width: int, seq_len: int, num_stages: int):
  """``(config, split params, LayerSplit)`` of a GPT."""
  config = gpt.GPTConfig(vocab_size=256, seq_len=seq_len, d_model=width,
                         num_heads=4, num_layers=layers)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
  pp, split = gpt.split_for_pipeline(params, num_stages=num_stages)
  return config, pp, split


def _gpt_batch(config: gpt.GPTConfig, sequences: int) -> tuple:
  ids = np.random.default_rng(0).integers(
      0, config.vocab_size, (sequences, config.seq_len + 1), np.int32)
  return ids[:, :-1], ids[:, 1:]


def _remat_rows(layers, width, batch_size) -> list[dict]:
  """``data_parallel.trainer`` on the scanned pre-norm stack under each
  policy."""
  params, batch = stacked_params(layers, width), _batch(batch_size, width)
  head = {'model': 'scanned, pre-norm gelu', 'layers': layers,
          'width': width, 'batch': batch_size}
  return [{**head, 'zero_stage': zero_stage, 'remat': remat,
           **_row(jaxpar_step(normed_scanned_loss, params, batch,
                              zero_stage=zero_stage, remat_policy=remat))}
          for zero_stage in (1, 3)
          for remat in ('everything', 'dots', 'nothing')]


def parallel_step(pp, split, batch, *, mesh_sizes: dict, schedule,
                  zero_stage: int, remat_policy: str):
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
      schedule=schedule, mesh=jaxpar.make_mesh(**mesh_sizes),
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES,
      zero_stage=zero_stage, remat_policy=remat_policy)
  return trainer.step.lower(trainer.init(pp), batch).compile()


def _stage1_rows(layers, width, seq_len, sequences) -> list[dict]:
  n = jax.device_count()
  config, pp, split = gpt_model(layers, width, seq_len, 1)
  dense = gpt.merge_from_pipeline(pp, split)
  batch = _gpt_batch(config, sequences)
  head = {'layers': layers, 'width': width, 'seq_len': seq_len,
          'sequences': sequences, 'mesh': f'data={n}'}
  rows = []
  for zero_stage in (1, 3):
    rows.append({**head, 'trainer': 'data_parallel', 'remat': 'everything',
                 'zero_stage': zero_stage, **_row(jaxpar_step(
                     functools.partial(gpt.gpt_loss, config=config), dense,
                     batch, zero_stage=zero_stage))})
    for remat in ('dots', 'nothing'):
      rows.append({**head, 'trainer': 'parallel 1F1B(1, 1)', 'remat': remat,
                   'zero_stage': zero_stage, **_row(parallel_step(
                       pp, split, batch, mesh_sizes=dict(data=n),
                       schedule=jaxpar.pipeline.one_f_one_b(1, 1),
                       zero_stage=zero_stage, remat_policy=remat))})
  return rows


def _pipeline_rows(layers, width, seq_len, microbatches) -> list[dict]:
  data = jax.device_count() // 2
  config, pp, split = gpt_model(layers, width, seq_len, 2)
  batch = _gpt_batch(config, data * microbatches)
  head = {'layers': layers, 'width': width, 'seq_len': seq_len,
          'sequences': data * microbatches, 'mesh': f'data={data} stage=2',
          'trainer': f'parallel 1F1B(2, {microbatches})', 'remat': 'dots'}
  return [{**head, 'zero_stage': zero_stage, **_row(parallel_step(
      pp, split, batch, mesh_sizes=dict(data=data, stage=2),
      schedule=jaxpar.pipeline.one_f_one_b(2, microbatches),
      zero_stage=zero_stage, remat_policy='dots'))}
          for zero_stage in (1, 3)]


def run(*, quick: bool) -> dict[str, list[dict]]:
  n = jax.device_count()
  if quick:
    dp = [('scanned', 16, 128, 2 * n), ('scanned', 16, 128, 32 * n),
          ('unrolled', 8, 128, 2 * n)]
    gpt_sizes = dict(layers=4, width=128, seq_len=64)
  else:
    dp = [('scanned', 64, 256, 2 * n), ('scanned', 64, 256, 256 * n),
          ('unrolled', 32, 256, 2 * n)]
    gpt_sizes = dict(layers=8, width=256, seq_len=128)
  data_parallel = [row for args in dp for row in _data_parallel_rows(*args)]
  three_d = _stage1_rows(**gpt_sizes, sequences=2 * n)
  three_d += _pipeline_rows(**dict(gpt_sizes, layers=2 * gpt_sizes['layers']),
                            microbatches=8)
  return {'memory_data_parallel': data_parallel, 'memory_3d': three_d,
          'memory_remat': _remat_rows(*dp[1][1:])}
