"""Predicted seconds of a layout's training step: ``StepTime``, ``step_time``.

The step is its pipeline plus what runs around it, on a ``Profile``:

* **blocks** -- one logical stage's ``F``, ``I``, ``W`` and fused ``B``
  for one microbatch. ``plain``, the stage's forward and backward as the
  one-rank step runs them (one ``value_and_grad`` program): three times
  its forward FLOPs over the FLOP/s the profile reaches at that many
  tokens (``Profile.rate``: measured in that program at two layers --
  on a CPU a one-layer program runs up to 19% faster per layer, but a
  pipeline's one-layer blocks do not: ``docs/planning.md`` -- or the peak
  share plus the block overhead of each of its layers), over
  ``Profile.tensor_share`` too when split over ``tensor``. One stage rank
  splits ``plain`` among its blocks; a pipeline rank runs each block as its
  own program in the tick scan, which costs its own share
  (``Profile.block_factors``: measured, apart and inside a 2-rank step,
  ``F + I + W`` 1.0-1.7x ``plain`` on a CPU, more at small microbatches;
  on paper ``block_shares``). Added: the tensor-parallel
  all-reduces (two per block forward, two in the backward), the forward
  again in the backward under ``remat_policy='nothing'`` (one stage rank:
  the one-rank program timed under the policy instead,
  ``Profile.policy_factor``, where measured), and the
  gradient's add into its accumulator in ``W`` and ``B`` (a read of both
  and a write, at the memory bandwidth). Under ``w_recompute`` ``W`` is
  the measured ``R`` (``I``'s chain again and the weight gradients: about
  ``I + W``) with ``I``'s recompute and all-reduces;
* **pipeline** -- the executor's time of the schedule's tick table with
  those costs (``lock_step``: the ranks wait for each other at the ticks
  that send, a tick's blocks ``Profile.alone_speedup`` faster where the
  other ranks idle) and one ``ppermute`` of an activation per tick that
  sends, plus per microbatch
  the embedding, head and loss (``head_seconds``: measured, or the head's
  FLOPs), plus the profile's fixed cost per tick (one stage rank: per
  microbatch of its plain scan);
* **data** -- the gradients' all-reduce over ``data`` (ZeRO-1:
  reduce-scatter + all-gather; ZeRO-3: ``zero3_seconds`` per microbatch,
  each layer's param arrays gathered twice and reduce-scattered one at a
  time, as timed by ``measure_profile``), the move to the per-layer view
  over ``stage``;
* **update** -- the optimizer reading and writing params, gradients and
  state once each at the memory bandwidth;
* **alloc** -- the step's temporaries and outputs (``memory``'s stash, work
  and outputs; without a pipeline its outputs alone: ``alloc_seconds``)
  written into freshly allocated memory at
  ``Profile.first_touch_bandwidth`` (on a CPU every call faults their pages
  in: with 2 processes on 2 cores ~0.6 s per GiB, 1-10% of the GPT steps
  measured here; none on paper).

Example:
  >>> from jaxpar.models import gpt
  >>> from jaxpar.planner import Layout, ModelSpec, PROFILES, step_time
  >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(d_model=1024, num_layers=8,
  ...                                         seq_len=1024, num_heads=16))
  >>> fast = step_time(spec, Layout(4, 2, 1, 'gpipe', 4), batch=64,
  ...                  profile=PROFILES['H100-SXM'])   # more microbatches:
  >>> slow = step_time(spec, Layout(4, 2, 1, 'gpipe', 2), batch=64,
  ...                  profile=PROFILES['H100-SXM'])   # a smaller bubble
  >>> fast.total < slow.total, round(fast.bubble, 2) < round(slow.bubble, 2)
  (True, True)
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxpar.pipeline import KIND_CODES, TickTable
from jaxpar.planner._layout import Layout, schedule_key, tick_table
from jaxpar.planner._memory import Memory, memory, shapes
from jaxpar.planner._model import ModelSpec
from jaxpar.planner._profile import Profile

# Forward FLOPs recomputed in the backward, as a share of the forward.
RECOMPUTE = {'dots': 0.0, 'dots_no_batch': 0.15, 'nothing': 1.0,
             'everything': 0.0}
# Bytes the update streams per param element of the view: params read and
# written, gradient read, two Adam moments read and written.
UPDATE_PASSES = 7
# One stage rank runs each microbatch's forward and backward as one
# program (``value_and_grad``): its blocks split the plain time, whichever
# way its table cuts the backward.
ONE_RANK = {'F': 1 / 3, 'I': 1 / 3, 'W': 1 / 3, 'B': 2 / 3, 'R': 2 / 3}


class StepTime(NamedTuple):
  """Seconds of one step, by part (see the module doc).

  Attributes:
    pipeline: the schedule's lock-step time, messages and head included.
    data: data-parallel / ZeRO collectives and the view's move over stage.
    update: the optimizer update.
    bubble: idle share of the pipeline's rank-time (0 without a pipeline).
    blocks: ``{'F': s, 'I': s, 'W': s}`` of one logical stage, one
      microbatch.
    alloc: the step's fresh buffers written in (0 on paper).
  """
  pipeline: float
  data: float
  update: float
  bubble: float
  blocks: dict
  alloc: float = 0.0

  @property
  def total(self) -> float:
    """The step: pipeline + data + update + alloc."""
    return self.pipeline + self.data + self.update + self.alloc


def block_costs(spec: ModelSpec, layout: Layout, profile: Profile,
                tokens: int, n_slots: int) -> dict[str, float]:
  """Seconds of one logical stage's ``F``, ``I``, ``W`` and fused ``B`` for
  one microbatch.

  ``plain``: the stage's forward and backward as the one-rank step runs
  them (``Profile.rate``); one stage rank splits it as ``F + I + W`` or
  ``F + B`` alike, a pipeline's blocks each cost their own program's share
  of it (``Profile.block_factors``: measured, their sum above 1 on a CPU).
  """
  t = layout.tensor
  rate, per_block = profile.rate(tokens)
  share = profile.tensor_share(tokens) if t > 1 else 1.0
  plain = 3 * n_slots * spec.flops.per_device(t) * tokens / rate / share
  factors = (ONE_RANK if layout.stage == 1 else
             profile.block_factors(tokens))
  measured = (profile.policy_factor(layout.remat_policy, tokens)
              if layout.stage == 1 else None)
  plain *= measured or 1.0
  f, i, w, b, again = (plain * factors[k] for k in 'FIWBR')
  act = tokens * spec.d_model * spec.act_bytes
  tp = n_slots * 2 * profile.collective('all-reduce', act, t, span=t)
  over = n_slots * per_block
  recompute = (0.0 if measured else RECOMPUTE[layout.remat_policy] * f)
  backward_tp = tp + (tp if RECOMPUTE[layout.remat_policy] else 0.0)
  grads = n_slots * spec.layer.per_device(t) * spec.param_bytes
  add = 3 * grads / profile.hbm_bandwidth
  if layout.w_recompute:   # W re-runs I's chain (measured apart: 'R')
    w = again + recompute + backward_tp
  return {'F': f + tp + over,
          'I': i + recompute + backward_tp + over,
          'W': w + over + add,
          'B': b + recompute + backward_tp + over + add}


def zero3_seconds(spec: ModelSpec, layout: Layout, profile: Profile,
                  rank_layers: int) -> float:
  """Seconds of ZeRO-3's gathers and reduce-scatters in one microbatch of
  one rank: its ``rank_layers`` layers, each gathered in the forward and
  again in the backward and its gradient reduce-scattered, one param array
  at a time inside the stage's scan (``Profile.zero3_layer_seconds`` where
  measured, else one collective per layer each), plus the embedding and
  head, one collective of each kind each; in the compute dtype (the
  executor casts the slices before it gathers them).

  Example (4 layers timed at 1 ms each, plus the embedding's and head's
  18 us; on paper 57 us in all):
    >>> from jaxpar.models import gpt
    >>> from jaxpar.planner import Layout, ModelSpec, PROFILES
    >>> from jaxpar.planner._time import zero3_seconds
    >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(num_layers=4))
    >>> layout = Layout(2, 1, 1, 'one_f_one_b', 4, zero_stage=3)
    >>> timed = PROFILES['H100-SXM']._replace(zero3_layer_seconds=1e-3)
    >>> round(1e6 * (zero3_seconds(spec, layout, timed, 4) - 4e-3))
    18
    >>> round(1e6 * zero3_seconds(spec, layout, PROFILES['H100-SXM'], 4))
    57
  """
  d, t = layout.data, layout.tensor
  span = d * layout.stage * t
  cast = spec.act_bytes
  three = lambda nbytes: (
      2 * profile.collective('all-gather', nbytes, d, span=span)
      + profile.collective('reduce-scatter', nbytes, d, span=span))
  layer = (profile.zero3_layer_seconds or
           three(spec.layer.per_device(t) * cast))
  return (rank_layers * layer + three(spec.embed.per_device(t) * cast)
          + three(spec.head.per_device(t) * cast))


def _data_time(spec: ModelSpec, layout: Layout, profile: Profile,
               held_bytes: float, rank_layers: int) -> float:
  """Seconds of the gradient and ZeRO collectives and the view's move."""
  d, s, t = layout.data, layout.stage, layout.tensor
  span = d * s * t
  coll = lambda kind, n, b: profile.collective(kind, b, n, span=span)
  if layout.zero_stage == 0:
    out = coll('all-reduce', d, held_bytes)
  elif layout.zero_stage == 1:
    out = coll('reduce-scatter', d, held_bytes) + coll('all-gather', d,
                                                      held_bytes)
  else:
    out = layout.num_microbatches * zero3_seconds(spec, layout, profile,
                                                  rank_layers)
  if s > 1:   # gradients to the per-layer view and updates back
    out += 2 * profile.collective('all-gather', held_bytes, s, span=s * t)
  return out


def message_seconds(spec: ModelSpec, layout: Layout, profile: Profile,
                    tokens: int) -> float:
  """Seconds of one ``ppermute`` of a microbatch's activation (``tokens x
  d_model``) between two pipeline ranks."""
  return profile.collective('ppermute', tokens * spec.d_model * spec.act_bytes,
                            2, span=layout.stage * layout.tensor)


def head_seconds(spec: ModelSpec, layout: Layout, profile: Profile,
                 tokens: int) -> float:
  """Seconds of the embedding, head and loss, forward and backward, for
  one microbatch: measured (``Profile.head``, its vocabulary split over
  ``tensor``) or from the head's FLOPs at the block rate."""
  measured = profile.head(tokens)
  if measured is not None:
    return measured * (spec.head_flops.per_device(layout.tensor)
                       / spec.head_flops.per_device(1))
  rate, per_block = profile.rate(tokens)
  return (3 * spec.head_flops.per_device(layout.tensor) * tokens / rate
          + per_block)


def _kind_costs(blocks: dict) -> np.ndarray:
  """Seconds per ``TickTable.kind`` code (idle: 0)."""
  cost = np.zeros(max(KIND_CODES.values()) + 1)
  for kind, code in KIND_CODES.items():
    cost[code] = blocks[kind]
  return cost


def lock_step(table: TickTable, blocks: dict, comm: float,
              alone: float = 1.0) -> float:
  """Seconds of ``table`` as the executor runs it: the ranks wait for each
  other only at the ticks that send (their ``ppermute``), so between two
  such ticks each rank runs its own blocks back to back, and a tick that
  sends ends when the slowest rank's run up to it does, plus ``comm``; a
  block runs ``alone`` times faster in a tick where the other ranks idle
  (``1 + (alone - 1) x`` the share of them idle:
  ``Profile.alone_speedup``).

  ``TickTable.makespan`` (every tick waits for its slowest block) is the
  upper bound, equal where every tick sends. 1F1B at p = 2 sends in one
  tick of three (``F`` with the other's ``I``), so a costly ``W`` in the
  ticks between is waited for once, not in each: on 2 CPU processes the
  lock-step time over-predicted 1F1B by 15% and 1F1B under ``w_recompute``
  by 37%; this, by 5% (``docs/planning.md``).

  Example (GPipe on 2 ranks, ``B`` fused: of its 4 ticks, 2 have a rank
  idle; 1F1B, a ``W`` twice an ``F``):
    >>> from jaxpar import pipeline
    >>> from jaxpar.planner._time import lock_step
    >>> table = pipeline.tick_table(pipeline.gpipe(2, 1), backward='fused')
    >>> table.render()
    'rank 0: F..B\\nrank 1: .FB.'
    >>> blocks = {'F': 1.0, 'I': 1.0, 'W': 1.0, 'B': 2.0}
    >>> lock_step(table, blocks, 0.0), lock_step(table, blocks, 0.0, 2.0)
    (6.0, 3.0)
    >>> table = pipeline.tick_table(pipeline.one_f_one_b(2, 4))
    >>> costly = {'F': 1.0, 'I': 1.0, 'W': 2.0, 'B': 3.0}
    >>> lock_step(table, costly, 0.0), table.makespan(costly)
    (18.0, 22.0)
  """
  cost = _kind_costs(blocks)
  ranks = table.kind.shape[1]
  idle = (table.kind == 0).sum(axis=1) / max(ranks - 1, 1)
  ticks = cost[table.kind] / (1 + (alone - 1) * idle)[:, None]
  sync = table.sends.any(axis=1)
  # A run of ticks up to and including one that sends: its own segment.
  segment = np.concatenate([[0], np.cumsum(sync)[:-1]])
  runs = np.zeros((segment[-1] + 1, ranks))
  np.add.at(runs, segment, ticks)
  return float(runs.max(axis=1).sum() + comm * sync.sum())


def alloc_seconds(mem: Memory, profile: Profile, *,
                  pipelined: bool = True) -> float:
  """Seconds to write a step's fresh buffers at
  ``Profile.first_touch_bandwidth`` (0: not measured): its temporaries and
  outputs, or without a pipeline (``pipelined=False``) its outputs alone:
  a stage rank without one runs the calibration's one-rank program per
  microbatch, whose timed rate pays its temporaries already (counted twice,
  they put the 1- and 2-microbatch data-parallel steps 17-25% over their
  measured time; ``docs/planning.md``, "0.17.3").

  Example (0.5 GiB of them at 2 GiB/s, 0.125 GiB of it outputs):
    >>> from jaxpar.planner import PROFILES, Memory
    >>> from jaxpar.planner._time import alloc_seconds
    >>> mem = Memory(params=1, opt_state=2, batch=3, stash=2**28,
    ...              work=2**27, outputs=2**27)
    >>> cpu = PROFILES['H100-SXM']._replace(first_touch_bandwidth=2**31)
    >>> alloc_seconds(mem, cpu), alloc_seconds(mem, cpu, pipelined=False)
    (0.25, 0.0625)
    >>> alloc_seconds(mem, PROFILES['H100-SXM'])
    0.0
  """
  rate = profile.first_touch_bandwidth
  fresh = mem.fresh if pipelined else mem.outputs
  return fresh / rate if rate else 0.0


def step_time(spec: ModelSpec, layout: Layout, *, batch: int,
              profile: Profile, mem: Memory | None = None) -> StepTime:
  """Predicted seconds of ``layout``'s step on ``profile`` (module doc);
  ``mem``: its ``memory`` (computed if not given)."""
  shape = shapes(spec, layout, batch)
  blocks = block_costs(spec, layout, profile, shape.tokens, shape.slots)
  table = tick_table(schedule_key(layout))
  comm = message_seconds(spec, layout, profile, shape.tokens)
  makespan = lock_step(table, blocks, comm if layout.stage > 1 else 0.0,
                       profile.alone_speedup)
  busy = float(_kind_costs(blocks)[table.kind].sum()) / layout.stage
  bubble = 1.0 - busy / makespan if layout.stage > 1 else 0.0
  fixed = (table.num_ticks * profile.tick_overhead if layout.stage > 1
           else layout.num_microbatches * profile.microbatch_overhead)
  head = head_seconds(spec, layout, profile, shape.tokens)
  pipeline = makespan + layout.num_microbatches * head + fixed
  held = shape.held * spec.param_bytes
  data = _data_time(spec, layout, profile, held,
                    layout.stages_per_rank * shape.slots)
  view = shape.view / (layout.data if layout.zero_stage else 1)
  update = UPDATE_PASSES * view * spec.param_bytes / profile.hbm_bandwidth
  if mem is None and profile.first_touch_bandwidth:
    mem = memory(spec, layout, batch=batch)
  alloc = (alloc_seconds(mem, profile, pipelined=layout.stage > 1)
           if mem is not None else 0.0)
  return StepTime(pipeline, data, update, max(bubble, 0.0), blocks, alloc)
