"""jaxpar.checkpoint: sharded TrainStates save and restore bit for bit, on any
mesh."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import checkpoint
from jaxpar.data_parallel import internal as dp_internal
from jaxpar.models import gpt

OPT = optax.adam(0.05)
# A 4-layer GPT: 4 pipeline stages as interleaved 1F1B (2 ranks x 2) or 1F1B
# (4 ranks); 4 heads for tensor=4.
CFG = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=4,
                    num_layers=4)
SCHEDULE = jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2)
MESHES = {  # (data, stage, tensor): schedule with 4 stages
    (2, 2, 2): SCHEDULE,
    (1, 4, 2): jaxpar.pipeline.one_f_one_b(4, 4),
    (8, 1, 1): jaxpar.pipeline.interleaved_one_f_one_b(1, 1, 4),
    (1, 2, 4): SCHEDULE,
}


def _equal(a, b) -> bool:
  return all(jax.tree.leaves(jax.tree.map(
      lambda x, y: np.asarray(x).dtype == np.asarray(y).dtype
      and np.array_equal(x, y), a, b)))


@functools.cache
def _setup():
  """Random GPT params (eval_shape: no eager init), their split, 3 batches."""
  shapes = jax.eval_shape(
      lambda: gpt.gpt_params(gpt.GPT(CFG, rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(0)
  params = jax.tree.map(
      lambda s: rng.normal(scale=0.3, size=s.shape).astype(np.float32), shapes)
  pp, split = gpt.split_for_pipeline(params, num_stages=4)
  batches = [tuple(rng.integers(0, 16, (8, 4)) for _ in range(2))
             for _ in range(3)]
  return pp, split, batches


@functools.cache
def _trainer(sizes):
  pp, split, _ = _setup()
  d, s, t = sizes
  return jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, OPT,
      schedule=MESHES[sizes], mesh=jaxpar.make_mesh(data=d, stage=s, tensor=t),
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES, max_grad_norm=1.0)


def _init(sizes):
  return _trainer(sizes).init(_setup()[0])


@pytest.fixture(scope='module')
def run(tmp_path_factory):
  """3 uninterrupted steps on data=2 x stage=2 x tensor=2; step 1 saved."""
  _, _, batches = _setup()
  trainer = _trainer((2, 2, 2))
  state, states, losses = _init((2, 2, 2)), [], []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    states.append(state)
    losses.append(float(stats.loss))
  root = tmp_path_factory.mktemp('ckpt')
  assert checkpoint.save(root / 'model', states[0], schedule=SCHEDULE) == 1
  assert checkpoint.save(root / 'ranks', states[0]) == 1
  return dict(states=states, losses=losses, model=root / 'model',
              ranks=root / 'ranks')


@pytest.mark.parametrize('kind', ['model', 'ranks'])
def test_restore_is_bit_identical(run, kind):
  like = _init((2, 2, 2))
  restored = checkpoint.restore(
      run[kind], like, schedule=SCHEDULE if kind == 'model' else None)
  assert jax.tree.structure(restored) == jax.tree.structure(like)
  assert _equal(restored, run['states'][0])
  assert int(restored.step) == 1
  for r, l in zip(jax.tree.leaves(restored), jax.tree.leaves(like)):
    assert r.sharding == l.sharding


def test_resume_equals_uninterrupted_training(run):
  state = checkpoint.restore(run['model'], _init((2, 2, 2)), schedule=SCHEDULE)
  losses = []
  for batch in _setup()[2][1:]:
    state, stats = _trainer((2, 2, 2)).step(state, batch)
    losses.append(float(stats.loss))
  assert losses == run['losses'][1:]  # bit for bit
  assert _equal(state, run['states'][-1])


@pytest.mark.parametrize('sizes', [(1, 4, 2), (8, 1, 1), (1, 2, 4)])
def test_restore_onto_another_mesh(run, sizes):
  """Other data / tensor sizes, 4 ranks instead of 2, 1F1B <-> interleaved.

  The restored state is the saved one, stage by stage in model order and
  layer by layer in the optimizer state. Training on from a checkpoint on
  another mesh (its next loss is the reference's, float64) is
  test_parallel_zero.py::test_matches_single_device_float64's
  (ZeRO-3 interleaved on 4x2x1 -> ZB-V on 1x2x4).
  """
  trainer, saved = _trainer(sizes), run['states'][0]
  state = checkpoint.restore(run['model'], _init(sizes), schedule=MESHES[sizes])
  assert state.params.stages['mlp']['fc_in']['kernel'].shape[:2] == (
      MESHES[sizes].num_ranks, 4 // MESHES[sizes].num_ranks)
  assert _equal(trainer.params(state), _trainer((2, 2, 2)).params(saved))
  assert _equal(state.opt_state, saved.opt_state)  # per layer: any schedule


def test_placement_mismatch_errors(run):
  # Rank-placement checkpoint onto 4 ranks: [2, 2, ...] vs [4, 1, ...].
  with pytest.raises(ValueError, match=r'params/stages/attn/key/bias: '
                     r'checkpoint \(2, 2, 1, 4, 2\) float32 vs like '
                     r'\(4, 1, 1, 4, 2\) float32'):
    checkpoint.restore(run['ranks'], _init((1, 4, 2)))
  # Model-order checkpoint restored without schedule=.
  with pytest.raises(ValueError, match='restore with schedule='):
    checkpoint.restore(run['model'], _init((2, 2, 2)))
  # A schedule that is not the like's.
  with pytest.raises(ValueError, match=r"rank order of schedule '1F1B' "
                     r'\(4 ranks, 4 stages\) starts with \(4, 1\)'):
    checkpoint.restore(run['model'], _init((2, 2, 2)),
                       schedule=MESHES[(1, 4, 2)])
  with pytest.raises(ValueError, match='has no PipelineParams'):
    checkpoint.save(run['model'], {'a': np.zeros(2)}, step=0, schedule=SCHEDULE)


def test_zero_state_round_trip(tmp_path):
  """Padded ZeRO leaves are saved at their shapes, restored onto any mesh."""
  params = {'w': jnp.arange(91.0).reshape(7, 13), 'b': jnp.ones(3)}
  plain = jaxpar.TrainState.create(params, OPT)
  mesh6 = jaxpar.make_mesh(data=6, devices=jax.devices()[:6])
  state = jaxpar.data_parallel.shard_state(plain, mesh=mesh6, zero_stage=3)
  assert isinstance(state.params['w'], jaxpar.data_parallel.Padded)
  checkpoint.save(tmp_path / 'zero', state)
  restored = checkpoint.restore(tmp_path / 'zero', state)
  assert jax.tree.structure(restored) == jax.tree.structure(state)
  assert _equal(restored, state)
  assert restored.params['w'].sharding == state.params['w'].sharding
  # Saved at logical shapes: restore onto other data sizes and stages.
  for data, zero_stage in ((8, 1), (4, 0)):
    mesh = jaxpar.make_mesh(data=data, devices=jax.devices()[:data])
    like = jaxpar.data_parallel.shard_state(plain, mesh=mesh,
                                            zero_stage=zero_stage)
    restored = checkpoint.restore(tmp_path / 'zero', like)
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    assert _equal(dp_internal.unpadded(restored), plain)
    mu = restored.opt_state[0].mu['w']
    assert mu.sharding == like.opt_state[0].mu['w'].sharding
    if zero_stage:   # 7 x 13 on 8 devices: 13 padded to 16
      assert mu.value.shape == (7, 16)


def test_steps_keep_overwrite_and_latest(tmp_path, monkeypatch):
  assert checkpoint.latest_step(tmp_path / 'none') is None
  (tmp_path / 'empty').mkdir()
  assert checkpoint.latest_step(tmp_path / 'empty') is None
  mesh = jaxpar.make_mesh(data=2, tensor=4)
  sharded = NamedSharding(mesh, P('data', 'tensor'))
  tree = lambda v: {'a': jax.device_put(jnp.full((4, 8), v), sharded),
                    'n': np.arange(3) * v}
  for step in (1, 2, 3):
    checkpoint.save(tmp_path / 'c', tree(step), step=step, keep=2)
  assert checkpoint.latest_step(tmp_path / 'c') == 3
  with pytest.raises(FileNotFoundError, match=r'no step 1 .* saved steps: '
                     r'\[2, 3\]'):
    checkpoint.restore(tmp_path / 'c', tree(0), step=1)
  restored = checkpoint.restore(tmp_path / 'c', tree(0), step=2)
  assert _equal(restored, tree(2)) and restored['a'].sharding == sharded
  assert isinstance(restored['n'], np.ndarray)
  checkpoint.save(tmp_path / 'c', tree(7), step=3)  # replaces step 3
  assert _equal(checkpoint.restore(tmp_path / 'c', tree(0)), tree(7))
  # A TrainState is saved at its own step; relative paths are absolute.
  monkeypatch.chdir(tmp_path)
  state = jaxpar.TrainState.create({'w': jnp.ones(2)}, OPT)._replace(
      step=jnp.array(5, jnp.int32))
  assert checkpoint.save('rel', state) == 5
  assert (tmp_path / 'rel' / '5').is_dir()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(
      x.shape, x.dtype, sharding=x.sharding), state)
  assert _equal(checkpoint.restore(tmp_path / 'rel', abstract), state)


def test_restore_errors(tmp_path):
  tree = {'a': jnp.ones(3), 'b': {'c': jnp.zeros((2, 2))}}
  with pytest.raises(FileNotFoundError, match=f'no checkpoint directory '
                     f'{tmp_path}/nothing'):
    checkpoint.restore(tmp_path / 'nothing', tree)
  (tmp_path / 'empty').mkdir()
  with pytest.raises(FileNotFoundError, match='no checkpoint in .*empty'):
    checkpoint.restore(tmp_path / 'empty', tree)
  checkpoint.save(tmp_path / 'c', tree, step=0)
  with pytest.raises(ValueError, match=r'in like but not in the checkpoint: '
                     r'b/d\n.*in the checkpoint but not in like: b/c'):
    checkpoint.restore(tmp_path / 'c', {'a': tree['a'], 'b': {'d': tree['a']}})
  with pytest.raises(ValueError, match=r'a: checkpoint \(3,\) float32 vs like '
                     r'\(4,\) float32\n    b/c: checkpoint \(2, 2\) float32 vs '
                     r'like \(2, 2\) int32'):
    checkpoint.restore(tmp_path / 'c', {'a': jnp.ones(4),
                                        'b': {'c': jnp.zeros((2, 2), int)}})
  with pytest.raises(TypeError, match='without sharding'):
    checkpoint.restore(tmp_path / 'c', jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree))
  with pytest.raises(TypeError, match="like leaf 'a' is a float"):
    checkpoint.restore(tmp_path / 'c', {'a': 1.0, 'b': tree['b']})
  with pytest.raises(ValueError, match='step=-1'):
    checkpoint.restore(tmp_path / 'c', tree, step=-1)


@pytest.mark.parametrize('args, error, match', [
    (dict(step=None), ValueError, 'pass step=<int>'),
    (dict(step=-1), ValueError, 'step=-1'),
    (dict(step=True), ValueError, 'step=True'),
    (dict(keep=0), ValueError, 'keep=0'),
    (dict(schedule='1f1b'), TypeError, 'Schedule'),
    (dict(directory=3), TypeError, 'directory must be'),
    (dict(state={'a': 'text'}), TypeError, "state leaf 'a' is a str"),
    (dict(state={}), ValueError, 'no array leaves'),
])
def test_save_errors(tmp_path, args, error, match):
  kwargs = dict(directory=tmp_path / 'c', state={'a': np.ones(2)}, step=0)
  kwargs.update(args)
  with pytest.raises(error, match=match):
    checkpoint.save(kwargs.pop('directory'), kwargs.pop('state'), **kwargs)
  assert not (tmp_path / 'c').exists()
