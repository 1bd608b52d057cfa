"""Memory from compiled steps: one compile per distinct stage shape.

Candidates that share their mesh sizes, logical stages, microbatches, ZeRO
stage, remat policy and the kind of backward their tables run (``B`` fused
or split, one weight slot or more) -- a *stage shape* (``shape_key``) --
run the same blocks on the same buffers; only their schedules' stash and
message slots differ, and
those are counted exactly (``_memory.stash_bytes``). So one compiled step
per shape gives the ``work`` part (gradients, update temporaries, gathers)
of all of them: ``work`` = the compiled peak (``held_bytes``) - the
analytic arguments, outputs and stashes. ``plan`` compiles the best
candidate's shape, ranks again, compiles the best one's shape if it is not
compiled yet, and so on (``compile=K`` shapes; by default 2 where the
devices are present), so the plan's best is a compiled figure unless K
compiles moved it. The candidates
of the shapes not compiled keep the analytic model, their temporaries
(stash + work) scaled by the median ratio of compiled to analytic
temporaries over the compiled shapes of their ``scale_group`` (pipelined
or not, and the remat policy) where it is above 1: a data-parallel
compile says nothing of a pipeline's stash (jaxpar's GPT at the CLI's
sizes: two data-parallel shapes compiled at a ratio above 1 lifted the
analytic 1F1B m=8 ``'dots'``, 1.19x its compiled peak, to 1.28x).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from jaxpar.planner import _memory
from jaxpar.planner._layout import Layout, schedule_key, tick_table
from jaxpar.planner._source import Source, build_trainer

def shape_key(layout: Layout) -> tuple:
  """What fixes a step's buffers apart from the schedule's slots: the mesh,
  logical stages, microbatches, ZeRO stage and remat policy, and how the
  tick table runs the backward -- ``B`` fused or ``I`` and ``W``, with one
  weight slot or more -- by which XLA copies a slot's row or builds ``I``'s
  ``kept`` apart (``_memory``): at the CLI's sizes interleaved v=2 m=8
  ``'dots'`` (fused) took ZB-V m=8's compiled work (split), 16% under its
  compiled peak."""
  table = tick_table(schedule_key(layout))
  return (layout.data, layout.stage, layout.tensor, layout.num_stages,
          layout.num_microbatches, layout.zero_stage, layout.remat_policy,
          layout.w_recompute, _memory._runs_fused(layout),
          table.num_weight_slots > 1)


def scale_group(layout: Layout) -> tuple:
  """The candidates a compiled shape's ratio is applied to: those that
  pipeline (``stage`` > 1) or not alike, under the same remat policy."""
  return layout.stage > 1, layout.remat_policy


def step_bytes(src: Source, devices: Sequence, layout: Layout,
               optimizer: optax.GradientTransformation, batch: Any) -> int:
  """What a device holds at ``layout``'s compiled step's peak
  (``held_bytes``)."""
  trainer = build_trainer(src, devices, layout, optimizer)
  params, functions = src.pipeline(layout.num_stages)[:2]
  state = trainer.init(params, getattr(functions, 'model_state', None))
  if isinstance(batch, int):
    ids = np.zeros((batch, src.spec.seq_len), np.int32)
    batch = (ids, ids)
  return held_bytes(trainer.step.lower(state, batch).compile())


def held_bytes(compiled: Any) -> int:
  """What a device holds at a compiled program's peak, per device:
  arguments + outputs + temporaries - the outputs aliased to arguments.

  ``memory_analysis()``'s arguments + temp is not it: a step that donates
  nothing writes the new state into output buffers of its own, and XLA
  parks gradients, stashes and the update's temporaries in those buffers
  before they are written (they are not in temp). Donating the state does
  not lower the peak: XLA puts the same temporaries in temp instead.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> step = jax.jit(lambda x: (x + 1, x.sum()))
    >>> held_bytes(step.lower(jnp.zeros(256)).compile()) >= 2 * 1024
    True
  """
  mem = compiled.memory_analysis()
  return int(mem.argument_size_in_bytes + mem.output_size_in_bytes
             + mem.temp_size_in_bytes - mem.alias_size_in_bytes)


def compiled_memory(ranked: list, count: int, src: Source,
                    devices: Sequence, optimizer, batch: Any, cap: float,
                    rank: Callable[[list], list]) -> list:
  """``ranked`` with the work of ``count`` stage shapes compiled and used
  for every candidate of the shape: each time the best candidate whose
  shape is not compiled yet, then ranked again (``rank``), so that a shape
  that needs more than predicted gives its place before the next compile.
  The shapes not compiled keep the analytic model, their temporaries
  scaled by the median compiled/analytic ratio of their ``scale_group``
  where it is above 1 (never below: a compile of one shape does not make
  another fit; none where the group has no compiled shape)."""
  analytic = {c.layout: c.memory for c in ranked}
  work, ratios, out = {}, {}, list(ranked)
  for _ in range(count):
    todo = next((c for c in out if shape_key(c.layout) not in work), None)
    if todo is None:
      break
    mem = analytic[todo.layout]
    total = _shared(step_bytes(src, devices, todo.layout, optimizer, batch))
    work[shape_key(todo.layout)] = total - (mem.total - mem.work)
    ratios.setdefault(scale_group(todo.layout), []).append(
        (total - mem.total + mem.work + mem.stash) / (mem.work + mem.stash))
    scale = {g: max(float(np.median(r)), 1.0) for g, r in ratios.items()}
    out = rank(_apply(ranked, work, scale, cap))
  return out


def _apply(ranked: list, work: dict, scale: dict, cap: float) -> list:
  """``ranked``'s candidates with the compiled ``work`` of their shape, or
  their temporaries scaled by their ``scale_group``'s ratio in ``scale``
  (1 without one; and the time to write them in, ``StepTime.alloc``, with
  them where it counts them: a pipeline's)."""
  out = []
  for c in ranked:
    key = shape_key(c.layout)
    if key in work:
      mem = c.memory.calibrated(work[key])
    else:
      temp = c.memory.stash + c.memory.work
      ratio = scale.get(scale_group(c.layout), 1.0)
      mem = c.memory.calibrated(ratio * temp - c.memory.stash)
    alloc = (c.time.alloc * mem.fresh / max(c.memory.fresh, 1)
             if c.layout.stage > 1 else c.time.alloc)
    out.append(c._replace(memory=mem, time=c.time._replace(alloc=alloc),
                          fits=mem.total <= cap, compiled=key in work))
  return out


def _shared(nbytes: int) -> int:
  """Process 0's ``nbytes`` in every process (one ranking in all)."""
  if jax.process_count() == 1:
    return nbytes
  return int(multihost_utils.broadcast_one_to_all(np.int64(nbytes)))
