"""The planner's analytic memory model (``planner.memory``): what it counts
follows what the executor does (fused ``B`` keeps nothing for ``W``,
``w_recompute`` keeps nothing, ZeRO-3 gathers a layer at a time, the stash
is split over ``tensor``), and no candidate is predicted more than 5% under
its compiled step on 8 simulated CPU devices."""

import jax
import numpy as np
import optax
import pytest

import jaxpar
from jaxpar import planner
from jaxpar.models import gpt
from jaxpar.planner import Layout, _compile, _memory

# Four layers: logical stages of one and of two layers.
CONFIG = gpt.GPTConfig(vocab_size=32, seq_len=16, d_model=32, num_heads=4,
                       num_layers=4)
BATCH = 16
SPEC = planner.ModelSpec.from_gpt(CONFIG)
LLAMA = planner.ModelSpec.llama(d_model=4096, num_layers=32, num_heads=32,
                                num_kv_heads=8, ffn=14336, vocab_size=128256,
                                seq_len=8192)


def _kept_bytes(spec, layout, batch):
  """What one weight slot holds under ``layout`` (``I`` -> ``W``)."""
  shape = _memory.shapes(spec, layout, batch)
  return (shape.slots * spec.kept.per_device(layout.tensor) * shape.tokens
          * spec.act_bytes)


def test_a_fused_backward_keeps_nothing_for_w():
  """GPipe and interleaved 1F1B run ``B`` fused: their stash is their stash
  slots and messages alone; ZB-H1 adds its weight slots' ``kept``, which
  ``w_recompute`` empties."""
  for name, v in (('gpipe', 1), ('interleaved_one_f_one_b', 2)):
    x = Layout(1, 2, 1, name, 4, virtual_stages=v)
    table = jaxpar.pipeline.tick_table(x.schedule())
    assert table.num_weight_slots == 0
  zb = Layout(1, 2, 1, 'zero_bubble_h1', 4)
  slots = jaxpar.pipeline.tick_table(zb.schedule()).num_weight_slots
  shape = _memory.shapes(SPEC, zb, BATCH)
  with_kept = _memory.stash_bytes(SPEC, zb, shape)
  without = _memory.stash_bytes(SPEC, zb._replace(w_recompute=True), shape)
  assert slots > 0 and with_kept - without == pytest.approx(
      slots * _kept_bytes(SPEC, zb, BATCH), abs=slots)


def test_zero3_gathers_two_layers_and_the_stash_splits_over_tensor():
  """ZeRO-3's gathered params do not grow with the layers of a stage (two
  layers in the compute dtype); with ``tensor`` = 8 the stash per token and
  layer is an eighth of ``tensor`` = 1's (Llama-3-8B, ``'dots'``: 92 KiB at
  ``t`` = 1, 11.5 KiB at ``t`` = 8, under Megatron's ``34 h / t``: 17 KiB)."""
  gathered = [_memory.work_bytes(LLAMA, Layout(8, s, 1, 'gpipe', 8, 3),
                                 _memory.shapes(LLAMA, Layout(
                                     8, s, 1, 'gpipe', 8, 3), 64))['gathered']
              for s in (1, 2, 4)]
  assert len(set(gathered)) == 1
  assert gathered[0] == (2 * LLAMA.layer.per_device(1) + max(
      LLAMA.embed.per_device(1), LLAMA.head.per_device(1))) * 2
  per_token = [LLAMA.stash_per_device('dots', t) * LLAMA.act_bytes
               for t in (1, 8)]
  assert per_token == [94208.0, 11776.0]
  assert per_token[1] < 34 * 4096 / 8


def test_memory_never_more_than_5_percent_under_compiled():
  """One candidate of each mechanism -- one stage rank (remat layer by
  layer), ZeRO-3 with a fused ``B`` (GPipe), tensor 2 with 1F1B's
  ``I``/``W``, ZB-H1's weight slots with and without ``w_recompute`` --
  predicted at least 0.95x the bytes its compiled step reports (arguments
  + temporaries), and at most 1.5x."""
  chosen = {
      (8, 1, 1, 'one_f_one_b', 1, 'nothing', False),
      (2, 4, 1, 'gpipe', 3, 'dots', False),
      (2, 2, 2, 'one_f_one_b', 1, 'dots', False),
      (4, 2, 1, 'zero_bubble_h1', 0, 'everything', False),
      (4, 2, 1, 'zero_bubble_h1', 0, 'everything', True)}
  key = lambda x: (x.data, x.stage, x.tensor, x.schedule_name,
                   x.zero_stage, x.remat_policy, x.w_recompute)
  plan = jaxpar.plan(CONFIG, batch=BATCH, devices=jax.devices(),
                     profile='H100-SXM', compile=0, where=lambda x: (
                         x.num_microbatches == 2 and key(x) in chosen))
  assert {key(c.layout) for c in plan.candidates} == chosen
  ids = np.zeros((BATCH, CONFIG.seq_len), np.int32)
  ratios = {}
  for c in plan.candidates:
    got = _compile.step_bytes(plan.source, jax.devices(), c.layout,
                              optax.adam(1e-3), (ids, ids))
    ratios[c.layout.describe()] = c.memory_bytes / got
  assert all(0.95 <= r <= 1.5 for r in ratios.values()), ratios
