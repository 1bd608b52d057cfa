"""Bytes per device of a layout's training step: ``Memory``, ``memory``.

What one device holds at the peak of a ``parallel.trainer`` step: its
compiled ``memory_analysis()``'s arguments + outputs + temporaries - the
outputs aliased to arguments (``_compile.held_bytes``; the step donates
nothing, so its outputs -- the new state -- are buffers of their own, and
XLA parks some of its temporaries in them before they are written):

* **arguments**: the params (``tensor``- and ``stage``-split; over ``data``
  too with ZeRO-3), the optimizer state (split like the per-layer view:
  over ``tensor`` and ``stage``; over ``data`` too with ZeRO-1/3,
  ``zero_split``) and the replica's batch, from the element counts: ZeRO
  pads a leaf ``data`` does not divide (``padding``), the view's leaves
  stay whole over a ``stage`` that divides none of their dims, and a
  block's leaves whole over ``data`` where ``stage`` and ``tensor`` > 1
  take their dims;
* **stash**: the schedule's stash slots (``TickTable.num_stash_slots``)
  times one logical stage's stash for one microbatch (remat policy, in the
  compute dtype; with ``tensor`` > 1 split over it, as Megatron's sequence
  parallelism stores it), its weight-gradient slots times what ``I``
  keeps for ``W`` (none where the table runs fused ``B`` blocks, none with
  ``w_recompute``) and its mailbox slots times an activation; one stage
  rank (``stage=1``) runs its microbatches in turn: one stash, no slots;
* **work**: the gradient accumulators (the params held; over ``data``
  too with ZeRO-3; each microbatch's gradient is added in place), live
  through the step, but for those in the outputs (below), plus the larger
  of two phases. The **backward**: ZeRO-3's gathered params (two layers in
  the compute dtype -- the one in use and the next -- the embedding or
  head, and one layer's gradient whole until its reduce-scatter), one
  microbatch's logits, their float32 copy and their gradient, and the
  backward's recompute (``recompute_bytes``: the policy applies layer by
  layer, so one layer's residuals, and in the tick scan each layer's input
  and saves rebuilt for the stage). The **update**: without ZeRO it runs
  in place, in the output buffers it writes: nothing beyond them; with
  ZeRO and a pipeline the gradients moved to the per-layer view and the
  updates (``UPDATE`` times the view's bytes, over ``data``) beside the
  tick scan's slots; with one stage rank and ZeRO nothing beyond the
  outputs either, except for a model whose ``tensor`` axis XLA
  partitions, at ``tensor`` > 1: XLA moves the split gradients to ZeRO's
  layout through whole leaves (the blocks' params whole, after the stash
  is freed);
* **outputs**: the new state, params + optimizer state again (the step
  does not donate its state). Without ZeRO the gradient accumulators live
  in them (``parked_grads``). XLA parks some of the backward's
  temporaries there too where one fits a buffer and its liveness allows
  (many small microbatches: stash slots) -- not counted: the model is
  over where XLA parks those (``docs/planning.md``, "Where it does not
  hold yet").

In the tick scan the backward holds more under 'nothing' and 'everything'
(``TICK_WORKING``; a stash stored split under 'nothing':
``TICK_WORKING_SPLIT_NOTHING``, and with more than one weight slot ``I``'s
``kept`` built beside them, ``_builds_kept_apart``); under 'everything',
where the table has more than one
stash slot or runs ``B`` fused, a copy of the slot's residuals (that
``W`` re-runs ``I`` on with ``w_recompute``), but none with one slot and
``B`` split (``_copies_a_slot``, ``_everything_bytes``).
``MARGIN`` covers what the compiled step
holds beyond those (XLA's copies, the collectives' buffers): ``work`` is
the above times ``1 + MARGIN``. On 6, 8 and 12 simulated CPU devices the
test's sample, one candidate of each kind, is predicted 0.95-1.15x its
compiled step's peak (``tests/test_planner_memory.py``; the exceptions,
all over, in ``docs/planning.md``, "Where it does not hold yet"); 60
drawn at random are not yet (0.945-1.30: "A random sample is not in the
band yet"). Where the
devices are present the planner compiles one step per distinct stage shape
of its best candidates and replaces ``work`` by what the compiler reports
(``Memory.calibrated``); the schedule- and ZeRO-dependent parts stay
analytic.

Example:
  >>> from jaxpar.models import gpt
  >>> from jaxpar.planner import Layout, ModelSpec, memory
  >>> spec = ModelSpec.from_gpt(gpt.GPTConfig(d_model=32, num_layers=4,
  ...                                         vocab_size=64))
  >>> mem = memory(spec, Layout(2, 2, 2, 'one_f_one_b', 4), batch=16)
  >>> mem.params, mem.opt_state        # bytes per device
  (62208, 113792)
"""

from __future__ import annotations

from typing import NamedTuple

from jaxpar.pipeline import KIND_CODES
from jaxpar.planner._layout import Layout, schedule_key, tick_table
from jaxpar.planner._model import ModelSpec, slots

# ZeRO's update temporaries in units of the per-layer view's bytes: the
# gradients moved to the view and the updates, over ``data`` (Adam's new
# moments are the step's outputs).
UPDATE = 2
# ZeRO-3 gathers a scanned stack one layer at a time: the layer in use and
# the next one (XLA overlaps the next gather with the layer's compute).
GATHERED_LAYERS = 2
# The backward's working set for the layer it is in, as a share of that
# layer's 'everything' residuals (fitted to compiled CPU steps).
WORKING = 0.3
# In the tick scan (``stage`` > 1) the stage's backward holds more of its
# layers' 'everything' residuals than ``WORKING`` under 'nothing' (each
# layer is recomputed whole) and 'everything': the extra share per layer of
# the stage, by policy and ZeRO stage; with ZeRO-3 per stage, not per layer
# (its gathers take the peak's place). Fitted to compiled CPU steps of the
# NNX Llama, its tied variant and a BatchNorm model (``docs/planning.md``).
TICK_WORKING = {'nothing': {0: 0.45, 1: 0.45, 3: 0.4},
                'everything': {0: 0.45, 1: 0.45, 3: 0.45}}
# The same under 'nothing' for a stash the executor stores split
# (``stash_split``: jaxpar's GPT and the on-paper specs), by whether ``I``
# hands ``W`` what it keeps (``B`` split, without ``w_recompute``): the
# GPT at the CLI's sizes on 2 devices holds 1.25-1.5 of a layer's
# 'everything' in the backward over 4 layers then (1F1B m=4, 8), 0.7-1.0
# otherwise (GPipe m=4, 8, fused; ZB-H1 m=4 with ``w_recompute``), against
# 0.3 + 4 x 0.45 = 2.1 counted with ``TICK_WORKING``. Not with ZeRO-3,
# whose per-stage share (its gathers take the peak's place) was not measured
# on the GPT.
TICK_WORKING_SPLIT_NOTHING = {True: 0.3, False: 0.15}
# With ``w_recompute`` (under 'nothing' and 'dots') the ``W`` of a stage
# holds this share of *one layer's* ``kept`` beyond what ``I`` holds at its
# peak: ``W`` scans the stage's layers and frees each layer's cotangents as
# its gradient is done. Measured as the compiled step with ``w_recompute``
# against the same layout without it, less the weight slots it frees (the
# NNX Llama on 8 devices, ZB-H1: 0.56 at 1x4x2 m=2 'nothing', 0.52 at 1x2x4
# m=1 'dots', 0.68 at 2x2x2 m=1 'nothing'; 0.8 of the *stage's* ``kept``
# before, 1.13-1.48x those steps). Under 'everything' it is counted from
# the blocks' buffers instead (``_everything_bytes``).
W_RECOMPUTE_KEPT = 0.6
# DualPipeV's compiled step holds about half a weight slot (``kept``) more
# than its tick table counts (measured on the three models above; V-Half,
# with the same slots, does not).
DUALPIPE_V_WEIGHT_SLOTS = 0.5
# What compiled steps hold beyond the parts modelled, as a share of them
# (``docs/planning.md``, "Memory per device").
MARGIN = 0.05


class Memory(NamedTuple):
  """Bytes one device holds in a step, by part.

  Attributes:
    params, opt_state, batch: the step's arguments.
    stash: activation stashes, weight-gradient stashes and messages.
    work: the gradients, and the larger of the backward's transients
      (gathered params, logits, recompute) and the update's temporaries.
    outputs: the new state the step returns (params + optimizer state).
  """
  params: int
  opt_state: int
  batch: int
  stash: int
  work: int
  outputs: int = 0

  @property
  def total(self) -> int:
    """All of it: arguments + temporaries + outputs."""
    return (self.params + self.opt_state + self.batch + self.stash
            + self.work + self.outputs)

  @property
  def fresh(self) -> int:
    """What a step allocates afresh each call: temporaries + outputs."""
    return self.stash + self.work + self.outputs

  def calibrated(self, work: int) -> 'Memory':
    """The same with ``work`` as a compiled step reports it."""
    return self._replace(work=int(work))


class Shapes(NamedTuple):
  """Per-device element counts of a layout that memory and time share."""
  held: float          # params of the stages and embed/head (no ZeRO)
  stage: float         # params of the rank's stage slots
  view: float          # all params / (tensor * stage): the optimizer's view
  tokens: int          # tokens per microbatch
  microbatch: int      # sequences per microbatch
  slots: int           # block slots per logical stage


def shapes(spec: ModelSpec, layout: Layout, batch: int) -> Shapes:
  """The element counts ``memory`` and the time model use."""
  t, s = layout.tensor, layout.stage
  n_slots = slots(spec.num_layers, layout.num_stages)
  stage = layout.stages_per_rank * n_slots * spec.layer.per_device(t)
  sides = spec.embed.per_device(t) + spec.head.per_device(t)
  total = spec.num_layers * spec.layer.per_device(t) + sides
  mb = batch // (layout.data * layout.num_microbatches)
  # The view's leaves split over ``stage`` along a dim it divides (none:
  # replicated; counted on the model's width).
  view = total / (s if spec.d_model % s == 0 else 1)
  return Shapes(stage + sides, stage, view, mb * spec.seq_len, mb, n_slots)


def padding(spec: ModelSpec, data: int) -> float:
  """What ZeRO's padding adds to a leaf split over ``data``: a leaf that
  ``data`` does not divide is stored padded to a multiple of it
  (``data_parallel.Padded``); counted on a dim of the model's width,
  ``ceil(d_model / data) * data / d_model`` (1 where ``data`` divides it;
  an upper bound for the leaves split along a wider dim)."""
  return -(-spec.d_model // data) * data / spec.d_model


def zero_split(spec: ModelSpec, layout: Layout, shape: Shapes) -> float:
  """How many times ZeRO splits the optimizer's view over ``data``: ``data``
  over its padding (``padding``), but in a model cut by ``from_nnx`` (2-D
  kernels) where ``tensor`` > 1 and ``stage`` splits the view, ZeRO finds
  no free dim in a block's leaves (one is ``stage``'s, the other
  ``tensor``'s) and, where ``data`` divides neither split dim (a width
  of ``d_model`` over ``stage x data`` or ``tensor x data``), keeps them
  whole on every ``data`` rank (``data_parallel.data_spec``): only the
  embedding and head are split (jaxpar's GPT splits: its leaves have a
  dim left). 1 without ZeRO."""
  d = layout.data
  if not layout.zero_stage or d == 1:
    return 1.0
  split = d / padding(spec, d)
  s, t, width = layout.stage, layout.tensor, spec.d_model
  if (t == 1 or s == 1 or width % s or spec.stash_split
      or not width % (s * d) or not width % (t * d)):
    return split
  layers = spec.num_layers * spec.layer.per_device(t) / s
  return shape.view / (layers + (shape.view - layers) / split)


def stash_bytes(spec: ModelSpec, layout: Layout, shape: Shapes) -> int:
  """Stash, weight-gradient stash and mailbox bytes of one rank.

  One stash slot: the logical stage's stash under the remat policy and its
  input, split over ``tensor``; one weight slot: what ``I`` keeps for
  ``W`` (nothing with ``w_recompute``); one mailbox slot: an activation.
  With one stage rank the microbatches run in turn: one stash, no slots,
  and the policy applied layer by layer stashes each layer's input too,
  and what the layers replicate over ``tensor`` whole (``_row_parallel``).
  """
  t, cb, policy = layout.tensor, spec.act_bytes, layout.remat_policy
  act = shape.tokens * spec.d_model * cb
  split = t if spec.stash_split else 1
  per_layer = spec.stash_per_device(policy, t)
  if layout.stage == 1:   # the layers' own saves: replicated ones whole
    inputs = spec.d_model if policy != 'everything' else 0
    whole = _row_parallel(spec, t) if policy != 'nothing' else 0.0
    return int(shape.slots * (per_layer + inputs + whole) * shape.tokens * cb
               + act)
  stash = shape.slots * per_layer * shape.tokens * cb + act / split
  table = tick_table(schedule_key(layout))
  kept = 0.0 if layout.w_recompute else (
      shape.slots * spec.kept.per_device(t) * shape.tokens * cb)
  weight_slots = table.num_weight_slots + (
      DUALPIPE_V_WEIGHT_SLOTS if layout.schedule_name == 'dualpipe_v' else 0)
  return int(table.num_stash_slots * stash + weight_slots * kept
             + (table.num_mailbox_slots + 1) * act)


def recompute_bytes(spec: ModelSpec, layout: Layout, shape: Shapes) -> int:
  """The backward's transient of one logical stage for one microbatch.

  The policy applies layer by layer (``executor._remat.remat_layers``):
  the backward recomputes one layer at a time, holding ``WORKING`` of that
  layer's ``'everything'`` residuals. In the tick scan the stage is also
  checkpointed as a whole (its stash is the policy's saves of the stage),
  so its backward first rebuilds each layer's input and saves, stacked
  over the stage's layers; what the stash stores split over ``tensor``
  although the layers replicate it (a block's two row-parallel outputs,
  ``2 d``) is all-gathered whole first; where a rank holds more than one
  microbatch per stage (``_copies_a_slot``) XLA reads the slot's saves
  into a buffer of their own too in a model cut by ``from_nnx`` (the tied
  Llama's 6x2x1 1F1B m=2 ``'dots'``: 0.875 of its compiled peak without,
  0.977 with), not in jaxpar's GPT (``stash_split``: its stash stored
  split by the executor; at the CLI's sizes on 2 devices, nine pipelined
  ``'dots'`` layouts were 1.04-1.24 of their compiled peaks with the copy,
  0.95-1.12 without) but where a rank runs more than one chunk of more
  than one layer fused (interleaved 1F1B ``'dots'`` at 2 layers a chunk,
  m=4-32: 0.941-0.957 without, 0.980-1.037 with; its XLA buffer report
  holds one slot's row of each save; at 1 layer a chunk 0.965-0.996
  without). With
  ``w_recompute`` a ``W`` rebuilds what ``I`` would have kept for it one
  layer at a time: ``W_RECOMPUTE_KEPT`` of one layer's ``kept``; where ``I``
  builds its ``kept`` apart (``_builds_kept_apart``), one slot's. Under
  ``'everything'`` in the tick scan see ``_everything_bytes``.
  """
  t, policy = layout.tensor, layout.remat_policy
  if layout.stage > 1 and policy == 'everything':
    return int(_everything_bytes(spec, layout, shape) * shape.tokens
               * spec.act_bytes)
  # one rank's layers hold their working set whole over ``tensor`` where
  # the model replicates activations by its own psums (``stash_split``)
  everything = spec.stash_of('everything').per_device(
      1 if layout.stage == 1 and spec.stash_split else t)
  restacked = 0.0
  if layout.stage > 1:
    restacked = shape.slots * (spec.stash_per_device(policy, t)
                               + _row_parallel(spec, t)
                               + spec.d_model)
    if _copies_a_slot(layout) and (not spec.stash_split or (
        _runs_fused(layout) and layout.stages_per_rank > 1
        and shape.slots > 1)):
      restacked += shape.slots * spec.stash_per_device(policy, t)
  if layout.w_recompute:   # W rebuilds what I kept, a layer at a time
    restacked += W_RECOMPUTE_KEPT * spec.kept.per_device(t)
  if _builds_kept_apart(spec, layout):
    restacked += shape.slots * spec.kept.per_device(t)
  working = WORKING
  if layout.stage > 1:
    per = 1 if layout.zero_stage == 3 else shape.slots
    tick = TICK_WORKING.get(policy, {}).get(layout.zero_stage, 0)
    if spec.stash_split and policy == 'nothing' and layout.zero_stage != 3:
      tick = TICK_WORKING_SPLIT_NOTHING[_hands_kept(layout)]
    working += per * tick
  return int((restacked + working * everything) * shape.tokens
             * spec.act_bytes)


def _builds_kept_apart(spec: ModelSpec, layout: Layout) -> bool:
  """Whether ``I`` builds what it keeps for ``W`` in a buffer of its own
  before writing it to a weight slot: under ``'nothing'`` (``I`` re-runs
  the stage's forward), with ``B`` split and more than one weight slot,
  in a stash the executor stores split (jaxpar's GPT); with one slot XLA
  writes it in the slot in place. The GPT at the CLI's sizes on 2
  devices: ZB-H1 m=4 (two slots) holds one slot's ``kept`` beside the
  slots in the XLA buffer report, 1F1B m=4 (one slot) none; ZB-H1 m=2-16
  and the V schedules at m=2-8 were 0.84-0.98 of their compiled peaks
  without it, 0.95-1.09 with it; under ``'dots'`` none (ZB-H1 m=2-8:
  1.035-1.046 without)."""
  return (layout.stage > 1 and layout.remat_policy == 'nothing'
          and spec.stash_split and _hands_kept(layout)
          and tick_table(schedule_key(layout)).num_weight_slots > 1)


def _hands_kept(layout: Layout) -> bool:
  """Whether ``I`` hands ``W`` what it keeps: ``B`` split, without
  ``w_recompute``."""
  return not layout.w_recompute and not _runs_fused(layout)


def _row_parallel(spec: ModelSpec, t: int) -> float:
  """Elements per token of a block's two row-parallel outputs (``2 d``)
  beyond the ``1 / t`` of them a stash split over ``tensor`` counts: the
  layers replicate them (one rank runs its layers' own saves; the tick
  scan's backward gathers them whole), where the spec splits its stash
  (``stash_split``). jaxpar's GPT at the CLI's sizes, 1x1x2 ``'dots'``,
  compiled: two ``[layers, tokens, d]`` saves of the stage (the XLA
  buffer report)."""
  return 2 * spec.d_model * (1 - 1 / t) if spec.stash_split else 0.0


def _copies_a_slot(layout: Layout) -> bool:
  """Whether XLA reads a stash slot's row into a buffer of its own beside
  the stash: where the tick scan holds more than one microbatch's stash
  per logical stage of a rank (more stash slots than stages), or runs
  ``B`` fused (one backward of the stage over the row); with one slot
  and ``B`` split into ``I`` and ``W`` it works on the stash in place.
  One microbatch under ``'everything'``, compiled (the NNX Llama on 8
  devices): GPipe and 1F1B, fused, 0.851-0.899 of the peak without the
  copy and 1.095-1.11 with it; ZB-H1, split, 1.04-1.06 without. Not with
  ``w_recompute`` (DualPipeV m=1 ``'dots'``, fused: 1.246 with it)."""
  table = tick_table(schedule_key(layout))
  return bool(table.num_stash_slots > layout.stages_per_rank
              or _runs_fused(layout))


def _runs_fused(layout: Layout) -> bool:
  """Whether the layout's tick table runs ``B`` fused (not ``I`` and ``W``)
  and without ``w_recompute``."""
  table = tick_table(schedule_key(layout))
  return not layout.w_recompute and bool(
      (table.kind == KIND_CODES['B']).any())


def _everything_bytes(spec: ModelSpec, layout: Layout,
                      shape: Shapes) -> float:
  """Per token: the tick scan's backward under ``'everything'`` (``stage``
  > 1), where the stash holds every residual and nothing is recomputed.

  ``F`` writes a microbatch's residuals to a stash slot and ``I`` and
  ``W`` read them from it (``put``/``rows``: a dynamic update and slice
  of the stash's slot dim). Where the table has more than one stash slot
  XLA builds and reads that row in a buffer of its own beside the stash
  (the compiled steps hold it: at m=2 a whole slot's residuals); with one
  slot (one microbatch in flight per logical stage, m=1) the row is the
  whole stash and split ``I`` and ``W`` work on it in place: no copy (a
  fused ``B`` still copies it, ``_copies_a_slot``). Without
  ``w_recompute`` ``I`` and ``W`` read the row layer by layer, holding
  ``TICK_WORKING`` of a layer's residuals per layer of the stage where it
  is copied (fitted to compiled steps). With it ``W`` re-runs ``I``'s
  chain on the whole row, scanning the stage's layers: the copy (one stash
  slot) and, layer by layer, one layer's ``kept`` (the NNX Llama's 2x2x2
  ZB-H1: 0.78 of a layer's residuals beyond its stash at m=1, 2.6 at m=2,
  where a slot is 2 and a layer's ``kept`` 0.64). A fused ``B`` over a
  stash the executor stores split (jaxpar's GPT, ``stash_split``) copies
  the whole slot instead: at the CLI's sizes on 2 devices GPipe m=2 and
  m=8 and 1F1B m=2 were 0.82-0.94 of their compiled peaks with the
  per-layer share, 0.98-1.00 with the slot. So does a rank of more than
  one chunk at one slot a chunk (the V schedules at m=1, split or fused:
  the chunk's row read at an index known at run time): V-Half, ZB-V and
  DualPipeV m=1 with ``w_recompute`` 0.76 of their compiled peaks
  without it, V-Half m=1 without ``w_recompute`` 0.815.
  """
  t = layout.tensor
  everything = spec.stash_of('everything').per_device(t)
  copied = _copies_a_slot(layout)
  # one slot a chunk of a rank of several, read at a chunk known only at
  # run time, over a split stash: XLA reads the whole row into a copy
  row = spec.stash_split and layout.stages_per_rank > 1 and not copied
  if layout.w_recompute:
    split = t if spec.stash_split else 1
    slot = shape.slots * everything + spec.d_model / split
    return (WORKING * everything + spec.kept.per_device(t)
            + (copied or row) * slot)
  if spec.stash_split and (_runs_fused(layout) or row):
    return (WORKING + shape.slots) * everything
  per = 1 if layout.zero_stage == 3 else shape.slots
  extra = TICK_WORKING['everything'][layout.zero_stage] if copied else 0.0
  return (WORKING + per * extra) * everything


def work_bytes(spec: ModelSpec, layout: Layout,
               shape: Shapes) -> dict[str, int]:
  """The parts of ``Memory.work`` (before the peak and ``MARGIN``), by
  name."""
  pb, cb, d, zero = spec.param_bytes, spec.act_bytes, layout.data, (
      layout.zero_stage)
  t = layout.tensor
  split3 = d / padding(spec, d) if zero == 3 else 1
  gathered = 0.0
  if zero == 3:
    sides = max(spec.embed.per_device(t), spec.head.per_device(t))
    layers = min(GATHERED_LAYERS, shape.slots)
    # the layers gathered, and the one whose gradient the backward is
    # reduce-scattering (whole until it is scattered)
    gathered = ((layers + 1) * spec.layer.per_device(t) + sides) * cb
  # without ZeRO the update runs in place, in the output buffers it
  # writes; with ZeRO beside them (the reduce-scatter and the slice's update)
  update = UPDATE * shape.view * pb / (d / padding(spec, d)) if (
      zero and layout.stage > 1) else 0.0
  if layout.stage == 1 and zero and t > 1 and not spec.stash_split:
    # XLA moves the tensor-split gradients of a model it partitions to
    # ZeRO's layout through whole stacked leaves (its "involuntary full
    # rematerialization"): the blocks' params, whole, at once.
    update = max(update, spec.num_layers * sum(spec.layer) * pb)
  return {
      'grads': int(shape.held * pb / split3),
      'gathered': int(gathered),
      'update': int(update),
      'logits': int(shape.tokens * spec.vocab_size / t * (2 * cb + 4)),
      'recompute': recompute_bytes(spec, layout, shape)}


def parked_grads(spec: ModelSpec, layout: Layout) -> bool:
  """Whether XLA keeps the gradient accumulators in the output buffers of
  the new params: without ZeRO they have the params' leaves and the update
  writes each new leaf over its gradient (with ZeRO they are reduce-
  scattered first), but not under ``'everything'`` or ``'nothing'``,
  where the compiled steps keep them in temporaries (under
  ``'everything'`` the backward's residuals take the outputs' buffers;
  under ``'nothing'`` jaxpar's GPT on 2 devices, data parallel m=1-32,
  held 0.82-0.87 of its compiled peak parked, 0.94-1.01 not: measured,
  ``docs/planning.md``), nor with one stage rank split over ``tensor``
  (jaxpar's GPT at 1x1x2 ``'dots'``: the gradients of its layers are
  ``[1, 1, layers, ...]`` temporaries in the XLA buffer report), nor where
  a rank holds more than two chunks of one layer each (interleaved
  ``'dots'`` on 2 devices: the GPT's 8 layers at v=4, m=4 / 8 / 32, 0.965
  / 0.961 / 0.904 of the compiled peak parked, 1.022 / 1.046 / 1.032 not;
  16 layers at v=8, m=8, 0.938 and 1.027; the buffer report holds the
  ``[4, 1, ...]`` gradient accumulators as temporaries. Two chunks of one
  layer, 4 layers at v=2, and chunks of two layers, 16 at v=4, park:
  1.005 and 1.018), nor with ``w_recompute`` on a rank of one chunk (the
  GPT's ZB-H1 ``'dots'`` at the CLI's sizes, m=4 / 8 / 16 / 32: 0.994 /
  0.986 / 0.944 / 0.946 parked, 1.044 / 1.064 / 1.047 / 1.074 not; its
  buffer report holds ``[1, 4, ...]`` gradient-shaped temporaries)."""
  one_layer_chunks = spec.num_layers == layout.num_stages
  chunks = layout.stages_per_rank
  return not layout.zero_stage and layout.remat_policy not in (
      'everything', 'nothing') and not (
          layout.stage == 1 and layout.tensor > 1) and not (
              one_layer_chunks and chunks > 2) and not (
                  layout.w_recompute and chunks == 1)


def memory(spec: ModelSpec, layout: Layout, *, batch: int,
           opt_factor: float = 2.0) -> Memory:
  """Predicted bytes per device of ``layout``'s step (see the module doc).

  Args:
    spec: the model.
    layout: the layout.
    batch: global batch (sequences).
    opt_factor: optimizer-state bytes per param byte (Adam: 2).
  """
  shape = shapes(spec, layout, batch)
  pb, d, zero = spec.param_bytes, layout.data, layout.zero_stage
  split = d / padding(spec, d)     # ZeRO's split, padded
  params = shape.held * pb / (split if zero == 3 else 1)
  opt = opt_factor * shape.view * pb / zero_split(spec, layout, shape)
  ids = 2 * (batch // d) * spec.seq_len * 4
  parts = work_bytes(spec, layout, shape)
  stash = stash_bytes(spec, layout, shape)
  backward = parts['gathered'] + parts['logits'] + parts['recompute']
  update = parts['update'] - (stash if layout.stage == 1 else 0)
  grads = 0 if parked_grads(spec, layout) else parts['grads']
  return Memory(int(params), int(opt), ids, stash, int(
      (grads + max(backward, update)) * (1 + MARGIN)),
                int(params) + int(opt))
