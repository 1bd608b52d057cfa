"""The named state of the executor's tick scan (``_tick_scan.run``).

What one rank holds while it scans the tick table: the fixed inputs
(``Rank``, ``Avals``, ``ScanConfig``), one tick's row (``TickRow``: every
rank's ``TickCell``), the scan carry (``Carry``: mailbox, stashes,
``Accumulators``, ``Edge``, the ``ModelState``), a block's view
(``BlockState``) and the result (``Result``). NamedTuples, so the scan
carries them as pytrees and a reader sees what each field is.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from jaxpar.pipeline.executor._microbatches import LossFn
from jaxpar.pipeline.executor._options import Embedding, StepOptions
from jaxpar.pipeline.executor._stage_vjp import StageVJP
from jaxpar.pipeline.schedules import KIND_CODES, TickTable

PyTree = Any


class TickCell(NamedTuple):
  """One rank's cell of a tick row of the tick table (in ``TickRow.ranks``
  each field is ``[p, ...]``, every rank's cell). ``-1`` means none: idle,
  no mailbox read (stage 0's batch), no message received over an offset."""
  kind: Any          # F, B, I, W (the table's codes) or idle
  block: Any         # index into ``ScanConfig.kinds`` (``blocks``), -1 idle
  stage: Any         # logical stage
  microbatch: Any
  local_stage: Any   # index into the rank's ``local_params`` (``[v, ...]``)
  read_slot: Any     # mailbox slot of the input (-1: the batch)
  stash_slot: Any
  weight_slot: Any
  recv_slot: Any     # ``[K]``: where a message over offset k lands
  hold_slot: Any = None   # where the output is held, not sent (-1: sent);
                          # ``None`` when the table holds none
  recv_held: Any = None   # ``[K, H]``: where the sender's held message h,
                          # sent over offset k, lands


class TickRow(NamedTuple):
  """One tick of the table: the ``xs`` of the scan."""
  ranks: TickCell      # every rank's cell
  message: Any         # the tick's message pattern (``messages``)
  pending_slot: Any    # the pending slot of the result row done now
  summed_rows: Any     # ``[p]``: each pending slot's row if summed now


class ScanConfig(NamedTuple):
  """What the tick table and the options fix before tracing."""
  table: TickTable
  kinds: tuple[tuple[int, bool, bool], ...]   # the blocks present (``blocks``)
  patterns: tuple[tuple[int, ...], ...]       # message patterns (``messages``)
  stage_axis: str                             # the pipeline axis
  bubble_fill: float
  training: bool
  embedding: bool   # stage 0 embeds the raw microbatch (an ``Embedding``)
  input_grads: bool = True   # training computes stage 0's input cotangents

  @property
  def split(self) -> bool:
    """The table has ``I`` (and ``W``) blocks: a weight stash is held.
    Without, the backward runs as ``B`` blocks and there is none."""
    return any(kind == KIND_CODES['I'] for kind, _, _ in self.kinds)

  @property
  def holds(self) -> bool:
    """The table holds messages back (``TickTable.hold_slot``): a hold
    buffer is carried and bundles are sent. Without, neither exists."""
    return self.table.num_hold_slots > 0

  @property
  def with_edge(self) -> bool:
    """A batch-sized result, summed ``p`` rows at a time (``edge_rows``):
    stage 0's input cotangents (forward only: the outputs); none with
    an embedding or without ``input_grads``."""
    return not self.embedding and (self.input_grads or not self.training)


class ModelState(NamedTuple):
  """Model state that is not a parameter (BatchNorm's running statistics),
  passed from each microbatch's ``F`` to the next: the stages' (each ``F``
  of a stage), the embedding's (stage 0's ``F``) and the loss's (the last
  stage's ``F``); ``None`` where that part has none."""
  stages: PyTree = None   # ``[v, ...]``: this rank's stages
  embed: PyTree = None    # the embedding's (valid on stage 0's rank)
  head: PyTree = None     # the loss's (valid on the last stage's rank)
  seen: PyTree = None     # ``[num_stash_slots, ...]``: the ``embed`` state
                          # each of stage 0's ``F`` saw (in the carry only),
                          # for the embedding its ``B``/``I`` recompute


class Rank(NamedTuple):
  """One rank's view of the step, the same on every tick: its index on the
  pipeline axis, its inputs (the params cast to vary over that axis), the
  user's functions (``stage``: ``stage_fn`` cut into blocks) and the
  step's options."""
  index: jax.Array            # ``axis_index`` over the pipeline axis
  stage: StageVJP
  loss_fn: LossFn | None      # ``None``: forward only
  embedding: Embedding | None   # the layer stage 0 runs first, if any
  local_params: PyTree        # ``[v, ...]``: this rank's stages
  loss_params: PyTree
  inputs: PyTree              # ``[m, mb, ...]`` (raw with an embedding)
  targets: PyTree             # leaves ``[m, mb, ...]``
  options: StepOptions        # its key and microbatch_offset, has_aux
  num_microbatches: int
  num_stages: int
  state: ModelState = ModelState()   # the model state before the step


class Avals(NamedTuple):
  """Types of what the blocks produce (``_avals``)."""
  act: PyTree             # an activation or its cotangent, one microbatch
  act_vma: frozenset[str]   # the mesh axes activations vary over
  stash: Any              # one stash slot: ``F``'s residuals
  kept: Any = None        # what ``I`` keeps for ``W`` (``ScanConfig.split``)
  dstage: Any = None      # one stage's parameter gradient
  value: Any = None       # ``(loss, aux)`` of one microbatch
  dhead: Any = None       # ``loss_params``' gradient


class Accumulators(NamedTuple):
  """What the training blocks add to, from zeros, over the ticks."""
  stages: PyTree   # ``[v, ...]``: ``local_params``' gradient (``B``, ``W``)
  value: PyTree    # ``(loss, aux)``: each microbatch's share, ``/ m``
  head: PyTree     # ``loss_params``' gradient (the last stage's ``F``)
  embed: PyTree    # ``embed_params``' gradient (stage 0's ``B`` or ``I``)


class Edge(NamedTuple):
  """The batch-sized result being written (``ScanConfig.with_edge``); each
  leaf like the activation's."""
  pending: PyTree   # ``[p, mb, ...]``: rows done, waiting for their psum
  result: PyTree    # ``[m, mb, ...]``: the output, written row by row


class Carry(NamedTuple):
  """The scan's carry: the rank's buffers, updated in place every tick."""
  mailbox: PyTree      # ``[num_mailbox_slots + 1, mb, ...]``; the last is spare
  stash: PyTree        # ``[num_stash_slots, ...]``: ``F``'s residuals
  wstash: PyTree       # ``kept`` ``[num_weight_slots, ...]``: I for W
                       # (``None`` unless ``ScanConfig.split``)
  acc: Accumulators | None   # training only
  edge: Edge | None
  state: ModelState = ModelState()   # the model state so far
  held: PyTree = None  # ``[num_hold_slots + 1, mb, ...]``: messages held
                       # back (``ScanConfig.holds``); the last is spare


class BlockState(NamedTuple):
  """What a block reads and updates in place (the carry of its ``when``)."""
  payload: PyTree      # what the rank sends this tick (``bubble_fill``: none)
  acc: Accumulators | None
  stash: PyTree
  wstash: PyTree       # ``None`` in ``F`` and ``B``, which do not carry it
  state: ModelState = ModelState()   # the model state (``F`` updates it)


class Result(NamedTuple):
  """``run``'s result when training; all but ``stages`` (and ``state``)
  summed over the pipeline axis."""
  value: PyTree              # ``(loss, aux)``, ``aux`` ``()`` without has_aux
  stages: PyTree             # ``[v, ...]``: ``local_params``' gradient
  head: PyTree               # ``loss_params``' gradient
  inputs: PyTree             # ``[m, mb, ...]``: ``None`` with an embedding
  embed: PyTree              # ``embed_params``' gradient, ``None`` without
  state: ModelState = ModelState()   # the model state after the step (no
                                     # ``seen``): ``stages`` this rank's,
                                     # ``embed``, ``head`` on every rank
