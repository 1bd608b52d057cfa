"""pipeline_value_and_grad / pipeline_apply: exactly the sequential model, memory flat in m."""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar.cli.bench.pipeline import gpipe_autodiff_step
from jaxpar import pipeline as sch
from jaxpar.pipeline import (PipelineGrads, local_stages, pipeline_apply,
                             pipeline_apply_local, pipeline_value_and_grad,
                             pipeline_value_and_grad_local, ranks_to_stages,
                             stages_to_ranks, tick_table)
from jaxpar.pipeline.executor import _tick_scan
from test_lower import CONSTRUCTORS as SCHEDULES

D, MB, OUT = 8, 2, 3  # width, microbatch size, target width
NAN = float('nan')


def stage_fn(params, x):
  """A residual tanh layer; params is a nested pytree."""
  return x + jnp.tanh(x @ params['w'] + params['b']) * params['gate']['s']


def loss_fn(loss_params, y, target):
  return jnp.mean((y @ loss_params['head'] + loss_params['bias'] - target)**2)


def model(num_stages, batch, dtype=np.float64, seed=0):
  """``(stage_params, loss_params, inputs, targets)`` as numpy arrays."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: rng.normal(size=shape).astype(dtype)
  stages = {'w': f(num_stages, D, D) / math.sqrt(D), 'b': f(num_stages, D),
            'gate': {'s': 1 + f(num_stages) / 4}}
  loss_params = {'head': f(D, OUT), 'bias': f(OUT)}
  return stages, loss_params, f(batch, D), f(batch, OUT)


def sequential_loss(stages, loss_params, inputs, targets, m):
  """The reference: every stage in turn, the loss, the mean over microbatches."""
  num_stages = jax.tree.leaves(stages)[0].shape[0]

  def one(x, t):
    for k in range(num_stages):
      x = stage_fn(jax.tree.map(lambda a, k=k: a[k], stages), x)
    return loss_fn(loss_params, x, t)
  split = lambda a: a.reshape((m, -1) + a.shape[1:])
  return jnp.mean(jax.vmap(one)(split(inputs), split(targets)))


reference = jax.jit(jax.value_and_grad(sequential_loss, argnums=(0, 1, 2)),
                    static_argnums=4)


def assert_exact(got, want, rtol):
  """Loss and every gradient leaf agree to ``rtol`` of the leaf's magnitude."""
  loss, grads = got
  want_loss, want_grads = want
  np.testing.assert_allclose(loss, want_loss, rtol=rtol)
  got_leaves = jax.tree.leaves((grads.stages, grads.head, grads.inputs))
  want_leaves = jax.tree.leaves(want_grads)
  assert len(got_leaves) == len(want_leaves) == 6
  for g, w in zip(got_leaves, want_leaves):
    assert g.shape == w.shape and g.dtype == w.dtype
    np.testing.assert_allclose(g, w, rtol=rtol,
                               atol=rtol * float(np.max(np.abs(w))))


def mesh_for(p):
  return jaxpar.make_mesh(stage=p, devices=jax.devices()[:p])


# Every constructor; p in {1, 2, 4, 8}; m < p, m not a multiple of p;
# with and without remat. Bubbles are filled with NaN throughout.
EXACT = [
    ('1f1b', 1, 3, False), ('1f1b', 2, 3, True), ('1f1b', 4, 2, False),
    ('1f1b', 8, 8, True),
    ('gpipe', 2, 2, True), ('gpipe', 4, 5, False),
    ('interleaved', 1, 2, True), ('interleaved', 2, 4, False),
    ('interleaved', 4, 4, True),
    ('zb_h1', 2, 1, False), ('zb_h1', 4, 6, True),
    ('zero_bubble_v', 1, 2, True), ('zero_bubble_v', 2, 3, False), ('zero_bubble_v', 4, 5, True),
    ('zero_bubble_v', 8, 4, False),
]


@pytest.mark.parametrize('name,p,m,remat', EXACT)
def test_exact_float64(x64, name, p, m, remat):
  schedule = SCHEDULES[name](p, m)
  args = model(schedule.num_stages, m * MB)
  step = pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh_for(p),
                       remat_policy='nothing' if remat else None,
                       bubble_fill=NAN)
  assert_exact(step(*args), reference(*args, m), rtol=1e-10)


def test_exact_float32_on_a_data_parallel_mesh():
  """float32; a mesh with a 'data' axis too (the step replicates over it)."""
  p, m = 4, 4
  schedule = sch.zero_bubble_h1(p, m)
  mesh = jaxpar.make_mesh(data=2, stage=p)
  stages, loss_params, x, t = args = model(p, m * MB, np.float32)
  step = pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh)
  # Arguments placed by the caller (batch split over 'data') work too.
  placed = (jax.device_put(stages, NamedSharding(mesh, P('stage'))),
            loss_params, jax.device_put(x, NamedSharding(mesh, P('data'))), t)
  assert_exact(step(*placed), reference(*args, m), rtol=1e-5)


def test_bubbles_are_inert(x64):
  """NaN in every unwritten slot and idle send changes no bit of the result."""
  schedule = sch.interleaved_one_f_one_b(2, 4, 2)
  args = model(4, 4 * MB)
  nan, zero = (pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule,
                             mesh=mesh_for(2), bubble_fill=fill)(*args)
               for fill in (NAN, 0.0))
  for a, b in zip(jax.tree.leaves(nan), jax.tree.leaves(zero)):
    assert np.all(np.isfinite(a))
    np.testing.assert_array_equal(a, b)


def local_step(table, mesh, *, bubble_fill):
  """``pipeline_value_and_grad_local`` in a shard_map over 'stage' (as pipeline_value_and_grad)."""
  schedule = table.schedule

  def body(params, loss_params, x, t):
    loss, g = pipeline_value_and_grad_local(
        stage_fn, loss_fn, jax.tree.map(lambda a: a[0], params), loss_params,
        x, t, table=table, bubble_fill=bubble_fill)
    return loss, g._replace(stages=jax.tree.map(lambda a: a[None], g.stages))

  sharded = jax.shard_map(body, mesh=mesh, in_specs=(P('stage'), P(), P(), P()),
                          out_specs=(P(), PipelineGrads(P('stage'), P(), P())),
                          axis_names={'stage'})
  return jax.jit(lambda s, *rest: sharded(
      stages_to_ranks(s, schedule), *rest))


def test_nan_fill_exposes_a_bad_table(x64):
  """The NaN test can fail: a table that reads an unwritten slot gives NaN."""
  schedule = sch.one_f_one_b(2, 2)
  low = tick_table(schedule)
  assert low.num_mailbox_slots == 2 and low.read_slot[1, 1] == 0
  bad = low._replace(read_slot=low.read_slot.copy())
  bad.read_slot[1, 1] = 1  # rank 1's first F reads the never-written slot 1
  stages, loss_params, x, t = model(2, 2 * MB)
  for table, finite in ((low, True), (bad, False)):
    loss, *_ = local_step(table, mesh_for(2), bubble_fill=NAN)(
        stages, loss_params, x, t)
    assert bool(np.isfinite(loss)) == finite


def tp_stage_fn(params, x):
  """Megatron MLP: hidden units split over 'tensor', one psum per stage."""
  h = jnp.tanh(x @ params['w1'])
  return x + jax.lax.psum(h @ params['w2'], 'tensor')


def test_composes_with_data_and_tensor_axes(x64):
  """pipeline_value_and_grad_local inside a (data, stage, tensor) shard_map is exact."""
  mesh = jaxpar.make_mesh(data=2, stage=2, tensor=2)
  schedule = sch.zero_bubble_v(2, 3)  # V shape, split backward: psum in F, I and W
  m, n, hidden = 3, schedule.num_stages, 8
  rng = np.random.default_rng(1)
  stages = {'w1': rng.normal(size=(n, D, hidden)) / math.sqrt(D),
            'w2': rng.normal(size=(n, hidden, D)) / math.sqrt(hidden)}
  _, loss_params, x, t = model(n, 2 * m * MB, seed=2)
  table = tick_table(schedule)
  specs = {'w1': P('stage', None, None, 'tensor'),
           'w2': P('stage', None, 'tensor', None)}

  def body(params, loss_params, x, t):
    params = jax.tree.map(lambda a: a[0], params)
    loss, g = pipeline_value_and_grad_local(tp_stage_fn, loss_fn, params, loss_params,
                                  x, t, table=table, bubble_fill=NAN)
    loss, dstages, dloss = jax.lax.pmean((loss, g.stages, g.head), 'data')
    # g.inputs is d(this shard's mean)/dx: 1/2 of it is d(global mean)/dx.
    return (loss, jax.tree.map(lambda a: a[None], dstages), dloss,
            g.inputs / 2)

  step = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(specs, P(), P('data'), P('data')),
      out_specs=(P(), specs, P(), P('data'))))
  put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))
  loss, dstages, dloss, dx = step(
      jax.tree.map(put, stages_to_ranks(stages, schedule), specs),
      put(loss_params, P()), put(x, P('data')), put(t, P('data')))

  def dense(stages, loss_params, inputs, targets):
    def one(x, t):
      for k in range(n):
        x = x + jnp.tanh(x @ stages['w1'][k]) @ stages['w2'][k]
      return loss_fn(loss_params, x, t)
    split = lambda a: a.reshape((2 * m, -1) + a.shape[1:])
    return jnp.mean(jax.vmap(one)(split(inputs), split(targets)))

  want = jax.value_and_grad(dense, argnums=(0, 1, 2))(stages, loss_params, x, t)
  got = (loss, PipelineGrads(
      ranks_to_stages(jax.device_get(dstages), schedule), dloss, dx))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(g, w, rtol=1e-10,
                               atol=1e-10 * float(np.max(np.abs(w))))


@pytest.mark.parametrize('name,p,m', [('1f1b', 4, 6), ('zero_bubble_v', 2, 3),
                                      ('interleaved', 1, 3)])
def test_apply_is_the_sequential_forward(x64, name, p, m):
  schedule = SCHEDULES[name](p, m)
  stages, _, x, _ = model(schedule.num_stages, m * MB)
  y = pipeline_apply(stage_fn, stages, x, schedule=schedule, mesh=mesh_for(p),
                     bubble_fill=NAN)
  want = x
  for k in range(schedule.num_stages):
    want = stage_fn(jax.tree.map(lambda a, k=k: a[k], stages), want)
  np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-12)


def test_placement_round_trip():
  for schedule in (sch.one_f_one_b(4, 4), sch.interleaved_one_f_one_b(2, 2, 3),
                   sch.zero_bubble_v(4, 4)):
    tree = {'a': np.arange(schedule.num_stages * 2).reshape(-1, 2)}
    ranks = stages_to_ranks(tree, schedule)
    assert ranks['a'].shape == (schedule.num_ranks,
                                schedule.num_stages // schedule.num_ranks, 2)
    for r, stages in enumerate(local_stages(schedule)):
      for j, k in enumerate(stages):
        np.testing.assert_array_equal(ranks['a'][r, j], tree['a'][k])
    np.testing.assert_array_equal(ranks_to_stages(ranks, schedule)['a'],
                                  tree['a'])
  ranks = stages_to_ranks(np.arange(4), sch.zero_bubble_v(2, 2))
  np.testing.assert_array_equal(ranks, [[0, 3], [1, 2]])


# --------------------------------------------------------------- memory


def compiled(step, num_stages, m, mb=4, width=32):
  stages = {'w': jnp.zeros((num_stages, width, width)),
            'b': jnp.zeros((num_stages, width)),
            'gate': {'s': jnp.ones(num_stages)}}
  loss_params = {'head': jnp.zeros((width, OUT)), 'bias': jnp.zeros(OUT)}
  args = (stages, loss_params, jnp.zeros((m * mb, width)),
          jnp.zeros((m * mb, OUT)))
  return step.lower(*args).compile()


@pytest.mark.parametrize('name', ['1f1b', 'zb_h1', 'zero_bubble_v'])
def test_memory_and_program_flat_in_m(name):
  """Fixed microbatch size, 8x the microbatches: same scratch, same program.

  No batch-sized buffer in temp memory: the batch's cotangent is written row
  by row into the output (GPipe is left out: it holds ``m`` stashes).
  """
  p = 4
  small, large = (compiled(
      pipeline_value_and_grad(stage_fn, loss_fn, schedule=SCHEDULES[name](p, m),
                    mesh=mesh_for(p)), SCHEDULES[name](p, m).num_stages, m)
      for m in (8, 64))
  mem_s, mem_l = small.memory_analysis(), large.memory_analysis()
  assert mem_l.temp_size_in_bytes <= 1.15 * mem_s.temp_size_in_bytes
  # The batch and its gradient scale with m, as arguments and outputs.
  batch_bytes = (64 - 8) * 4 * 32 * 4  # extra microbatches x mb x width x f32
  assert mem_l.argument_size_in_bytes - mem_s.argument_size_in_bytes == (
      batch_bytes * (32 + OUT) // 32)
  assert mem_l.output_size_in_bytes - mem_s.output_size_in_bytes == batch_bytes
  # Compile time flat in m: the compiled program has the same instructions.
  lines = lambda c: sum(1 for l in c.as_text().splitlines() if ' = ' in l)
  assert abs(lines(large) - lines(small)) <= 0.02 * lines(small)
  # The batch's cotangent is summed p rows at a time (edge_rows), not a row
  # at a time: an all-reduce of [p, mb, width], none of one row.
  text = large.as_text()
  assert re.search(rf'f32\[{p},4,32\]\S* all-reduce\(', text)
  assert not re.search(r'f32\[4,32\]\S* all-reduce\(', text)


@pytest.mark.parametrize('name,p,m', [('1f1b', 4, 8), ('1f1b', 2, 7),
                                      ('zb_h1', 4, 6), ('zero_bubble_v', 2, 5),
                                      ('interleaved', 2, 4), ('gpipe', 3, 3)])
@pytest.mark.parametrize('training', [True, False])
def test_the_result_is_summed_num_ranks_rows_at_a_time(name, p, m, training):
  """Each row of the batch-sized result waits in one of ``p`` pending slots
  until it is summed: ``ceil(m / p)`` sums, every row once, and no slot is
  written again before the sum that reads it."""
  low = tick_table(SCHEDULES[name](p, m), forward_only=not training)
  slot, rows = _tick_scan.edge_rows(low)
  sums = np.flatnonzero((rows < m).any(1))
  assert len(sums) == -(-m // p)
  assert sorted(rows[rows < m]) == list(range(m))
  for t in sums:
    for k, row in enumerate(rows[t]):
      if row == m:
        continue
      written = np.flatnonzero(slot[:t + 1] == k)   # writes of slot k so far
      done = written[-1]                            # the last one is the row's
      at = (low.kind[done] == (_tick_scan.I if training else _tick_scan.F)) & (
          low.stage[done] == (0 if training else low.schedule.num_stages - 1))
      assert (low.microbatch[done][at] == row).all() and at.any()


def test_apply_memory_flat_in_m():
  """The forward pass writes the last stage's outputs into its output too."""
  p, width = 4, 32
  temps = []
  for m in (8, 64):
    apply = pipeline_apply(stage_fn, schedule=sch.one_f_one_b(p, m),
                           mesh=mesh_for(p))
    stages = {'w': jnp.zeros((p, width, width)), 'b': jnp.zeros((p, width)),
              'gate': {'s': jnp.ones(p)}}
    temps.append(jax.jit(apply).lower(stages, jnp.zeros((m * 4, width)))
                 .compile().memory_analysis().temp_size_in_bytes)
  assert temps[1] <= 1.15 * temps[0]


def test_gpipe_by_autodiff_grows_with_m():
  """The contrast: AD through a scan stashes every iteration's activations."""
  p = 4
  temps = [compiled(gpipe_autodiff_step(
      stage_fn, loss_fn, num_microbatches=m, mesh=mesh_for(p)), p, m
                    ).memory_analysis().temp_size_in_bytes for m in (8, 64)]
  assert temps[1] > 4 * temps[0]


def test_gpipe_by_autodiff_is_exact(x64):
  """So the memory comparison is against a correct baseline."""
  p, m = 4, 3
  args = model(p, m * MB)
  loss, grads = gpipe_autodiff_step(stage_fn, loss_fn, num_microbatches=m,
                                    mesh=mesh_for(p))(*args)
  want_loss, want_grads = reference(*args, m)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-10)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)


# --------------------------------------------------------------- errors


def test_errors_before_compiling():
  p, m = 2, 2
  schedule = sch.one_f_one_b(p, m)
  mesh = mesh_for(p)
  stages, loss_params, x, t = model(p, m * MB, np.float32)
  step = pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh)
  bad_stages = jax.tree.map(lambda a: a[:1], stages)
  with pytest.raises(ValueError, match=r"stage_params\['b'\] has shape \(1, "
                     r"\d+\); stage_params\['gate'\]\['s'\] has shape \(1,\); "
                     r"stage_params\['w'\] .*schedule.num_stages=2"):
    step(bad_stages, loss_params, x, t)
  with pytest.raises(ValueError, match='batch size 5 is not divisible.*=2'):
    step(stages, loss_params, np.zeros((5, D), np.float32),
         np.zeros((5, OUT), np.float32))
  with pytest.raises(ValueError, match=r'targets has shape \(2, 3\).*batch size 4'):
    step(stages, loss_params, x, t[:2])
  with pytest.raises(ValueError, match=r'float32\[2, 8\] to float32\[2, 4\]'):
    pipeline_value_and_grad(lambda p_, x: x[:, :4], loss_fn, schedule=schedule,
                  mesh=mesh)(stages, loss_params, x, t)
  with pytest.raises(TypeError, match='must be floating point'):
    step(stages, loss_params, x.astype(np.int32), t)
  with pytest.raises(ValueError, match="axis 'stage' has size 4.*num_ranks=2"):
    pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh_for(4))
  with pytest.raises(ValueError, match="no axis 'pipe'"):
    pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh, axis='pipe')
  with pytest.raises(TypeError, match='schedule must be'):
    pipeline_value_and_grad(stage_fn, loss_fn, schedule='1f1b', mesh=mesh)
  with pytest.raises(TypeError, match='loss_fn must be callable'):
    pipeline_value_and_grad(stage_fn, None, schedule=schedule, mesh=mesh)
  with pytest.raises(TypeError, match='bubble_fill'):
    pipeline_value_and_grad(stage_fn, loss_fn, schedule=schedule, mesh=mesh,
                  bubble_fill='nan')
  with pytest.raises(ValueError, match='stage_params.*num_stages=2'):
    pipeline_apply(stage_fn, bad_stages, x, schedule=schedule, mesh=mesh)
  with pytest.raises(ValueError, match='use pipeline_apply_local'):
    pipeline_value_and_grad_local(stage_fn, loss_fn, stages, loss_params, x, t,
                        table=tick_table(schedule, forward_only=True))
  with pytest.raises(ValueError, match='forward_only=True'):
    pipeline_apply_local(stage_fn, stages, x, table=tick_table(schedule))
  with pytest.raises(TypeError, match='TickTable'):
    pipeline_apply_local(stage_fn, stages, x, table=schedule)
  four = model(4, m * MB, np.float32)[0]
  with pytest.raises(ValueError, match="axis 'stage' has size 4.*num_ranks=2"):
    jax.shard_map(lambda s: pipeline_value_and_grad_local(
        stage_fn, loss_fn, s, loss_params, x, t, table=tick_table(schedule)),
                  mesh=mesh_for(4), in_specs=P('stage'), out_specs=P(),
                  axis_names={'stage'})(four)


def test_apply_and_value_and_grad_have_the_step_shape():
  p, m = 2, 4
  stages, _, x, _ = model(p, m * MB, np.float32)
  schedule = sch.one_f_one_b(p, m)
  apply = pipeline_apply(stage_fn, schedule=schedule, mesh=mesh_for(p))
  np.testing.assert_array_equal(
      apply(stages, x),
      pipeline_apply(stage_fn, stages, x, schedule=schedule, mesh=mesh_for(p)))
  with pytest.raises(TypeError, match='together'):
    pipeline_apply(stage_fn, stages, schedule=schedule, mesh=mesh_for(p))


def test_gpt_3d_step_memory_flat_in_m():
  """parallel.trainer embeds per microbatch inside stage 0: nothing
  batch-sized in temp memory."""
  stages = 2
  from flax import nnx
  import optax
  from jaxpar.models import gpt
  config = gpt.GPTConfig(vocab_size=64, seq_len=16, d_model=32, num_heads=2,
                         num_layers=2)
  params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
  pp, split = gpt.split_for_pipeline(params, num_stages=stages)
  temps = []
  for m in (4, 32):
    trainer = jaxpar.parallel.trainer(
        gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.sgd(0.1),
        schedule=sch.one_f_one_b(stages, m), mesh=mesh_for(stages),
        stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES)
    ids = np.zeros((2 * m, config.seq_len), np.int32)
    temps.append(trainer.step.lower(trainer.init(pp), (ids, ids)).compile()
                 .memory_analysis().temp_size_in_bytes)
  assert temps[1] <= 1.15 * temps[0]  # 1.36x when the batch was embedded


def test_embed_fn_runs_inside_stage_0(x64):
  """An embedding (integer ids, dropout) per microbatch in stage 0's F, its
  VJP in stage 0's W: exact, with the keys of the microbatch rows."""
  schedule, m, vocab = sch.zero_bubble_h1(2, 3), 3, 5
  stages, loss_params, _, t = model(2, m * MB)
  rng = np.random.default_rng(3)
  table, ids = rng.normal(size=(vocab, D)), rng.integers(0, vocab, m * MB)
  key, embed_key = jax.random.key(1), jax.random.key(2)

  def embed_fn(table, ids, key):
    return jnp.where(jax.random.bernoulli(key, 0.7, (len(ids), D)),
                     table[ids] / 0.7, 0)

  def body(params, loss_params, table, ids, t):
    loss, g = pipeline_value_and_grad_local(
        lambda p, x, k: stage_fn(p, x), lambda lp, y, t, k: loss_fn(lp, y, t),
        jax.tree.map(lambda a: a[0], params), loss_params, ids, t,
        table=tick_table(schedule), key=key, embed_fn=embed_fn,
        embed_params=table, embed_key=embed_key, bubble_fill=NAN)
    assert g.inputs is None
    return loss, jax.tree.map(lambda a: a[None], g.stages), g.head, g.embed

  step = jax.jit(jax.shard_map(
      body, mesh=mesh_for(2), in_specs=(P('stage'), P(), P(), P(), P()),
      out_specs=(P(), P('stage'), P(), P()), axis_names={'stage'}))
  got = step(stages_to_ranks(stages, schedule), loss_params, table, ids, t)

  def sequential(stages, loss_params, table):
    total = 0.0
    for i in range(m):
      rows = slice(i * MB, (i + 1) * MB)
      x = embed_fn(table, ids[rows], jax.random.fold_in(embed_key, i))
      for k in range(2):
        x = stage_fn(jax.tree.map(lambda a, k=k: a[k], stages), x)
      total += loss_fn(loss_params, x, t[rows]) / m
    return total
  loss, grads = jax.value_and_grad(sequential, (0, 1, 2))(
      stages, loss_params, table)
  got = (got[0], (ranks_to_stages(got[1], schedule), *got[2:]))
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves((loss, grads))):
    np.testing.assert_allclose(g, w, rtol=1e-10,
                               atol=1e-10 * float(np.max(np.abs(w))))
