"""One process of the multi-process run in ``tests/test_distributed.py``.

``python -m distributed_worker OUT.json CKPT_DIR`` (under
``jaxpar.distributed.launch``, with ``tests/`` on ``PYTHONPATH``) joins the
run, trains in float64 on a global 8-device mesh (``train_dp``,
``train_gpt``) and process 0 writes the results to ``OUT.json``; the test
compares them with single-process runs.

``python -m distributed_worker drill OUT_DIR CKPT_DIR [kill]`` is the failure
drill (``drill``): 3D GPT training from the latest checkpoint, saved every
``DRILL_EVERY`` steps; with ``kill``, process 1 dies by SIGKILL mid-training.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar

STEPS = 2
DRILL_STEPS, DRILL_EVERY, DRILL_KILL_AT = 5, 2, 3


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


def _record(path: str, value: dict) -> None:
  with open(path, 'a') as f:
    f.write(json.dumps(value) + '\n')
    f.flush()
    os.fsync(f.fileno())


def _recorded_steps(path: str) -> list[int]:
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line).get('step') for line in f if line.strip()]


def drill(out_dir: str, ckpt_dir: str, kill: bool) -> int:
  """Steps ``first..DRILL_STEPS-1`` of the GPT, ``first`` from the checkpoint.

  Process 0 appends ``{"step", "loss"}`` per step to ``OUT_DIR/losses.jsonl``
  (``resumed_from`` first). With ``kill``, process 1 SIGKILLs itself after
  step ``DRILL_KILL_AT`` (once process 0 has recorded its loss), before the
  checkpoint that would follow it; process 0 is then stuck in a collective
  until the launcher stops it.
  """
  from jaxpar.models import gpt  # pylint: disable=g-import-not-at-top
  _, params, _, opt = gpt_setup()
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  trainer = jaxpar.parallel.train_step(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, opt, schedule=schedule,
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, max_grad_norm=1.0)
  state = trainer.init(pp)
  if jaxpar.checkpoint.latest_step(ckpt_dir) is not None:
    state = jaxpar.checkpoint.restore(ckpt_dir, state, schedule=schedule)
  losses = os.path.join(out_dir, 'losses.jsonl')
  main_process = jaxpar.distributed.is_main_process()
  if main_process:
    _record(losses, {'resumed_from': int(state.step)})
  for i in range(int(state.step), DRILL_STEPS):
    rng = np.random.default_rng([2, i])   # batch i, the same in every run
    batch = tuple(rng.integers(0, 16, (8, 4)) for _ in range(2))
    state, stats = trainer.step(state, batch)
    loss = float(stats.loss)
    if main_process:
      _record(losses, {'step': i, 'loss': loss})
    if kill and i == DRILL_KILL_AT and jax.process_index() == 1:
      while i not in _recorded_steps(losses):
        time.sleep(0.01)
      _record(os.path.join(out_dir, 'killed.jsonl'), {'time': time.time()})
      os.kill(os.getpid(), signal.SIGKILL)
    if int(state.step) % DRILL_EVERY == 0:
      jaxpar.checkpoint.save(ckpt_dir, state, schedule=schedule)
  return 0


def main(argv: list[str]) -> int:
  jaxpar.distributed.initialize()
  jax.config.update('jax_enable_x64', True)
  if argv[0] == 'drill':
    return drill(argv[1], argv[2], kill=argv[3:] == ['kill'])
  result = {'process_count': jax.process_count(),
            'local_device_count': jax.local_device_count(),
            'dp': train_dp(), 'gpt': train_gpt(argv[1])}
  if jaxpar.distributed.is_main_process():
    with open(argv[0], 'w') as f:
      json.dump(result, f)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
