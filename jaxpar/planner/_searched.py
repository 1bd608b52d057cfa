"""Searched schedules as candidates: ``searched``.

``pipeline.search`` finds the fastest schedule under a stash cap for given
``F``, ``I``, ``W`` costs (the zero-bubble paper's list scheduler, and every
built-in constructor). Its result depends on the layout -- the block costs
of its mesh and microbatch size, and the memory its params and optimizer
leave for stashes -- so ``plan`` searches per layout, for the best few
pipelined meshes and microbatch counts only (a search takes 0.1 s on 2 ranks
with 4 microbatches, 1-3 s on 4-8 ranks with 16, 14 s on 8 with 64), and
only when asked (``plan(..., search=K)``): it optimises against the time
model, which on 2 CPU processes predicts its two schedules 17-19% fast
and data parallelism 5-12% fast.

Example (a CPU's block shares, on paper for 4 H100s):

  >>> import jaxpar
  >>> from jaxpar.models import gpt
  >>> from jaxpar.planner import PROFILES
  >>> config = gpt.GPTConfig(num_layers=8, d_model=1024, num_heads=16,
  ...                        seq_len=1024, vocab_size=256)
  >>> profile = PROFILES['H100-SXM']._replace(block_shares=(0.28, 0.4, 0.32))
  >>> plan = jaxpar.plan(config, batch=64, devices=4, profile=profile,
  ...                    remat_policies=('dots',), zero_stages=(0,),
  ...                    max_microbatches=8, where=lambda x: x.stage == 4,
  ...                    search=2)
  >>> plan.best.layout.describe()
  '1x4x1 Search(memory=8) m=8 ZeRO-0 dots'
  >>> built_in = next(c for c in plan.candidates
  ...                 if c.layout.schedule_name != 'search')
  >>> built_in.layout.describe(), built_in.predicted_s > plan.best.predicted_s
  ('1x4x1 Interleaved 1F1B (v=2) m=8 ZeRO-0 dots', True)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jaxpar.planner._layout import Layout, SearchArgs, schedule_key, tick_table
from jaxpar.planner._memory import memory, shapes
from jaxpar.planner._model import ModelSpec
from jaxpar.planner._profile import Profile
from jaxpar.planner._time import message_seconds


def _costs(spec: ModelSpec, candidate: Any, batch: int,
           profile: Profile) -> tuple[tuple[float, float, float], float]:
  """``((1, I/F, W/F), comm/F)`` of the candidate's blocks and messages
  (``search`` takes costs per 1F1B stage; relative ones are the same), to
  two decimals so that near-equal layouts share one search."""
  x, blocks = candidate.layout, candidate.time.blocks
  f = blocks['F'] * x.stages_per_rank
  comm = message_seconds(spec, x, profile, shapes(spec, x, batch).tokens)
  costs = (1.0, round(blocks['I'] / blocks['F'], 2),
           round(blocks['W'] / blocks['F'], 2))
  return costs, round(comm / f, 2)


def _stash_cap(spec: ModelSpec, layout: Layout, *, batch: int,
               opt_factor: float, cap: float) -> int:
  """Stashes of one 1F1B stage that fit beside the rest of ``layout``'s
  mesh, microbatches, ZeRO and remat under ``cap`` bytes (at most ``2p``:
  more buys nothing), or 0 if not one does."""
  one = layout._replace(schedule_name='one_f_one_b', virtual_stages=1,
                        searched=None)
  mem = memory(spec, one, batch=batch, opt_factor=opt_factor)
  per_stash = mem.stash / tick_table(schedule_key(one)).num_stash_slots
  fit = math.floor((cap - (mem.total - mem.stash)) / per_stash)
  return min(fit, 2 * layout.stage)


def searched(candidates: Sequence[Any], n: int, spec: ModelSpec, *,
             batch: int, opt_factor: float, cap: float, profile: Profile,
             num_stages: int | None = None) -> list[Layout]:
  """Layouts of ``pipeline.search``'s schedules for the ``n`` best distinct
  pipelined ``(data, stage, tensor, microbatches)`` of ``candidates``
  (ranked, fitting first), with their ZeRO stage, remat policy and block
  costs, capped by the memory they leave (with ``num_stages`` that many
  logical stages only); those where a built-in constructor won are left
  out (they are candidates already)."""
  out, seen = [], set()
  for c in candidates:
    x = c.layout
    key = (x.data, x.stage, x.tensor, x.num_microbatches)
    if len(seen) == n or not c.fits:
      break
    if x.stage == 1 or key in seen:
      continue
    seen.add(key)
    limit = _stash_cap(spec, x, batch=batch, opt_factor=opt_factor, cap=cap)
    if limit < 1:
      continue
    layout = _search(spec, c, SearchArgs(float(limit), *_costs(
        spec, c, batch, profile), None), num_stages)
    if layout is not None:
      out.append(layout)
  return out


def _search(spec: ModelSpec, candidate: Any, args: SearchArgs,
            num_stages: int | None) -> Layout | None:
  """The searched layout of ``candidate``'s mesh and microbatches, or
  ``None`` where a built-in constructor won: every placement, then one
  stage per rank if the schedule found has more stages than the model
  layers; with a fixed ``num_stages`` (a ``PipelineModel``'s cut) only the
  placement that has them."""
  x = candidate.layout
  options = {None: (None, False), x.stage: (False,),
             2 * x.stage: (True,)}.get(num_stages, ())
  for v_shape in options:
    layout = Layout(x.data, x.stage, x.tensor, 'search', x.num_microbatches,
                    x.zero_stage, x.remat_policy,
                    w_recompute=x.w_recompute,
                    searched=args._replace(v_shape=v_shape))
    found = layout.schedule()
    if found.num_stages <= spec.num_layers and num_stages in (
        None, found.num_stages):
      return layout if found.name.startswith('Search') else None
  return None
