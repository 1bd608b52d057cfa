"""Sections ``zero_memory`` and ``zero_communication``: ZeRO stages 0, 1, 3.

The same MLP (``layers`` square ``width x width`` layers with biases) trains
with Adam on all devices as one ``data`` axis (size ``N``) with
``data_parallel.trainer(..., zero_stage=s).step``.

``zero_memory``: bytes the fullest device holds of the params and optimizer
state after a step, read from the arrays' shards, against the totals (ZeRO:
``~1/N``), and the compiled step's ``memory_analysis()`` per
device (arguments = the state and batch going in, output = the new state,
temp = scratch; for ZeRO-3 that includes the gathered params, which XLA:CPU
gathers all at once).

``zero_communication``: every collective of the compiled step (from its
optimized HLO, ``jaxpar.hlo``; whole buffers per device) against ``theory``,
with ``P`` the gradient bytes, ``P_split`` those of the leaves ZeRO splits
(every leaf but zero-size ones; those that no dim divides by ``N`` padded to
a multiple of it, ``dp_internal.padded_shape``) and ``P_whole`` those of the
others: DP
all-reduces ``P`` and the loss; ZeRO-1/3 reduce-scatter ``P_split``,
all-gather ``P_split`` (ZeRO-1: the updated params; ZeRO-3: the params in the
forward pass, and XLA:CPU reuses that gather in the backward pass instead of
gathering again), and all-reduce the loss, ``P_whole`` and one partial
squared norm per split leaf (the global norm's sum over devices); ZeRO-1
gathers the new params of padded leaves with an all-reduce of their logical
bytes ``P_pad`` instead (XLA's choice for an uneven split).
``ring_bytes`` is what a ring moves per device: ``(N-1)/N`` of the buffer,
twice for an all-reduce. The tests (tests/test_data_parallel_zero.py) hold
the compiled step to ``theory`` byte for byte.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

import jaxpar
from jaxpar import data_parallel, hlo
from jaxpar.cli.bench._timing import median_seconds
from jaxpar.data_parallel import internal as dp_internal

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


def _total_bytes(tree) -> int:
  """Logical bytes (``Padded`` leaves without their padding)."""
  return sum(math.prod(x.shape) * x.dtype.itemsize
             for x in jax.tree.leaves(dp_internal.logical_shapes(tree)))


def theory(params, *, mesh: Mesh, zero_stage: int, data_axis: str = 'data'
           ) -> dict[str, tuple[int, str]]:
  """Bytes per collective kind of a ``data_parallel.trainer`` on ``mesh``.

  ``{kind: (bytes, what)}`` for a ``zero_stage`` step on ``params`` with all
  of the mesh as ``data_axis`` (whole buffers per device, as ``jaxpar.hlo``
  counts them, one microbatch); see the module docstring. The loss has the
  params' dtype; the norm's partial sums are at least float32.

  Example:
    >>> import jax.numpy as jnp, jaxpar
    >>> from jaxpar.cli.bench import zero
    >>> mesh = jaxpar.make_mesh(data=8)
    >>> params = {'w': jnp.ones((16, 3)), 'b': jnp.ones(3)}
    >>> zero.theory(params, mesh=mesh, zero_stage=3)['all-reduce']
    (12, 'loss + P_whole + 1 partial norm per split leaf')
  """
  leaves = jax.tree.leaves(params)
  specs = jax.tree.leaves(data_parallel.data_specs(params, mesh=mesh,
                                                   data_axis=data_axis,
                                                   pad=True))
  split = [(x, s) for x, s in zip(leaves, specs)
           if data_parallel.data_dim(s, data_axis) is not None]
  stored = lambda x, s: (math.prod(dp_internal.padded_shape(x.shape, s,
                                                            mesh=mesh))
                         * x.dtype.itemsize)
  padded = [(x, s) for x, s in split if stored(x, s) != x.nbytes]
  total = sum(x.nbytes for x in leaves)
  p_split = sum(stored(x, s) for x, s in split)
  p_whole = total - sum(x.nbytes for x, _ in split)
  loss = np.result_type(*(x.dtype for x in leaves)).itemsize
  if zero_stage == 0:
    return {'all-reduce': (total + loss, 'P + loss')}
  norms = sum(np.promote_types(x.dtype, np.float32).itemsize
              for x, _ in split)
  reduced = 'loss + P_whole + 1 partial norm per split leaf'
  if zero_stage == 3:
    return {'all-reduce': (loss + p_whole + norms, reduced),
            'reduce-scatter': (p_split, 'P_split (grads)'),
            'all-gather': (p_split, 'P_split (params in the forward; the '
                           'backward reuses it)')}
  # ZeRO-1: XLA gathers the new params of a padded leaf with an all-reduce
  # of its logical bytes (P_pad), the others with an all-gather.
  p_pad = sum(x.nbytes for x, _ in padded)
  return {'all-reduce': (loss + p_whole + norms + p_pad,
                         reduced + (' + P_pad (params)' if padded else '')),
          'reduce-scatter': (p_split, 'P_split (grads)'),
          'all-gather': (p_split - sum(stored(x, s) for x, s in padded),
                         'P_split (params)' + (
                             ' - padded leaves' if padded else ''))}


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
  memory, communication = [], []
  for stage in (0, 1, 3):
    step = jaxpar.data_parallel.trainer(_loss, optimizer, mesh=mesh,
                                     zero_stage=stage).step
    state = jaxpar.TrainState.create(params, optimizer)
    if stage:
      state = data_parallel.shard_state(state, mesh=mesh, zero_stage=stage)
    after, _ = step(state, batch)
    compiled = step.lower(after, batch).compile()
    analysis = compiled.memory_analysis()
    held = data_parallel.bytes_per_device(after)
    memory.append({
        'stage': stage, 'devices': n, 'params': sum(sizes),
        'params_MB_total': _total_bytes(after.params) / _MB,
        'params_MB_per_device': held.params / _MB,
        'opt_MB_total': _total_bytes((after.step, after.opt_state)) / _MB,
        'opt_MB_per_device': held.opt_state / _MB,
        'opt_fraction': held.opt_state
                        / _total_bytes((after.step, after.opt_state)),
        'argument_MB': analysis.argument_size_in_bytes / _MB,
        'output_MB': analysis.output_size_in_bytes / _MB,
        'temp_MB': analysis.temp_size_in_bytes / _MB,
        'step_ms': 1e3 * median_seconds(step, after, batch)})
    counts = hlo.collective_counts(compiled)
    moved = hlo.collective_bytes(compiled)
    want_bytes = theory(params, mesh=mesh, zero_stage=stage)
    for kind in hlo.KINDS:
      if not counts[kind] and kind not in want_bytes:
        continue
      want, what = want_bytes.get(kind, (0, '-'))
      ring = (2 if kind == 'all-reduce' else 1) * (n - 1) / n
      communication.append({
          'stage': stage, 'collective': kind, 'ops': counts[kind],
          'hlo_bytes': moved[kind], 'theory_bytes': want, 'theory': what,
          'ring_bytes': int(ring * moved[kind])})
  return {'zero_memory': memory, 'zero_communication': communication}
