"""The planner's memory model (``planner.memory``) against compiled steps.

What it counts follows what the executor does (fused ``B`` keeps nothing
for ``W``, ``w_recompute`` keeps nothing, ZeRO-3 gathers a layer at a
time, the stash is split over ``tensor``). With default arguments, on 6, 8
and 12 simulated CPU devices, an NNX Llama (``tests/llama.py``), the same
with its head tied to the embedding and a BatchNorm model, each planned
over all its layouts (750-2000 candidates): the candidates the plan
compiled and a deterministic sample of the rest that covers ``KINDS``
(every schedule family, ZeRO stage, remat policy, ``tensor`` > 1, many
microbatches, ``w_recompute``, an uneven cut; compiling all would take
hours) are never more than 5% under what a device holds at their compiled
step's peak (arguments + outputs + temporaries, ``_compile.held_bytes``)
nor more than 15% over (``OVER``: one combination of
kinds known to be over, documented).

Run as a script (``python tests/test_planner_memory.py 12``) it prints the
ratios on 12 devices as JSON: the test starts it for 12, since the suite's
process has 8. With ``--random K`` it prints those of ``K`` candidates drawn
at random instead (``random_ratios``).
"""

import functools
import json
import os
import subprocess
import sys
from unittest import mock

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jaxpar
import llama
from jaxpar import planner
from jaxpar.models import gpt
from jaxpar.planner import Layout, _compile, _layout, _memory

# Four layers: logical stages of one and of two layers.
CONFIG = gpt.GPTConfig(vocab_size=32, seq_len=16, d_model=32, num_heads=4,
                       num_layers=4)
BATCH = 16
SPEC = planner.ModelSpec.from_gpt(CONFIG)
# The flags this process compiles with (conftest.py gives the processes a
# test starts other ones): the 12-device child compiles as this one does.
XLA_FLAGS = os.environ.get('XLA_FLAGS', '')
LLAMA = planner.ModelSpec.llama(d_model=4096, num_layers=32, num_heads=32,
                                num_kv_heads=8, ffn=14336, vocab_size=128256,
                                seq_len=8192)


def _kept_bytes(spec, layout, batch):
  """What one weight slot holds under ``layout`` (``I`` -> ``W``)."""
  shape = _memory.shapes(spec, layout, batch)
  return (shape.slots * spec.kept.per_device(layout.tensor) * shape.tokens
          * spec.act_bytes)


def test_a_fused_backward_keeps_nothing_for_w():
  """Interleaved 1F1B at p = 4 runs ``B`` fused: its stash is its stash
  slots and messages alone; ZB-H1 adds its weight slots' ``kept``, which
  ``w_recompute`` empties."""
  x = Layout(1, 4, 1, 'interleaved_one_f_one_b', 8, virtual_stages=2)
  table = jaxpar.pipeline.tick_table(x.schedule())
  assert table.num_weight_slots == 0 and _memory._runs_fused(x)
  zb = Layout(1, 2, 1, 'zero_bubble_h1', 4)
  slots = jaxpar.pipeline.tick_table(zb.schedule()).num_weight_slots
  shape = _memory.shapes(SPEC, zb, BATCH)
  with_kept = _memory.stash_bytes(SPEC, zb, shape)
  without = _memory.stash_bytes(SPEC, zb._replace(w_recompute=True), shape)
  assert slots > 0 and with_kept - without == pytest.approx(
      slots * _kept_bytes(SPEC, zb, BATCH), abs=slots)


def test_one_stash_slot_is_read_in_place_by_a_split_backward():
  """Under 'everything' a tick table with more than one stash slot makes
  XLA copy a slot's residuals out of the stash; with one (m=1) and ``B``
  split it works on the stash in place: per token, ZB-H1's backward with
  ``w_recompute`` holds one stash slot (its layers' residuals and its
  input) more at m=2 than at m=1, and without ``w_recompute`` no
  ``TICK_WORKING`` at m=1; a fused ``B`` (interleaved 1F1B at p = 4)
  holds it."""
  def per_token(m, w_recompute):
    x = Layout(1, 2, 1, 'zero_bubble_h1', m, 0, 'everything',
               w_recompute=w_recompute)
    shape = _memory.shapes(LLAMA, x, 64)
    return (_memory.recompute_bytes(LLAMA, x, shape)
            / (shape.tokens * LLAMA.act_bytes)), shape.slots
  (one, slots), (two, _) = per_token(1, True), per_token(2, True)
  slot = slots * LLAMA.stash_per_device('everything', 1) + LLAMA.d_model
  assert two - one == pytest.approx(slot, rel=1e-6)
  everything = LLAMA.stash_of('everything').per_device(1)
  assert per_token(1, False)[0] == pytest.approx(_memory.WORKING * everything,
                                                 rel=1e-6)
  # A fused B reads the slot into a buffer of its own all the same: layer
  # by layer in a model cut by from_nnx, the whole slot where the executor
  # stores the stash split.
  fused = Layout(1, 4, 1, 'interleaved_one_f_one_b', 8, 0, 'everything',
                 virtual_stages=2)
  assert _memory._runs_fused(fused)
  shape = _memory.shapes(LLAMA, fused, 64)
  extra = _memory.TICK_WORKING['everything'][0] * shape.slots
  for spec, copied in ((LLAMA._replace(stash_split=False), extra),
                       (LLAMA, shape.slots)):
    assert (_memory.recompute_bytes(spec, fused, shape)
            / (shape.tokens * spec.act_bytes)) == pytest.approx(
                (_memory.WORKING + copied) * everything, rel=1e-6)


@pytest.mark.parametrize('mlp_ratio', [2, 4])
def test_gpts_stash_counts_are_what_its_stage_saves(mlp_ratio):
  """``ModelSpec.from_gpt``'s stash per token and layer under 'dots',
  'dots_no_batch' and 'nothing' is what ``StageVJP`` saves for the GPT's
  stage (less its input), at MLP widths ``2 d`` and ``4 d``."""
  config = CONFIG._replace(d_model=64, num_heads=4, mlp_ratio=mlp_ratio)
  pp, _ = gpt.split_for_pipeline(gpt.gpt_params(
      gpt.GPT(config, rngs=nnx.Rngs(0))), num_stages=1)
  stage = jax.tree.map(lambda a: a[0], pp.stages)
  mesh = jaxpar.make_mesh(tensor=1, devices=jax.devices()[:1])
  specs = jaxpar.tensor_parallel.param_specs(stage, rules=gpt.TENSOR_RULES)
  x = np.zeros((2, config.seq_len, config.d_model), np.float32)
  size = lambda tree: sum(a.size for a in jax.tree.leaves(tree))
  saved = {}

  def trace(params, x):
    for policy in ('dots', 'dots_no_batch', 'nothing'):
      stash = jaxpar.pipeline.StageVJP(gpt.stage_fn, policy).trace(
          params, x, None, None)[1]
      saved[policy] = (size(stash) - x.size) / (x.size // config.d_model
                                                * config.num_layers)
    return x
  stage = jaxpar.tensor_parallel.shard_params(stage, mesh=mesh,
                                              rules=gpt.TENSOR_RULES)
  jax.shard_map(trace, mesh=mesh, in_specs=(specs, P()), out_specs=P())(
      stage, x)
  spec = planner.ModelSpec.from_gpt(config)
  assert saved == {p: spec.stash_per_device(p, 1) for p in saved}


def test_gpts_fused_backward_under_everything_copies_the_whole_slot(
    monkeypatch):
  """jaxpar's GPT stores its stash split (``stash_split``); under
  'everything' its fused ``B`` (GPipe at m=2 laid out with fused ``B``'s:
  ``tick_table(..., backward='fused')`` in the trainer and the model)
  reads the whole stash slot into a buffer of its own: predicted within 5%
  under and 15% over the compiled step (0.84 with the Llama's per-layer
  share of the slot)."""
  fused = functools.partial(jaxpar.pipeline.tick_table, backward='fused')
  monkeypatch.setattr(jaxpar.parallel._config, 'tick_table', fused)
  monkeypatch.setattr(_memory, 'tick_table',
                      lambda key: fused(_layout._schedule(*key)))
  src = planner._source.source(CONFIG, blocks='', embed=None,
                               head_loss=None, inputs=None)
  x = Layout(1, 2, 1, 'gpipe', 2, 0, 'everything')
  assert _memory._runs_fused(x)
  compiled = _compile.step_bytes(src, jax.devices()[:2], x,
                                 optax.adam(1e-3), BATCH)
  predicted = _memory.memory(src.spec, x, batch=BATCH).total
  assert 0.95 <= predicted / compiled <= _limit(x), (predicted, compiled)


@pytest.mark.parametrize('policy', ['dots', 'nothing', 'everything'])
def test_one_rank_of_gpts_tensor_split_layers_holds_what_they_replicate(
    policy):
  """jaxpar's GPT at 1x1x2 (one stage rank, ``tensor`` = 2): its layers'
  own saves keep the two row-parallel outputs whole, their backward's
  working set too (the GPT's own psums replicate them), and the gradients
  are not parked in the outputs: predicted within 5% under and 15% over
  the compiled step (0.83-0.90 before, counted split over ``tensor``)."""
  src = planner._source.source(CONFIG, blocks='', embed=None,
                               head_loss=None, inputs=None)
  x = Layout(1, 1, 2, 'one_f_one_b', 1, 0, policy)
  compiled = _compile.step_bytes(src, jax.devices()[:2], x,
                                 optax.adam(1e-3), BATCH)
  predicted = _memory.memory(src.spec, x, batch=BATCH).total
  assert 0.95 <= predicted / compiled <= _limit(x), (predicted, compiled)


@pytest.mark.parametrize('x', [
    Layout(1, 2, 1, 'interleaved_one_f_one_b', 4, 0, 'dots',
           virtual_stages=2),
    Layout(1, 2, 1, 'v_half', 1, 0, 'everything', w_recompute=True)],
                         ids=['interleaved-dots', 'v_half-m1-everything'])
def test_gpts_chunks_copy_a_slot_row(x):
  """jaxpar's GPT, a rank of two chunks of two layers: XLA reads a stash
  slot's row into buffers of its own, as 1F1B's and GPipe's GPT steps do
  not: interleaved 1F1B under ``'dots'`` (0.941 of the compiled peak
  without it) and the V schedules at one slot a chunk (m=1) under
  ``'everything'`` (0.76 at the CLI's sizes)."""
  config = CONFIG._replace(vocab_size=64, seq_len=32, d_model=64,
                           num_layers=8)
  src = planner._source.source(config, blocks='', embed=None,
                               head_loss=None, inputs=None)
  compiled = _compile.step_bytes(src, jax.devices()[:2], x,
                                 optax.adam(1e-3), 32)
  predicted = _memory.memory(src.spec, x, batch=32).total
  assert 0.95 <= predicted / compiled <= _limit(x), (predicted, compiled)


@pytest.mark.parametrize('x, parks', [
    (Layout(1, 2, 1, 'interleaved_one_f_one_b', 32, 0, 'dots',
            virtual_stages=4),
     Layout(1, 2, 1, 'interleaved_one_f_one_b', 32, 0, 'dots',
            virtual_stages=2)),
    (Layout(1, 2, 1, 'zero_bubble_h1', 32, 0, 'dots', w_recompute=True),
     Layout(1, 2, 1, 'zero_bubble_h1', 32, 0, 'dots'))],
                         ids=['four-one-layer-chunks', 'zb-h1-w-recompute'])
def test_gpts_gradients_held_apart_from_the_new_params(x, parks):
  """jaxpar's GPT at the plan CLI's sizes, m=32 under ``'dots'``: with four
  chunks of one layer a rank, or ``w_recompute`` on a rank of one chunk,
  XLA holds the gradient accumulators as temporaries, not in the new
  params' buffers (0.904 and 0.946 of the compiled peak counted parked);
  two chunks of four layers, or ZB-H1 without ``w_recompute``, park them."""
  config = gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=256,
                         num_heads=8, num_layers=8)
  src = planner._source.source(config, blocks='', embed=None,
                               head_loss=None, inputs=None)
  assert not _memory.parked_grads(src.spec, x)
  assert _memory.parked_grads(src.spec, parks)
  compiled = _compile.step_bytes(src, jax.devices()[:2], x,
                                 optax.adam(1e-3), 64)
  predicted = _memory.memory(src.spec, x, batch=64).total
  assert 0.95 <= predicted / compiled <= _limit(x), (predicted, compiled)


@pytest.mark.parametrize('schedule', ['zero_bubble_h1', 'v_half', 'gpipe'])
def test_gpts_input_grad_builds_its_kept_apart_under_nothing(schedule):
  """jaxpar's GPT under ``'nothing'`` at m=4 (8 layers of width 64): with
  more than one weight slot ``I`` builds what it keeps for ``W`` in a
  buffer of its own (ZB-H1 and V-Half: 0.919 and 0.911 of the compiled
  peak without it), and a fused ``B`` holds less of its layers' residuals
  than a split one (GPipe: 1.42 with ``TICK_WORKING``)."""
  config = CONFIG._replace(vocab_size=64, seq_len=32, d_model=64,
                           num_layers=8)
  src = planner._source.source(config, blocks='', embed=None,
                               head_loss=None, inputs=None)
  x = Layout(1, 2, 1, schedule, 4, 0, 'nothing')
  assert _memory._builds_kept_apart(src.spec, x) == (schedule != 'gpipe')
  compiled = _compile.step_bytes(src, jax.devices()[:2], x,
                                 optax.adam(1e-3), 32)
  predicted = _memory.memory(src.spec, x, batch=32).total
  assert 0.95 <= predicted / compiled <= _limit(x), (predicted, compiled)


def test_zero3_gathers_two_layers_and_the_stash_splits_over_tensor():
  """ZeRO-3's gathered params do not grow with the layers of a stage (two
  layers in the compute dtype, and one layer's gradient before its
  reduce-scatter); with ``tensor`` = 8 the stash per token and
  layer is an eighth of ``tensor`` = 1's (Llama-3-8B, ``'dots'``: 92 KiB at
  ``t`` = 1, 11.5 KiB at ``t`` = 8, under Megatron's ``34 h / t``: 17 KiB)."""
  gathered = [_memory.work_bytes(LLAMA, Layout(8, s, 1, 'gpipe', 8, 3),
                                 _memory.shapes(LLAMA, Layout(
                                     8, s, 1, 'gpipe', 8, 3), 64))['gathered']
              for s in (1, 2, 4)]
  assert len(set(gathered)) == 1
  assert gathered[0] == (3 * LLAMA.layer.per_device(1) + max(
      LLAMA.embed.per_device(1), LLAMA.head.per_device(1))) * 2
  per_token = [LLAMA.stash_per_device('dots', t) * LLAMA.act_bytes
               for t in (1, 8)]
  assert per_token == [94208.0, 11776.0]
  assert per_token[1] < 34 * 4096 / 8


def test_zero_splits_the_optimizer_view_where_data_divides_no_dim():
  """3 x 2 x 1 on 6 devices, width 32 (3 divides no dim): ZeRO-1 stores
  Adam's moments of every layer padded over ``data`` (before, the per-layer
  view's dims named by a ``tensor`` axis of size 1 kept them whole on each
  ``data`` rank), as ``memory`` counts them."""
  layout = Layout(3, 2, 1, 'one_f_one_b', 2, 1)
  plan = jaxpar.plan(CONFIG, batch=24, devices=jax.devices()[:6],
                     profile='H100-SXM', compile=0,
                     where=lambda x: _key(x) == _key(layout))
  trainer = plan.trainer(optax.adam(1e-3))
  held = jaxpar.data_parallel.bytes_per_device(trainer.init(plan.params()))
  # 2.3x before; 1.07x now (the heads' dim of 8 pads to 9 where
  # ``_memory.padding`` counts the model's width, 32 to 33)
  assert (0.95 * plan.best.memory.opt_state <= held.opt_state
          <= 1.1 * plan.best.memory.opt_state)


# -------------------------------------------- against compiled steps

SEQ, ROWS = 16, 24     # 24 sequences: 6, 8 and 12 replicas divide them
LLAMA_CONFIG = llama.Config(vocab=64, dim=32, heads=4, hidden=64, layers=4,
                            annotate=True)


class _NormedBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.BatchNorm(32, use_running_average=False, rngs=rngs)
    self.up = nnx.Linear(32, 64, rngs=rngs)
    self.down = nnx.Linear(64, 32, rngs=rngs)

  def __call__(self, x):
    return x + self.down(jax.nn.gelu(self.up(self.norm(x))))


class _NormedNet(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(64, 32, rngs=rngs)
    self.layers = nnx.List([_NormedBlock(nnx.Rngs(i)) for i in range(4)])
    self.head = nnx.Linear(32, 64, rngs=rngs)


def _model(name: str) -> dict:
  """``plan`` keywords of one of the three models."""
  embed = lambda m, x: m.embed(x)
  if name == 'batchnorm':
    return dict(model=_NormedNet(nnx.Rngs(2)), blocks='layers', embed=embed,
                head_loss=lambda m, y, t: llama.xent(m.head(y), t))
  with nnx.use_eager_sharding(False):
    model = llama.Llama(LLAMA_CONFIG, nnx.Rngs(0))
  if name == 'llama':
    return dict(model=model, blocks='blocks', embed=embed,
                head_loss=lambda m, y, t: llama.xent(
                    m.head(m.final_norm(y)), t))
  del model.head    # the logits are the embedding's transpose
  return dict(model=model, blocks='blocks', embed=embed,
              head_loss=lambda m, y, t: llama.xent(
                  m.embed.attend(m.final_norm(y)), t))


# What the sample of a plan's candidates must include, per device count
# and model: each kind once, so that the three plans together hold every
# schedule family, ZeRO stage, remat policy, ``tensor`` > 1, many (>= 8)
# microbatches, ``w_recompute`` and an uneven cut (4 layers on 3 ranks).
KINDS = {
    6: ('batchnorm', ('GPipe', 'ZeRO-3', 'nothing', 'uneven', 'many')),
    8: ('llama', ('zero bubble', 'V', 'everything', 'w_recompute', 'tensor',
                  'ZeRO-0')),
    12: ('tied', ('1F1B', 'interleaved', 'ZeRO-1', 'tensor', 'many')),
}
FAMILY = {'gpipe': 'GPipe', 'one_f_one_b': '1F1B',
          'interleaved_one_f_one_b': 'interleaved',
          'zero_bubble_h1': 'zero bubble', 'zero_bubble_v': 'V',
          'v_half': 'V', 'v_min': 'V', 'dualpipe_v': 'V'}
# Where the analytic model is known to be more than 15% over the peak
# (never under; ``docs/planning.md``, "Where it does not hold yet"), by the
# kinds a candidate has all of: many one-sequence microbatches on a cut
# that ``stage`` does not divide (the BatchNorm model's 2x3x1 GPipe m=12:
# 1.15 with ZeRO-1 'dots', 1.19 with ZeRO-3 'nothing': XLA parks the
# gradient accumulators, ZeRO-3's gathered params and activations in the
# new state's buffers, as far as their sizes fit, which the model does not
# follow).
OVER = ((frozenset({'many', 'uneven'}), 1.25),)


def _limit(x: Layout) -> float:
  """The most a candidate's prediction may be over its compiled step."""
  kinds = _kinds(x)
  return max([1.15] + [high for need, high in OVER if need <= kinds])


def _key(x: Layout) -> tuple:
  return (x.data, x.stage, x.tensor, x.schedule_name, x.num_microbatches,
          x.zero_stage, x.remat_policy, x.w_recompute)


def _kinds(x: Layout, layers: int = 4) -> set[str]:
  """The kinds of a layout that the sample covers."""
  return {'data parallel' if x.stage == 1 else FAMILY[x.schedule_name],
          f'ZeRO-{x.zero_stage}', x.remat_policy,
          *(['tensor'] if x.tensor > 1 else []),
          *(['many'] if x.num_microbatches >= 8 else []),
          *(['w_recompute'] if x.w_recompute else []),
          *(['uneven'] if layers % x.num_stages else [])}


def sample(candidates, kinds) -> list:
  """The candidates the plan compiled, then, in plan order, the first that
  covers most of ``kinds`` not yet covered, until all are: deterministic
  (the plan's order) and at most ``len(kinds)`` more compiles."""
  chosen = [c for c in candidates if c.compiled]
  todo = set(kinds)
  while todo:
    best = max(candidates, key=lambda c: len(_kinds(c.layout) & todo))
    if not _kinds(best.layout) & todo:
      raise AssertionError(f'no candidate of kinds {sorted(todo)}')
    chosen.append(best)
    todo -= _kinds(best.layout)
  return chosen


def _batch() -> tuple[np.ndarray, np.ndarray]:
  """The plans' batch: ``ROWS`` sequences of ``SEQ`` token ids and their
  next tokens (seed 0)."""
  ids = np.random.default_rng(0).integers(0, 64, (ROWS, SEQ + 1))
  return ids[:, :-1].astype(np.int32), ids[:, 1:].astype(np.int32)


def ratios(n: int) -> dict[str, tuple[float, float]]:
  """``(ratio, its _limit)``: predicted over compiled bytes (the peak,
  ``_compile.held_bytes``) of the ``sample`` of the candidates that
  ``plan`` returns with default arguments (its compiles included) for
  ``KINDS[n]``'s model on ``n`` devices; each step compiled once."""
  batch = _batch()
  compiled, step_bytes = {}, _compile.step_bytes

  def once(src, devices, layout, optimizer, batch):
    if layout not in compiled:
      compiled[layout] = step_bytes(src, devices, layout, optimizer, batch)
    return compiled[layout]
  name, kinds = KINDS[n]
  with mock.patch.object(_compile, 'step_bytes', once):
    plan = jaxpar.plan(**_model(name), optimizer=optax.adam(1e-3),
                       batch=batch, devices=jax.devices()[:n],
                       profile='H100-SXM')
    return {f'{name} {c.layout.describe()}': (c.memory_bytes / once(
        plan.source, plan.devices, c.layout, optax.adam(1e-3), batch),
                                             _limit(c.layout))
            for c in sample(plan.candidates, kinds)}


def test_memory_within_5_percent_under_and_15_over_on_6_8_and_12_devices():
  """The sample of the candidates ``plan`` returns for the three models on
  6, 8 and 12 devices (12 in a process of its own) is predicted at
  0.95-1.15x its compiled step (up to ``OVER`` for the combination of
  kinds known over)."""
  env = {**os.environ, 'PYTHONPATH': os.pathsep.join(
      [os.path.dirname(os.path.dirname(__file__)), os.path.dirname(__file__),
       os.environ.get('PYTHONPATH', '')]), 'XLA_FLAGS': XLA_FLAGS}
  twelve = subprocess.Popen([sys.executable, __file__, '12'], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
  got = {n: ratios(n) for n in (6, 8)}
  out, err = twelve.communicate(timeout=900)
  assert twelve.returncode == 0, err[-3000:]
  got[12] = json.loads(out.splitlines()[-1])
  bad = {(n, k): round(r, 3) for n, rs in got.items()
         for k, (r, high) in rs.items() if not 0.95 <= r <= high}
  assert all(got.values()) and not bad, (bad, got)


def random_ratios(n: int, k: int, seed: int = 0) -> dict[str, float]:
  """Predicted over compiled bytes of ``k`` candidates drawn at random
  (``seed``) from the plan of ``KINDS[n]``'s model on ``n`` devices,
  analytic (``compile=0``): the sample the band does not hold for yet
  (``docs/planning.md``, "A random sample is not in the band yet")."""
  batch = _batch()
  plan = jaxpar.plan(**_model(KINDS[n][0]), optimizer=optax.adam(1e-3),
                     batch=batch, devices=jax.devices()[:n],
                     profile='H100-SXM', compile=0)
  rng = np.random.default_rng(seed)
  picks = rng.choice(len(plan.candidates), min(k, len(plan.candidates)),
                     replace=False)
  return {c.layout.describe(): c.memory_bytes / _compile.step_bytes(
      plan.source, plan.devices, c.layout, optax.adam(1e-3), batch)
          for c in (plan.candidates[i] for i in picks)}


if __name__ == '__main__':
  # python tests/test_planner_memory.py N [--random K]
  jax.config.update('jax_num_cpu_devices', int(sys.argv[1]))
  jax.config.update('jax_platforms', 'cpu')
  if '--random' in sys.argv:
    print(json.dumps(random_ratios(
        int(sys.argv[1]), int(sys.argv[sys.argv.index('--random') + 1]))))
  else:
    print(json.dumps(ratios(int(sys.argv[1]))))
