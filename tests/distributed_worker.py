"""One process of the multi-process run in ``tests/test_distributed.py``.

``python -m distributed_worker OUT.json CKPT_DIR`` (under
``jaxpar.distributed.launch``, with ``tests/`` on ``PYTHONPATH``) joins the
run, trains in float64 on a global 8-device mesh (``train_dp``,
``train_gpt``) and process 0 writes the results to ``OUT.json``; the test
compares them with single-process runs.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar

STEPS = 2


def dp_setup():
  """Linear regression: ``(loss_fn, params, batches [16 x 4], optimizer)``."""
  rng = np.random.default_rng(0)  # the same data in every process
  w = rng.normal(size=(4, 2))
  batches = [{'x': x, 'y': np.tanh(x @ w)}
             for x in rng.normal(size=(STEPS, 16, 4))]

  def loss_fn(params, batch):
    return jnp.mean((batch['x'] @ params['w'] + params['b'] - batch['y'])**2)

  params = {'w': jnp.zeros((4, 2)), 'b': jnp.zeros(2)}
  return loss_fn, params, batches, optax.adam(0.1)


def train_dp() -> dict:
  """``STEPS`` steps of ``data_parallel_step`` on ``data=8``."""
  loss_fn, params, batches, opt = dp_setup()
  step = jaxpar.data_parallel_step(loss_fn, opt, mesh=jaxpar.make_mesh(data=8),
                                   max_grad_norm=1.0)
  state = jaxpar.TrainState.create(params, opt)
  losses = []
  for batch in batches:
    state, stats = step(state, batch)
    losses.append(float(stats.loss))
  return {'losses': losses,
          'params': jax.tree.map(lambda x: x.tolist(),
                                 jaxpar.distributed.to_host(state.params))}


def gpt_setup():
  """A 2-layer GPT in float64: ``(config, dense params, batches, optimizer)``.

  Random params of ``gpt_params``' structure (``eval_shape``: building the
  model eagerly would compile dozens of tiny programs).
  """
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from jaxpar.models import gpt  # pylint: disable=g-import-not-at-top
  cfg = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=2,
                      num_layers=2)
  shapes = jax.eval_shape(
      lambda: gpt.gpt_params(gpt.GPT(cfg, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(1)
  params = jax.tree.map(lambda s: rng.normal(scale=0.3, size=s.shape), shapes)
  batches = [tuple(rng.integers(0, 16, (8, 4)) for _ in range(2))
             for _ in range(STEPS)]
  return cfg, params, batches, optax.adam(0.1)


def train_gpt(ckpt_dir: str) -> dict:
  """``STEPS`` 3D steps (data=2, stage=2, tensor=2, 1F1B), then a checkpoint
  round trip from all processes."""
  from jaxpar.models import gpt  # pylint: disable=g-import-not-at-top
  _, params, batches, opt = gpt_setup()
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, opt, schedule=schedule,
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, max_grad_norm=1.0)
  state = trainer.init(pp)
  losses = []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    losses.append(float(stats.loss))
  jaxpar.checkpoint.save(ckpt_dir, state, schedule=schedule)
  restored = jaxpar.checkpoint.restore(ckpt_dir, state, schedule=schedule)
  # One program compares all leaves (to_host would gather them one by one).
  same = jax.jit(lambda a, b: jnp.all(jnp.stack([
      jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                            jax.tree.leaves(b))])))(
                                                restored, state)
  # A leaf sharded over both processes' devices: to_host all-gathers it.
  kernel = state.params.stages['mlp']['fc_in']['kernel']
  replicated = jax.device_put(kernel, NamedSharding(kernel.sharding.mesh, P()))
  gathered = jaxpar.distributed.to_host(kernel)
  dense = gpt.merge_from_pipeline(trainer.params(state), layout)
  return {'losses': losses,
          'params': jax.tree.map(lambda x: x.tolist(),
                                 jaxpar.distributed.to_host(dense)),
          'restored_equal': bool(same),
          'gathered_equal': (not kernel.is_fully_addressable
                             and np.array_equal(gathered,
                                                np.asarray(replicated)))}


def main(argv: list[str]) -> int:
  jaxpar.distributed.initialize()
  jax.config.update('jax_enable_x64', True)
  result = {'process_count': jax.process_count(),
            'local_device_count': jax.local_device_count(),
            'dp': train_dp(), 'gpt': train_gpt(argv[1])}
  if jaxpar.distributed.is_main_process():
    with open(argv[0], 'w') as f:
      json.dump(result, f)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
