"""Pipeline compile time against the layers per stage (``compile_depth``).

Each stage is one ``lax.scan`` over ``K`` residual tanh layers
``x + tanh(x @ w_k)`` of width 32, stacked ``[K, 32, 32]``; ``p = 4`` stages,
``m = 8`` microbatches of 16. For ``K`` in 16, 64, 128 (``--quick``: 16 and
128): the seconds to trace, lower and compile (``jit(...).lower(...)
.compile()``, a fresh function each time, so no trace is reused) of

* ``plain``: ``jax.jit(jax.value_and_grad)`` of the model as written (a
  ``lax.scan`` over the stages of the stage's ``lax.scan``), one device, the
  whole batch;
* ``1F1B`` and ``ZB-H1``: ``pipeline_value_and_grad`` on ``p`` simulated
  devices (the executor's default stash policy, ``'dots'``);

the process CPU seconds of the same (``cpu_s``: all threads; less
sensitive to other processes' load than wall seconds), the compiled HLO's
line count (``compiled.as_text()``) and temp bytes
(``memory_analysis``). ``vs_plain`` is a step's compile seconds over the
plain step's at the same ``K``; ``vs_k16`` over the same step's at ``K = 16``.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxpar.mesh import make_mesh
from jaxpar.pipeline import schedules as sched
from jaxpar.pipeline.executor import pipeline_value_and_grad

P, M, MB, WIDTH = 4, 8, 16, 32


def _stage_fn():
  """A fresh ``stage_fn(params, x)``: ``lax.scan`` over the stacked layers."""
  def stage(params, x):
    layer = lambda h, w: (h + jnp.tanh(h @ w), None)
    return jax.lax.scan(layer, x, params['w'])[0]
  return stage


def _loss(params, y, target):
  return jnp.mean((y @ params['head'] - target) ** 2)


def _model(layers: int):
  """Float32 ``(stage_params [p, K, D, D], loss_params, inputs, targets)``."""
  k = jax.random.split(jax.random.key(0), 4)
  normal = lambda key, shape, scale: (
      jax.random.normal(key, shape, jnp.float32) * scale)
  return ({'w': normal(k[0], (P, layers, WIDTH, WIDTH), 0.3 / WIDTH**0.5)},
          {'head': normal(k[1], (WIDTH, 8), WIDTH**-0.5)},
          normal(k[2], (M * MB, WIDTH), 1.0), normal(k[3], (M * MB, 8), 1.0))


def _plain_step():
  stage = _stage_fn()

  def loss(stages, head, x, t):
    x = jax.lax.scan(lambda h, w: (stage(w, h), None), x, stages)[0]
    return _loss(head, x, t)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def _compile(step, args) -> dict:
  start, cpu = time.perf_counter(), time.process_time()
  compiled = step.lower(*args).compile()
  seconds = time.perf_counter() - start
  return {'compile_s': seconds, 'cpu_s': time.process_time() - cpu,
          'hlo_lines': len(compiled.as_text().splitlines()),
          'temp_bytes': int(compiled.memory_analysis().temp_size_in_bytes)}


def run(*, quick: bool) -> dict[str, list[dict]]:
  mesh = make_mesh(stage=P, devices=jax.devices()[:P])
  steps = {
      'plain': _plain_step,
      '1F1B': lambda: pipeline_value_and_grad(
          _stage_fn(), _loss, schedule=sched.one_f_one_b(P, M), mesh=mesh),
      'ZB-H1': lambda: pipeline_value_and_grad(
          _stage_fn(), _loss, schedule=sched.zero_bubble_h1(P, M), mesh=mesh),
  }
  rows, at_k16 = [], {}
  for layers in (16, 128) if quick else (16, 64, 128):
    args = _model(layers)
    plain = None
    for name, make in steps.items():
      stats = _compile(make(), args)
      plain = plain or stats['compile_s']
      at_k16.setdefault(name, stats['compile_s'])
      rows.append({'step': name, 'K': layers, 'p': P, 'm': M, **stats,
                   'vs_plain': stats['compile_s'] / plain,
                   'vs_k16': stats['compile_s'] / at_k16[name]})
  return {'compile_depth': rows}
