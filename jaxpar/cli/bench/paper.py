"""Section ``paper``: published Llama 3 layouts beside the planner's picks.

``python -m jaxpar bench --only paper`` (nothing compiled, nothing run:
minutes of planning, most of them the 8,192-GPU plan). For each published
run -- torchtitan's Llama-3-8B FSDP 8 and Llama-3-70B FSDP 32 x TP 8,
Meta's Llama-3-405B TP 8 x PP 16 x DP 64 -- the rows give the planner's
prediction of that layout (``planner.memory``, ``planner.step_time`` on
``'H100-SXM'``, 80 GiB) at the remat policies and microbatch counts it
allows, those that fit first, the fastest first, and the planner's own
pick (``jaxpar.plan``) for the same model, devices and batch.
``tokens/s/GPU`` and ``TFLOP/s/GPU`` (model FLOPs: 3 x the forward's
matmuls and attention) are the predicted step's; ``published`` is the
run's own figure. ``docs/planning.md`` ("On paper")
explains where they differ.
"""

from __future__ import annotations

from typing import NamedTuple

import jaxpar
from jaxpar import planner
from jaxpar.planner import Layout, ModelSpec

GIB = 2.0**30
PROFILE = 'H100-SXM'


def llama(size: str) -> ModelSpec:
  """Llama 3 (3.1) 8B, 70B or 405B at sequence 8192, as ``ModelSpec``."""
  d, layers, heads, ffn = {'8B': (4096, 32, 32, 14336),
                           '70B': (8192, 80, 64, 28672),
                           '405B': (16384, 126, 128, 53248)}[size]
  return ModelSpec.llama(d_model=d, num_layers=layers, num_heads=heads,
                         num_kv_heads=8, ffn=ffn, vocab_size=128256,
                         seq_len=8192, name=f'Llama-3-{size}')


class Published(NamedTuple):
  """A published run: its model, devices, global batch, layouts and figure."""
  spec: ModelSpec
  devices: int
  batch: int
  source: str
  layouts: tuple[Layout, ...]
  figure: str
  where: object = None


def published() -> tuple[Published, ...]:
  """The three runs (docs/planning.md, "On paper", has the sources)."""
  fsdp8 = tuple(Layout(8, 1, 1, 'one_f_one_b', m, 3, r)
                for m in (1, 2, 4) for r in ('nothing', 'dots'))
  fsdp_tp = tuple(Layout(32, 1, 8, 'one_f_one_b', m, 3, r)
                  for m in (4, 16) for r in ('nothing', 'dots'))
  # The paper's data parallelism is FSDP (it shards params, optimizer
  # state and gradients): jaxpar's ZeRO-3; ZeRO-1 beside it for contrast.
  meta = tuple(Layout(64, 16, 8, name, 32, zero, r, v)
               for zero in (3, 1)
               for name, v in (('one_f_one_b', 1),
                               ('interleaved_one_f_one_b', 2),
                               ('interleaved_one_f_one_b', 4))
               for r in ('nothing', 'dots', 'everything')) + (
                   Layout(64, 16, 8, 'one_f_one_b', 32, 3, 'dots',
                          w_recompute=True),)
  return (
      Published(llama('8B'), 8, 32, 'torchtitan FSDP 8 (ZeRO-3)', fsdp8,
                '5,762 tokens/s/GPU (local batch 2, 96 GB H100s)'),
      Published(llama('70B'), 256, 512, 'torchtitan FSDP 32 x TP 8', fsdp_tp,
                '829 tokens/s/GPU (Float8, torch.compile)',
                lambda x: x.tensor == 8),
      Published(llama('405B'), 8192, 2048,
                'Llama 3: TP 8 x PP 16 x DP 64 (FSDP), interleaved 1F1B',
                meta, '430 TFLOP/s/GPU, ~12.5 s/step',
                lambda x: x.tensor == 8 and x.stage in (8, 16) and
                x.zero_stage in (1, 3)))


def _row(run: Published, who: str, layout: Layout) -> dict:
  spec, profile = run.spec, planner.PROFILES[PROFILE]
  mem = planner.memory(spec, layout, batch=run.batch)
  time = planner.step_time(spec, layout, batch=run.batch, profile=profile)
  tokens = run.batch * spec.seq_len / time.total / layout.devices
  return {'model': spec.name, 'who': who, 'layout': layout.describe(),
          'GiB/GPU': mem.total / GIB, 'fits': mem.total <= profile.memory_bytes,
          'stash GiB': mem.stash / GIB, 'work GiB': mem.work / GIB,
          'step s': time.total, 'bubble': time.bubble,
          'tokens/s/GPU': tokens,
          'TFLOP/s/GPU': spec.flops_per_token() * tokens / 1e12,
          'published': run.figure if who != 'planner' else ''}


def _pick(case: Published) -> Layout:
  """The planner's best layout, or where none fits 80 GiB its smallest."""
  plan = lambda cap: jaxpar.plan(case.spec, batch=case.batch,
                                 devices=case.devices, profile=PROFILE,
                                 max_microbatches=32, where=case.where,
                                 memory_per_device=cap)
  try:
    return plan(None).best.layout
  except ValueError:    # nothing fits: the smallest need
    every = plan(2.0**60).candidates
    return min(every, key=lambda c: c.memory_bytes).layout


def run(*, quick: bool) -> dict[str, list[dict]]:
  """The ``paper`` section (``quick`` changes nothing: nothing is timed)."""
  del quick
  rows = []
  for case in published():
    mine = sorted((_row(case, case.source, x) for x in case.layouts),
                  key=lambda r: (not r['fits'], -r['tokens/s/GPU']))
    rows += mine
    rows.append(_row(case, 'planner', _pick(case)))
  return {'paper': rows}
