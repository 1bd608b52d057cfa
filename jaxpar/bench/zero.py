"""Sections ``zero_memory`` and ``zero_communication``: ZeRO stages 0, 1, 3.

The same MLP (``layers`` square ``width x width`` layers with biases) trains
with Adam on all devices as one ``data`` axis (size ``N``) with
``data_parallel_step(..., zero_stage=s)``.

``zero_memory``: bytes one device holds of the params and of the optimizer
state after a step, read from the arrays' shards, against the totals (ZeRO:
``~1/N``, padding aside), and the compiled step's ``memory_analysis()`` per
device (arguments = the state and batch going in, output = the new state,
temp = scratch; for ZeRO-3 that includes the gathered params, which XLA:CPU
gathers all at once).

``zero_communication``: every collective of the compiled step (from its
optimized HLO, ``jaxpar.hlo``; whole buffers per device) against the theory,
with ``P`` the float32 gradient bytes and ``P_pad`` those of the leaves
ZeRO splits (a dim divisible by ``N``; here all): DP all-reduces ``P`` (and the loss); ZeRO-1
reduce-scatters ``P_pad`` and all-gathers ``P_pad``; ZeRO-3 all-gathers
``P_pad`` in the forward pass, again in the backward pass, and
reduce-scatters ``P_pad``; ZeRO's all-reduces carry two scalars (loss and
squared gradient norm). ``ring_bytes`` is what a ring moves per device:
``(N-1)/N`` of the buffer, twice for an all-reduce.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxpar
from jaxpar import hlo, zero
from jaxpar.bench._timing import median_seconds

_MB = 2.0**20


def _loss(params, batch):
  h = batch['x']
  for layer in params:
    h = jnp.tanh(h @ layer['w'] + layer['b'])
  return optax.losses.squared_error(h, batch['y']).mean()


def _params(width: int, layers: int) -> list:
  keys = jax.random.split(jax.random.key(0), layers)
  return [{'w': jax.random.normal(k, (width, width)) / width**0.5,
           'b': jnp.zeros(width)} for k in keys]


def _device_bytes(tree) -> int:
  return sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))


def _total_bytes(tree) -> int:
  return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _theory(stage: int, grads: int, padded: int) -> dict[str, tuple[int, str]]:
  if stage == 0:
    return {'all-reduce': (grads + 4, 'P + loss')}
  gathers = (2 * padded, 'P_pad fwd + P_pad bwd (XLA:CPU reuses fwd)'
             ) if stage == 3 else (padded, 'P_pad (params)')
  return {'all-reduce': (8, 'loss, squared grad norm'),
          'reduce-scatter': (padded, 'P_pad (grads)'), 'all-gather': gathers}


def run(*, quick: bool) -> dict[str, list[dict]]:
  n = jax.device_count()
  width, layers, per_device = (256, 3, 16) if quick else (1024, 4, 64)
  mesh = jaxpar.make_mesh(data=n)
  optimizer = optax.adam(1e-3)
  params = _params(width, layers)
  rng = np.random.default_rng(0)
  batch = {'x': rng.normal(size=(n * per_device, width)).astype(np.float32),
           'y': rng.normal(size=(n * per_device, width)).astype(np.float32)}
  sizes = [x.size for x in jax.tree.leaves(params)]
  grads = 4 * sum(sizes)
  # Leaves ZeRO splits: those with a dim divisible by N (all of them here).
  padded = 4 * sum(s for x, s in zip(jax.tree.leaves(params), sizes)
                   if any(d % n == 0 for d in x.shape))
  memory, communication = [], []
  for stage in (0, 1, 3):
    step = jaxpar.data_parallel_step(_loss, optimizer, mesh=mesh,
                                     zero_stage=stage)
    state = jaxpar.TrainState.create(params, optimizer)
    if stage:
      state = zero.shard_state(state, mesh=mesh, zero_stage=stage)
    after, _ = step(state, batch)
    compiled = step.lower(after, batch).compile()
    analysis = compiled.memory_analysis()
    memory.append({
        'stage': stage, 'devices': n, 'params': sum(sizes),
        'params_MB_total': _total_bytes(after.params) / _MB,
        'params_MB_per_device': _device_bytes(after.params) / _MB,
        'opt_MB_total': _total_bytes(after.opt_state) / _MB,
        'opt_MB_per_device': _device_bytes(after.opt_state) / _MB,
        'opt_fraction': _device_bytes(after.opt_state)
                        / _total_bytes(after.opt_state),
        'argument_MB': analysis.argument_size_in_bytes / _MB,
        'output_MB': analysis.output_size_in_bytes / _MB,
        'temp_MB': analysis.temp_size_in_bytes / _MB,
        'step_ms': 1e3 * median_seconds(step, after, batch)})
    counts = hlo.collective_counts(compiled)
    moved = hlo.collective_bytes(compiled)
    theory = _theory(stage, grads, padded)
    for kind in hlo.KINDS:
      if not counts[kind] and kind not in theory:
        continue
      want, what = theory.get(kind, (0, '-'))
      ring = (2 if kind == 'all-reduce' else 1) * (n - 1) / n
      communication.append({
          'stage': stage, 'collective': kind, 'ops': counts[kind],
          'hlo_bytes': moved[kind], 'theory_bytes': want, 'theory': what,
          'ring_bytes': int(ring * moved[kind])})
  return {'zero_memory': memory, 'zero_communication': communication}
