"""One process of the multi-process drill in ``tests/test_distributed.py``.

``python -m distributed_worker OUT_DIR CKPT_DIR [kill]`` (under
``jaxpar.distributed.launch``, with ``tests/`` on ``PYTHONPATH``) joins the
run and trains the 3D GPT in float64 (data=2 x stage=2 x tensor=2 over all
processes) from the latest checkpoint in ``CKPT_DIR``, saving every
``DRILL_EVERY`` steps and at the end. Process 0 appends ``{"step", "loss"}``
per step to ``OUT_DIR/losses.jsonl`` (``resumed_from`` first).

* With ``kill``, process 1 dies by SIGKILL mid-training (``DRILL_KILL_AT``).
* Without, the run also trains ``data_parallel.trainer`` on ``data=8``
  (``train_dp``), and process 0 writes ``OUT_DIR/result.json``: both runs'
  results (the dense GPT params at the end), whether a sharded leaf
  all-gathers right (``to_host``) and whether the last checkpoint restores
  bit for bit. The test compares them with single-process runs.
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

DP_STEPS = 2
DRILL_STEPS, DRILL_EVERY, DRILL_KILL_AT = 4, 2, 3


def dp_setup():
  """Linear regression: ``(loss_fn, params, batches [16 x 4], optimizer)``."""
  rng = np.random.default_rng(0)  # the same data in every process
  w = rng.normal(size=(4, 2))
  batches = [{'x': x, 'y': np.tanh(x @ w)}
             for x in rng.normal(size=(DP_STEPS, 16, 4))]

  def loss_fn(params, batch):
    return jnp.mean((batch['x'] @ params['w'] + params['b'] - batch['y'])**2)

  params = {'w': jnp.zeros((4, 2)), 'b': jnp.zeros(2)}
  return loss_fn, params, batches, optax.adam(0.1)


def train_dp() -> dict:
  """``DP_STEPS`` steps of ``data_parallel.trainer`` on ``data=8``."""
  loss_fn, params, batches, opt = dp_setup()
  step = jaxpar.data_parallel.trainer(loss_fn, opt, mesh=jaxpar.make_mesh(data=8),
                                   max_grad_norm=1.0).step
  state = jaxpar.TrainState.create(params, opt)
  losses = []
  for batch in batches:
    state, stats = step(state, batch)
    losses.append(float(stats.loss))
  return {'losses': losses,
          'params': jax.tree.map(lambda x: x.tolist(),
                                 jaxpar.distributed.to_host(state.params))}


def gpt_setup():
  """A 2-layer GPT in float64: ``(config, dense params, optimizer)``.

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
  return cfg, params, optax.adam(0.1)


def gpt_batch(step: int):
  """The batch of ``step`` (``ids, targets [8, 4]``), the same in every run."""
  rng = np.random.default_rng([2, step])
  return tuple(rng.integers(0, 16, (8, 4)) for _ in range(2))


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


def _same(a, b) -> bool:
  """Every leaf bit for bit, in one program (``to_host`` would gather them
  one by one)."""
  return bool(jax.jit(lambda a, b: jnp.all(jnp.stack([
      jnp.array_equal(x, y) for x, y in zip(jax.tree.leaves(a),
                                            jax.tree.leaves(b))])))(a, b))


def _gathers_right(state) -> bool:
  """A leaf sharded over both processes' devices: ``to_host`` all-gathers it."""
  kernel = state.params.stages['mlp']['fc_in']['kernel']
  replicated = jax.device_put(kernel, NamedSharding(kernel.sharding.mesh, P()))
  return (not kernel.is_fully_addressable
          and np.array_equal(jaxpar.distributed.to_host(kernel),
                             np.asarray(replicated)))


def drill(out_dir: str, ckpt_dir: str, kill: bool) -> int:
  """Steps ``first..DRILL_STEPS-1`` of the GPT (1F1B), ``first`` from the
  latest checkpoint.

  With ``kill``, process 1 SIGKILLs itself after step ``DRILL_KILL_AT``
  (the last; once process 0 has recorded its loss), before the checkpoint
  that would follow it; process 0 is then stuck in a collective until the
  launcher stops it.
  """
  from jaxpar.models import gpt  # pylint: disable=g-import-not-at-top
  _, params, opt = gpt_setup()
  pp, layout = gpt.split_for_pipeline(params, num_stages=2)
  schedule = jaxpar.pipeline.one_f_one_b(2, 2)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, opt, schedule=schedule,
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, max_grad_norm=1.0,
      tensor_rules=gpt.TENSOR_RULES)
  state = trainer.init(pp)
  if jaxpar.checkpoint.latest_step(ckpt_dir) is not None:
    state = jaxpar.checkpoint.restore(ckpt_dir, state, schedule=schedule)
  losses = os.path.join(out_dir, 'losses.jsonl')
  main_process = jaxpar.distributed.is_main_process()
  if main_process:
    _record(losses, {'resumed_from': int(state.step)})
  for i in range(int(state.step), DRILL_STEPS):
    state, stats = trainer.step(state, gpt_batch(i))
    loss = float(stats.loss)
    if main_process:
      _record(losses, {'step': i, 'loss': loss})
    if kill and i == DRILL_KILL_AT and jax.process_index() == 1:
      while i not in _recorded_steps(losses):
        time.sleep(0.01)
      _record(os.path.join(out_dir, 'killed.jsonl'), {'time': time.time()})
      os.kill(os.getpid(), signal.SIGKILL)
    if int(state.step) % DRILL_EVERY == 0 or int(state.step) == DRILL_STEPS:
      jaxpar.checkpoint.save(ckpt_dir, state, schedule=schedule)
  if kill:
    return 0
  # The dense params replicated by one program (to_host would all-gather
  # the leaves one by one).
  mesh = state.params.stages['mlp']['fc_in']['kernel'].sharding.mesh
  dense = jax.jit(lambda tree: tree, out_shardings=NamedSharding(mesh, P()))(
      gpt.merge_from_pipeline(trainer.params(state), layout))
  result = {
      'process_count': jax.process_count(),
      'local_device_count': jax.local_device_count(),
      'dp': train_dp(),
      'gpt': jax.tree.map(lambda x: np.asarray(x).tolist(), dense),
      'restored_equal': _same(jaxpar.checkpoint.restore(
          ckpt_dir, state, schedule=schedule), state),
      'gathered_equal': _gathers_right(state)}
  if main_process:
    with open(os.path.join(out_dir, 'result.json'), 'w') as f:
      json.dump(result, f)
  return 0


def main(argv: list[str]) -> int:
  jaxpar.distributed.initialize()
  # A compilation cache per process (under the test's): the processes of a
  # launch then do the same work (all compile, or all load) and reach their
  # collectives together (gloo gives up after 30 s).
  cache = os.environ.get('JAX_COMPILATION_CACHE_DIR')
  if cache:
    jax.config.update('jax_compilation_cache_dir',
                      os.path.join(cache, str(jax.process_index())))
  jax.config.update('jax_enable_x64', True)
  return drill(argv[0], argv[1], kill=argv[2:] == ['kill'])


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
