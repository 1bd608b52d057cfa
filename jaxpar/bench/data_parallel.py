"""Section ``data_parallel_vs_gspmd``: jaxpar's DP step vs ``jax.jit`` + GSPMD.

Both train the same MLP with SGD on the same batch sharded over ``data``: the
baseline is a plain jitted single-device step whose batch carries a
``NamedSharding`` (XLA's partitioner inserts the gradient all-reduce); jaxpar's
is ``data_parallel_step`` (explicit ``shard_map`` + ``pmean``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.bench._timing import median_seconds


def _mlp_loss(params, batch):
  h = jax.nn.gelu(batch['x'] @ params['w1'])
  return optax.losses.squared_error(h @ params['w2'], batch['y']).mean()


def run(*, quick: bool) -> dict[str, list[dict]]:
  rows = []
  n = jax.device_count()
  width = 256 if quick else 1024
  for per_device in ((64, 256) if quick else (64, 256, 1024)):
    mesh = jaxpar.make_mesh(data=n)
    key1, key2 = jax.random.split(jax.random.key(0))
    params = {'w1': jax.random.normal(key1, (width, 4 * width)) / width**0.5,
              'w2': jax.random.normal(key2, (4 * width, width)) / width**0.5}
    rng = np.random.default_rng(0)
    batch = {'x': rng.normal(size=(n * per_device, width)).astype(np.float32),
             'y': rng.normal(size=(n * per_device, width)).astype(np.float32)}
    optimizer = optax.sgd(1e-3)
    state = jaxpar.TrainState.create(params, optimizer)

    dp_step = jaxpar.data_parallel_step(_mlp_loss, optimizer, mesh=mesh)
    dp_state = jax.device_put(state, NamedSharding(mesh, P()))
    dp_batch = jax.device_put(batch, NamedSharding(mesh, P('data')))
    dp = median_seconds(dp_step, dp_state, dp_batch)

    @jax.jit
    def gspmd_step(state, batch):
      loss, grads = jax.value_and_grad(_mlp_loss)(state.params, batch)
      updates, opt_state = optimizer.update(grads, state.opt_state)
      return state._replace(params=optax.apply_updates(state.params, updates),
                            opt_state=opt_state, step=state.step + 1), loss

    gspmd = median_seconds(gspmd_step, dp_state, dp_batch)
    rows.append({'devices': n, 'width': width, 'batch': n * per_device,
                 'jaxpar_dp_ms': 1e3 * dp, 'gspmd_ms': 1e3 * gspmd,
                 'ratio': dp / gspmd})
  return {'data_parallel_vs_gspmd': rows}
