"""Memory from compiled steps: one compile per distinct stage shape.

Candidates that share their mesh sizes, logical stages, microbatches, ZeRO
stage and remat policy -- a *stage shape* -- run the same blocks on the
same buffers; only their schedules' stash and message slots differ, and
those are counted exactly (``_memory.stash_bytes``). So one compiled step
per shape gives the ``work`` part (gradients, update temporaries, gathers)
of all of them: ``work = compiled (arguments + temp) - the analytic
arguments and stashes``. The candidates of the shapes not compiled keep
the analytic model, their temporaries (stash + work) scaled by the median
ratio of compiled to analytic temporaries over the compiled shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import optax

from jaxpar.planner._layout import Layout
from jaxpar.planner._source import Source, build_trainer

def shape_key(layout: Layout) -> tuple:
  """What fixes a step's buffers apart from the schedule's slots."""
  return (layout.data, layout.stage, layout.tensor, layout.num_stages,
          layout.num_microbatches, layout.zero_stage, layout.remat_policy)


def step_bytes(src: Source, devices: Sequence, layout: Layout,
               optimizer: optax.GradientTransformation, batch: Any) -> int:
  """Arguments + temp bytes of ``layout``'s compiled step, per device."""
  trainer = build_trainer(src, devices, layout, optimizer)
  state = trainer.init(src.pipeline(layout.num_stages)[0])
  if isinstance(batch, int):
    ids = np.zeros((batch, src.spec.seq_len), np.int32)
    batch = (ids, ids)
  mem = trainer.step.lower(state, batch).compile().memory_analysis()
  return int(mem.argument_size_in_bytes + mem.temp_size_in_bytes)


def compiled_memory(ranked: list, count: int, src: Source,
                    devices: Sequence, optimizer, batch: Any,
                    cap: float) -> list:
  """``ranked`` with the work of ``count`` stage shapes compiled (those
  of the best candidates) and used for every candidate of the shape."""
  work, ratios = {}, []
  for candidate in ranked:
    key = shape_key(candidate.layout)
    if len(work) >= count:
      break
    if key not in work:
      total = step_bytes(src, devices, candidate.layout, optimizer, batch)
      mem = candidate.memory
      work[key] = total - (mem.total - mem.work)
      ratios.append((work[key] + mem.stash) / (mem.work + mem.stash))
  ratio = float(np.median(ratios))
  out = []
  for c in ranked:
    key = shape_key(c.layout)
    if key in work:
      mem = c.memory.calibrated(work[key])
    else:
      temp = c.memory.stash + c.memory.work
      mem = c.memory.calibrated(ratio * temp - c.memory.stash)
    out.append(c._replace(memory=mem, fits=mem.total <= cap,
                          compiled=key in work))
  return out
