"""The executor's own step, timed: ``in_step_costs`` and ``per_tick``.

Apart, each pipeline block is its own program (``_calibrate``'s
``kind_factors``). Inside the executor's tick scan a block also reads its
mailbox and stash slots, writes its residuals and adds its gradient in
place, and runs while the other rank runs its own. On 2 CPU processes a GPT
stage's ``F`` cost 17-35% more there than the factors timed apart said, and
a two-layer ``B`` 10% more (``docs/planning.md``, "0.11.0"), which put most
pipelined steps 5-15% under their measured time.

* ``in_step_costs``: the stage on 2 ranks in a 1F1B step (its ``F``, ``I``
  and ``W``) and a GPipe step laid out with fused ``B``'s
  (``tick_table(..., backward='fused')``) under ``pipeline.timeline``:
  each kind's mean compute seconds over the ticks in which both ranks run
  a block (a rank alone runs faster: ``Profile.alone_speedup``).
* ``per_tick``: the scan's cost per tick besides its blocks, on a stage
  whose blocks cost nothing (one ``[8, 8]`` layer), at two microbatch
  counts.

Example (a stage of two ``[8, 8]`` matrices on 2 devices):
  >>> import jax, numpy as np
  >>> from jaxpar.planner._in_step import in_step_costs, per_tick
  >>> stage = {'w': np.full((2, 8, 8), 0.1, np.float32)}
  >>> costs = in_step_costs(lambda w, x: x @ w['w'][0] @ w['w'][1], stage,
  ...                       jax.devices()[:2], np.ones((4, 8), np.float32),
  ...                       repeats=1)
  >>> sorted(costs), all(c > 0 for c in costs.values())
  (['B', 'F', 'I', 'W'], True)
  >>> per_tick(jax.devices()[:2], 0.0, 1) >= 0
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxpar import pipeline
from jaxpar.mesh import make_mesh
from jaxpar.planner._timing import placed, seconds

# Microbatches of the steps timed: 1F1B at p = 2 runs 2 of its 4 ``F`` and
# every ``I`` and ``W`` beside the other rank's block; GPipe 6 of its 8.
_MICROBATCHES = 4
# The kinds each schedule's table runs, and how it runs ``B``.
_KINDS = ((pipeline.one_f_one_b, ('F', 'I', 'W'), 'split'),
          (pipeline.gpipe, ('B',), 'fused'))


def _busy_means(timeline: pipeline.Timeline, kinds: Sequence[str]
                ) -> dict[str, float]:
  """Mean compute seconds of each of ``kinds`` in the ticks where every
  rank runs a block (where there are none, in all its ticks)."""
  compute = timeline.parts()['compute'].mean(axis=0)   # [T, p]
  codes = timeline.actions[:, :, 0]
  both = (codes > 0).all(axis=1)[:, None]
  out = {}
  for kind in kinds:
    ran = codes == pipeline.KIND_CODES[kind]
    busy = ran & both if (ran & both).any() else ran
    out[kind] = float(compute[busy].mean())
  return out


def in_step_costs(stage_fn: Callable, stage: Any, devices: Sequence,
                  x: np.ndarray, *, repeats: int,
                  specs: Any = None) -> dict[str, float]:
  """``{'F', 'I', 'W', 'B'}``: seconds of one block of ``stage_fn`` on the
  host params ``stage`` and microbatch ``x``, as a 2-rank step's tick scan
  runs it (module doc); ``devices[:2]`` are the ranks (every process
  calls it), ``repeats`` the steps timed, ``specs`` the stage's
  ``PartitionSpec`` per leaf over a ``tensor`` axis of size 1 (``None``:
  replicated)."""
  mesh = jax.sharding.Mesh(np.asarray(devices[:2]).reshape(2, 1),
                           ('stage', 'tensor'))
  if specs is None:
    specs = jax.tree.map(lambda _: P(), stage)
  specs = jax.tree.map(lambda spec: P('stage', *spec), specs,
                       is_leaf=lambda v: isinstance(v, P))
  params = jax.tree.map(lambda a, spec: placed(mesh, np.stack([a, a]), spec),
                        stage, specs)
  batch = placed(mesh, np.concatenate([x] * _MICROBATCHES))
  out = {}
  for schedule, kinds, backward in _KINDS:
    local = functools.partial(
        pipeline.pipeline_value_and_grad_local, stage_fn,
        lambda _, y, t: jnp.mean(y * t), loss_params=(),
        table=pipeline.tick_table(schedule(2, _MICROBATCHES),
                                  backward=backward),
        input_grads=False)
    step = jax.jit(jax.shard_map(
        lambda w, xs: local(local_params=w, inputs=xs, targets=xs
                            ).grads.stages,
        mesh=mesh, in_specs=(specs, P()), out_specs=specs))
    out.update(_busy_means(pipeline.timeline(step, params, batch,
                                             steps=repeats), kinds))
  return out


def _tiny_step(mesh, m: int) -> tuple[Callable, tuple]:
  """``(step, args)``: a 1F1B step of ``m`` one-row microbatches through
  one ``[8, 8]`` tanh layer per rank of ``mesh`` (its blocks cost ~0)."""
  p = mesh.devices.size
  step = pipeline.pipeline_value_and_grad(
      lambda w, x: jnp.tanh(x @ w), lambda s, y, t: jnp.mean((s * y - t)**2),
      schedule=pipeline.one_f_one_b(p, m), mesh=mesh, input_grads=False)
  put = functools.partial(placed, mesh)
  return step, (put(np.full((p, 8, 8), 0.1, np.float32)),
                put(np.ones((), np.float32)), put(np.ones((m, 8), np.float32)),
                put(np.zeros((m, 8), np.float32)))


def per_tick(devices: Sequence, message: float, repeats: int) -> float:
  """Seconds of one executor tick (``len(devices)`` ranks, 2 or more; the
  tick's ``message`` seconds taken out) or, on one device, of one
  microbatch of the plain scan: the slope over 4 and 16 microbatches."""
  mesh = make_mesh(stage=len(devices), devices=devices)
  points = []
  for m in (4, 16):
    step, args = _tiny_step(mesh, m)
    table = pipeline.tick_table(pipeline.one_f_one_b(len(devices), m))
    if len(devices) == 1:
      ticks, sends = m, 0.0
    else:
      ticks = table.num_ticks
      sends = table.makespan({'F': 0, 'I': 0, 'W': 0}, 1.0)
    points.append((ticks, seconds(step, *args, repeats=repeats)
                   - sends * message))
  (n1, s1), (n2, s2) = points
  return max((s2 - s1) / (n2 - n1), 0.0)
