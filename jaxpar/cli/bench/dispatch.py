"""Tick dispatch: what a tick's data-dependent control flow costs here.

Section ``tick_dispatch``: a jitted ``lax.scan`` of ``ticks`` ticks on the
backend's first device. Each tick has ``blocks`` blocks ``x = tanh(x @ w_k)``
(``x``: ``[rows, width]``, ``w_k``: ``[width, width]``); on every tick the
even-numbered half of them run, as read from a scanned ``[ticks, blocks]``
table of booleans (the executor reads its tick table so). The blocks are
gated:

* ``while``: a ``while_loop`` of zero or one trip per block, as the
  executor's ``when`` writes it (``pipeline/executor/_tick_scan.py``);
* ``cond``: ``lax.cond`` per block;
* ``select``: every block runs and ``jnp.where`` keeps the gated results
  (no data-dependent control flow; twice the work);
* ``static``: the even-numbered blocks, chosen at trace time (the work and
  the values of ``while`` and ``cond`` without their gates): the reference.

``max_diff``: the largest difference from ``static``'s result (the gates
change the control flow, not the values).
``us_per_tick`` is the median step time over ``ticks``; ``us_per_gate`` is
``(step - static's step) / (ticks x blocks)``: what one gate adds. On XLA:GPU
each ``while`` and ``conditional`` reads its predicate back to the host
(``docs/executor.md``, "Cost on GPU") unless XLA records it in a command
buffer (``XLA_FLAGS=--xla_gpu_enable_command_buffer=...``, read when the
process starts); ``hlo_while`` / ``hlo_conditional`` count them in the
compiled program (``known_trip_count`` loops excluded: the scan itself).

Section ``one_device_step``: jaxpar's step on one device against the step a
user writes first: ``jax.jit`` of ``value_and_grad(gpt_loss)`` and an Adam
update, on the plan CLI's GPT (8 layers, ``d_model`` 256, 64 sequences of
64 tokens; ``--quick``: 2 layers, 64, 16 of 16), against the trainer
``jaxpar.plan`` builds for one device at ``m`` = 1 and 16 (``'dots'``).
``alone_ms``: the fastest of a few steps each timed to completion;
``back_to_back_ms``: the mean of steps dispatched in a row (a training
loop's); ``fusions`` in the compiled program.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxpar
from jaxpar.models import gpt

from jaxpar.cli.bench._timing import median_seconds
from jaxpar.hlo import control_flow

GATES = ('static', 'while', 'cond', 'select')


def _block(w: jax.Array, x: jax.Array) -> jax.Array:
  return jnp.tanh(x @ w)


def _gated(gate: str, on: jax.Array, ws: jax.Array, x: jax.Array,
           static_on: tuple[bool, ...]) -> jax.Array:
  """One tick: block ``k`` runs where ``on[k]`` (``static_on[k]`` for
  ``'static'``)."""
  for k in range(ws.shape[0]):
    if gate == 'static':
      x = _block(ws[k], x) if static_on[k] else x
    elif gate == 'while':   # the executor's `when`, as _tick_scan writes it
      x = jax.lax.while_loop(lambda c: c[0], lambda c, k=k: (
          c[0] & False, _block(ws[k], c[1])), (on[k], x))[1]
    elif gate == 'cond':
      x = jax.lax.cond(on[k], lambda y, k=k: _block(ws[k], y), lambda y: y, x)
    else:
      x = jnp.where(on[k], _block(ws[k], x), x)
  return x


def _step(gate: str, blocks: int):
  """``(ws, x, table) -> x`` after one scan over the table's ticks."""
  static_on = tuple(k % 2 == 0 for k in range(blocks))

  def step(ws, x, table):
    tick = lambda x, on: (_gated(gate, on, ws, x, static_on), None)
    return jax.lax.scan(tick, x, table)[0]
  return jax.jit(step)


def _row(gate: str, ticks: int, blocks: int, rows: int, width: int,
         repeats: int) -> dict:
  rng = np.random.default_rng(0)
  ws = jnp.asarray(rng.normal(size=(blocks, width, width)) / width ** 0.5,
                   jnp.float32)
  x = jnp.asarray(rng.normal(size=(rows, width)), jnp.float32)
  table = jnp.asarray(np.tile(np.arange(blocks) % 2 == 0, (ticks, 1)))
  step = _step(gate, blocks)
  counts = control_flow(step.lower(ws, x, table).compile())
  seconds = median_seconds(step, ws, x, table, repeats=repeats, warmup=2)
  reference = _step('static', blocks)(ws, x, table)
  return {'backend': jax.default_backend(), 'gate': gate, 'ticks': ticks,
          'blocks': blocks, 'rows': rows, 'width': width,
          'hlo_while': counts['while'],
          'hlo_conditional': counts['conditional'],
          'max_diff': float(jnp.max(jnp.abs(step(ws, x, table) - reference))),
          'step_ms': 1e3 * seconds, 'us_per_tick': 1e6 * seconds / ticks}


def run(*, quick: bool) -> dict[str, list[dict]]:
  """The ``tick_dispatch`` and ``one_device_step`` sections (module doc)."""
  ticks, blocks = (64, 4) if quick else (256, 4)
  sizes = ((8, 64), (128, 512)) if quick else ((8, 64), (256, 1024))
  rows = []
  for n, width in sizes:
    found = [_row(gate, ticks, blocks, n, width, 5 if quick else 11)
             for gate in GATES]
    static = found[0]['step_ms']
    for row in found:
      row['us_per_gate'] = 1e3 * (row['step_ms'] - static) / (ticks * blocks)
    rows += found
  return {'tick_dispatch': rows, 'one_device_step': _one_device_steps(quick)}


def _timed(step: Callable, state: Any, batch: Any, repeats: int
           ) -> tuple[float, float]:
  """(fastest step timed alone, mean step of ``4 * repeats`` back to back)."""
  state, _ = jax.block_until_ready(step(state, batch))
  alone = []
  for _ in range(repeats):
    start = time.perf_counter()
    state, _ = jax.block_until_ready(step(state, batch))
    alone.append(time.perf_counter() - start)
  start = time.perf_counter()
  for _ in range(4 * repeats):
    state, _ = step(state, batch)
  jax.block_until_ready(state)
  return min(alone), (time.perf_counter() - start) / (4 * repeats)


def _one_device_steps(quick: bool) -> list[dict]:
  """The ``one_device_step`` section: the trainer ``jaxpar.plan`` builds for
  one device against a plain jitted ``value_and_grad`` and Adam update."""
  config = gpt.GPTConfig(vocab_size=256, seq_len=16 if quick else 64,
                         d_model=64 if quick else 256, num_heads=8,
                         num_layers=2 if quick else 8)
  ids = np.random.default_rng(0).integers(
      0, 256, (16 if quick else 64, config.seq_len + 1)).astype(np.int32)
  device = jax.devices()[0]
  batch = jax.device_put((ids[:, :-1], ids[:, 1:]), device)
  optimizer = optax.adam(1e-3)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))

  @jax.jit
  def plain(state, batch):
    loss, grads = jax.value_and_grad(gpt.gpt_loss)(state[0], batch,
                                                   config=config)
    updates, opt_state = optimizer.update(grads, state[1], state[0])
    return (optax.apply_updates(state[0], updates), opt_state), loss

  steps = {('plain jit', 1): (plain, jax.device_put(
      (params, optimizer.init(params)), device))}
  plan = jaxpar.plan(config, optimizer, batch=batch, devices=[device],
                     compile=0, profile='H100-SXM')
  for c in plan.candidates:
    m = c.layout.num_microbatches
    if c.layout.remat_policy == 'dots' and m in (1, 16) and (
        'trainer', m) not in steps:
      trainer = plan.trainer(optimizer, c)
      steps['trainer', m] = (trainer.step, trainer.init(plan.params(c)))
  rows = []
  for (name, m), (step, state) in steps.items():
    text = step.lower(state, batch).compile().as_text()
    alone, back = _timed(step, state, batch, 3 if quick else 5)
    rows.append({'backend': jax.default_backend(), 'step': name, 'm': m,
                 'layers': config.num_layers, 'd_model': config.d_model,
                 'tokens': ids[:, 1:].size,
                 'fusions': len(re.findall(r'= [^\n]*\bfusion\(', text)),
                 'alone_ms': 1e3 * alone, 'back_to_back_ms': 1e3 * back})
  for row in rows:
    row['alone_vs_plain'] = row['alone_ms'] / rows[0]['alone_ms']
  return rows
