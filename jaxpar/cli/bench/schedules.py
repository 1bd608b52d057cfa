"""Pipeline schedules: bubbles, the memory-time frontier, V memory compiled.

Sections:

* ``bubble``: for each schedule and a few ``(p, m)``, the event-driven
  simulation with the default costs ``F = 1, B = 2, I = W = 1`` (per action)
  next to its closed form (all exact here: GPipe/1F1B ``(p-1)/(m+p-1)``,
  interleaved ``(p-1)/(v m+p-1)``, ZB-H1 ``(p-1)/(3m+p-1)`` for ``m >= p``,
  ZB-V and DualPipeV ``(p-1)/(6m+p-1)`` for ``m >= 2p``), the peak stashes,
  and the time the ``O(actions)`` simulation takes.
* ``frontier``: ``search`` against every constructor at a sweep of memory
  limits (in 1F1B-stage activations): the executor's lock-step time of each
  (``jaxpar.pipeline.makespan``, costs per 1F1B stage, V schedules paying
  half per action), ``None`` where it does not fit.
* ``v_memory``: compiled ``temp_size_in_bytes`` of the pipelined step
  (``pipeline_value_and_grad_local``, params in rank order) for 1F1B, ZB-V,
  V-Half and V-Min on the same ``2p``-layer model (1F1B runs two layers a
  stage, the V schedules one), the split schedules also with
  ``w_recompute`` (``W`` keeps nothing from ``I``): V-Min <= V-Half <=
  0.9x 1F1B with it; ``temp_vs_1f1b`` the ratio, ``step_ms`` the step time.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.cli.bench._timing import median_seconds, wall_and_cpu_seconds
from jaxpar.mesh import make_mesh
from jaxpar.pipeline import schedules as sched
from jaxpar.pipeline.executor import (pipeline_value_and_grad_local,
                                     stages_to_ranks)
from jaxpar.pipeline.schedules import makespan, peak_memory, search, tick_table

V = 2  # interleaved chunks per rank
UNEQUAL = {'F': 1.0, 'I': 1.5, 'W': 0.5, 'B': 2.0}  # I > W


def _cases(p: int, m: int):
  """``(schedule, closed-form bubble fraction)`` for one ``(p, m)``."""
  yield sched.gpipe(p, m), (p - 1) / (m + p - 1)
  yield sched.one_f_one_b(p, m), (p - 1) / (m + p - 1)
  yield sched.interleaved_one_f_one_b(p, m, V), (p - 1) / (V * m + p - 1)
  yield sched.zero_bubble_h1(p, m), (p - 1) / (3 * m + p - 1)
  yield sched.zero_bubble_v(p, m), (p - 1) / (6 * m + p - 1)
  yield sched.dualpipe_v(p, m), (p - 1) / (6 * m + p - 1)


def _bubble(quick: bool) -> list[dict]:
  sizes = ([(4, 8), (4, 32), (8, 16)] if quick else
           [(2, 4), (2, 16), (4, 8), (4, 32), (8, 16), (8, 64), (16, 32),
            (16, 128)])
  rows = []
  for p, m in sizes:
    for s, closed in _cases(p, m):
      r = s.simulate()
      rows.append({
          'schedule': s.name, 'p': p, 'm': m, 'stages': s.num_stages,
          'actions': sum(len(row) for row in s.actions),
          'makespan': r.makespan,
          'bubble_sim': r.bubble_fraction, 'bubble_closed_form': closed,
          'exact': abs(r.bubble_fraction - closed) < 1e-12,
          'peak_activations': max(r.peak_activations),
          'peak_weight_grad_stash': max(r.peak_weight_grad_stash),
          'simulate_ms': 1e3 * median_seconds(
              lambda s=s: s.simulate().makespan, repeats=3),
      })
  return rows


def _frontier(quick: bool) -> list[dict]:
  """Makespan of ``search`` and of each constructor per memory limit."""
  rows = []
  for costs_name, costs in (('default', None), ('I=1.5,W=0.5', UNEQUAL)):
    for p, m in ([(4, 8)] if quick else [(4, 8), (4, 16), (8, 16)]):
      built = [sched.gpipe(p, m), sched.one_f_one_b(p, m),
               sched.interleaved_one_f_one_b(p, m, V), sched.zero_bubble_h1(p, m),
               sched.zero_bubble_v(p, m), sched.dualpipe_v(p, m), sched.v_half(p, m),
               sched.v_min(p, m)]
      for limit in (1, 1.5, 2, 3, p, p + 1, 1.5 * p, 2 * p):
        s = search(p, m, memory_limit=limit, costs=costs)
        row = {'costs': costs_name, 'p': p, 'm': m, 'memory_limit': limit,
               'search': makespan(s, costs), 'search_is': s.name}
        for b in built:
          fits = max(peak_memory(b)) <= limit
          row[b.name] = makespan(b, costs) if fits else None
        rows.append(row)
  return rows


def _stage(params, x):
  """``layers`` residual MLP blocks (``params`` leaves ``[layers, ...]``)."""
  for k in range(params['w1'].shape[0]):
    x = x + jnp.tanh(x @ params['w1'][k]) @ params['w2'][k]
  return x


def _loss(params, y, target):
  return jnp.mean((y @ params['head'] - target) ** 2)


def _model(num_stages: int, layers: int, batch: int, width: int):
  """Float32 args; the same ``layers`` blocks cut into ``num_stages``."""
  k = jax.random.split(jax.random.key(0), 4)
  per = layers // num_stages
  w = lambda key, shape: jax.random.normal(key, shape) / shape[-2] ** 0.5
  stages = {'w1': w(k[0], (num_stages, per, width, 2 * width)),
            'w2': w(k[1], (num_stages, per, 2 * width, width))}
  return (stages, {'head': w(k[2], (width, 8))},
          jax.random.normal(k[3], (batch, width)), jnp.zeros((batch, 8)))


def _v_step(s, mesh, w_recompute: bool):
  """The jitted step of ``_v_memory``: one rank's stages in rank order."""
  def body(w, head, x, t, table=tick_table(s)):
    out = pipeline_value_and_grad_local(
        _stage, _loss, jax.tree.map(lambda a: a[0], w), head, x, t,
        table=table, w_recompute=w_recompute)
    return out.loss, jax.tree.map(lambda a: a[None], out.grads.stages)
  return jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P('stage'), P(), P(), P()),
      out_specs=(P(), P('stage')), axis_names={'stage'}))


def _v_memory(quick: bool) -> list[dict]:
  """Compiled temp bytes: the stage params stay in rank order.

  ``pipeline_value_and_grad_local`` in a ``shard_map``, the params rearranged once
  outside (``stages_to_ranks``), so the step's scratch is the schedule's
  stashes and messages, not a per-step permutation of the params; a large
  microbatch against a narrow model makes activations the bulk of it. The
  step's wall and process-CPU time (its work), the two ``w_recompute``
  settings of a schedule taking turns.
  """
  p, m, mb, width = 4, 8, (128 if quick else 512), 64
  mesh = make_mesh(stage=p, devices=jax.devices()[:p])
  rows = []
  for s in (sched.one_f_one_b(p, m), sched.zero_bubble_v(p, m),
            sched.v_half(p, m), sched.v_min(p, m)):
    stages, *rest = _model(s.num_stages, 2 * p, m * mb, width)
    args = (stages_to_ranks(stages, s), *rest)
    compiled = {w: _v_step(s, mesh, w).lower(*args).compile()
                for w in ((False,) if s.name == '1F1B' else (False, True))}
    times = wall_and_cpu_seconds(compiled, args, repeats=3 if quick else 7)
    for w_recompute, step in compiled.items():
      temp = step.memory_analysis().temp_size_in_bytes
      rows.append({
          'schedule': s.name, 'w_recompute': w_recompute, 'p': p, 'm': m,
          'layers': 2 * p, 'width': width, 'microbatch': mb,
          'peak_memory': max(peak_memory(s)),
          'stash_slots': tick_table(s).num_stash_slots, 'temp_bytes': temp,
          'temp_vs_1f1b': temp / rows[0]['temp_bytes'] if rows else 1.0,
          'step_ms': 1e3 * times[w_recompute][0],
          'step_cpu_ms': 1e3 * times[w_recompute][1]})
  return rows


def run(*, quick: bool) -> dict[str, list[dict]]:
  """The ``bubble``, ``frontier`` and ``v_memory`` sections."""
  return {'bubble': _bubble(quick), 'frontier': _frontier(quick),
          'v_memory': _v_memory(quick)}
