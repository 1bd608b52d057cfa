"""Bytes per device of a layout's training step: ``Memory``, ``memory``.

What one device holds during a ``parallel.trainer`` step (what its compiled
``memory_analysis()`` reports as arguments + temporaries):

* **arguments**: the params (``tensor``- and ``stage``-split; over ``data``
  too with ZeRO-3), the optimizer state (split like the per-layer view:
  over ``tensor`` and ``stage``; over ``data`` too with ZeRO-1/3) and the
  replica's batch; exact from the element counts;
* **stash**: the schedule's stash slots (``TickTable.num_stash_slots``)
  times one logical stage's stash for one microbatch (remat policy), its
  weight-gradient slots and mailbox slots likewise;
* **work**: the gradient accumulators (the params held; over ``data``
  too with ZeRO-3), ZeRO-3's gathered params of one logical stage (in the
  forward and again in the backward), the update's temporaries (the
  per-layer view: ``UPDATE`` times its bytes, over ``data`` with ZeRO) and
  one microbatch's logits and their gradient.

Where the devices are present the planner compiles one step per distinct
stage shape and replaces ``work`` by what the compiler reports
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

from jaxpar.planner._layout import Layout, schedule_key, tick_table
from jaxpar.planner._model import ModelSpec, slots

# The update's temporaries in units of the per-layer view's bytes: the
# gradients moved to the view and the updates (Adam's new moments are the
# step's outputs).
UPDATE = 2


class Memory(NamedTuple):
  """Bytes one device holds in a step, by part.

  Attributes:
    params, opt_state, batch: the step's arguments.
    stash: activation stashes, weight-gradient stashes and messages.
    work: gradients, the update's temporaries, gathered params, logits.
  """
  params: int
  opt_state: int
  batch: int
  stash: int
  work: int

  @property
  def total(self) -> int:
    """All of it: arguments + temporaries."""
    return self.params + self.opt_state + self.batch + self.stash + self.work

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
  return Shapes(stage + sides, stage, total / s, mb * spec.seq_len, mb,
                n_slots)


def stash_bytes(spec: ModelSpec, layout: Layout, shape: Shapes) -> int:
  """Stash, weight-gradient stash and mailbox bytes of one rank."""
  t = layout.tensor
  table = tick_table(schedule_key(layout))
  act = shape.tokens * spec.d_model * spec.act_bytes
  per_layer = spec.stash_of(layout.remat_policy).per_device(t)
  stash = shape.slots * per_layer * shape.tokens * spec.act_bytes + act
  kept = (shape.slots * spec.kept.per_device(t) * shape.tokens
          * spec.act_bytes)
  return int(table.num_stash_slots * stash + table.num_weight_slots * kept
             + (table.num_mailbox_slots + 1) * act)


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
  params = shape.held * pb / (d if zero == 3 else 1)
  opt = opt_factor * shape.view * pb / (d if zero else 1)
  ids = 2 * (batch // d) * spec.seq_len * 4
  logits = (3 * shape.tokens * spec.vocab_size / layout.tensor
            * spec.act_bytes)
  grads = shape.held * pb / (d if zero == 3 else 1)
  gathered = 2 * shape.stage / layout.stages_per_rank * pb if zero == 3 else 0
  update = UPDATE * shape.view * pb / (d if zero else 1)
  work = grads + gathered + update + logits
  return Memory(int(params), int(opt), ids,
                stash_bytes(spec, layout, shape), int(work))
