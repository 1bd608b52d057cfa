"""Every optax optimizer gives single-device results on every mesh, any ZeRO.

Float64, against plain optax on one device on the model as written, in data
parallelism and in 3D (data x stage x tensor; the reference is the dense
per-layer GPT), each with ZeRO stages 0, 1 and 3. The update runs on global
arrays under ``jit`` (XLA partitions it), so transforms that look across
elements -- a global norm, LAMB/LARS trust ratios, Adafactor's factored
moments, Muon's matrix products -- see whole tensors, and in 3D they see one
layer's tensors in the model's shapes (``jaxpar.parallel``). The bugs
this guards against (an update on local shards or ZeRO slices, or on stacked
layers) were off by 5e-5 to 7e-3 after 3 steps; the tolerances are 1e-9.

One program per mesh and ZeRO stage checks all the optimizers at once:
``optax.partition`` gives each optimizer its own part of the model
(``DP_GROUPS``, ``GPT_GROUPS``), so a transform that sees one shard of one of
its leaves shows up in that part's params, and the suite compiles 6 programs
instead of one per optimizer, mesh and ZeRO stage.

Exactly-zero gradients: in the GPT the attention key bias has a gradient
that is zero in exact arithmetic (softmax ignores a per-row shift), so in
floating point it is rounding noise (~1e-17) whose value depends on the
summation order, i.e. on the mesh. Adaptive optimizers divide by
``sqrt(v) + eps``, which turns noise into full-sized steps when ``eps`` is
tiny; the optimizers here use ``eps=1e-6`` (Adafactor: ``eps=1e-12`` on the
squared gradient) so that noise stays ~1e-11 of a step, far below what a
per-shard norm would change (1e-3).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
import helpers
from helpers import assert_round_trip, make_batches, tree_allclose

import jaxpar
from jaxpar.models import gpt

OPTIMIZERS = {
    'clip_adamw': lambda: optax.chain(   # decays 3-D leaves only
        optax.clip_by_global_norm(0.05),
        optax.adamw(0.01, eps=1e-6, weight_decay=0.1, mask=lambda params:
                    jax.tree.map(lambda x: x.ndim >= 3, params))),
    'lamb': lambda: optax.lamb(0.01, eps=1e-6),
    'lars': lambda: optax.lars(0.05),
    'adafactor': lambda: optax.adafactor(0.01, min_dim_size_to_factor=16,
                                         eps=1e-12),
    'muon': lambda: optax.contrib.muon(0.01),
    'multisteps': lambda: optax.MultiSteps(
        optax.adam(0.01, eps=1e-6), every_k_schedule=2).gradient_transformation(),
    'inject_hyperparams': lambda: optax.inject_hyperparams(optax.adam)(
        learning_rate=0.01, eps=1e-6),
}


def each_optimizer(groups):
  """``optax.partition``: ``OPTIMIZERS[groups[name]]`` for the leaves under
  the first key path name found in ``groups``."""
  def label(path):
    names = [jax.tree_util.keystr((k,), simple=True) for k in path]
    return next(groups[n] for n in names if n in groups)
  return optax.partition(
      {name: make() for name, make in OPTIMIZERS.items()},
      lambda params: jax.tree_util.tree_map_with_path(
          lambda path, _: label(path), params))


def reference(loss, params, batches, optimizer, max_grad_norm=None, *,
              with_opt_state=False):
  """Plain optax on one device: [(loss, grad norm, params)] per step (and
  the last optimizer state, ``with_opt_state``). The loss goes to the update
  as ``value=``, optax's convention (``reduce_on_plateau``)."""
  if max_grad_norm is not None:
    optimizer = optax.chain(optax.clip_by_global_norm(max_grad_norm), optimizer)
  optimizer = optax.with_extra_args_support(optimizer)

  @jax.jit   # one program: eager optax would compile op by op
  def step(params, opt_state, batch):
    value, grads = jax.value_and_grad(loss)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params,
                                          value=value)
    return (optax.apply_updates(params, updates), opt_state,
            (value, optax.tree.norm(grads)))

  opt_state, out = jax.jit(optimizer.init)(params), []
  for batch in batches:
    params, opt_state, (value, norm) = step(params, opt_state, batch)
    out.append((value, norm, params))
  return (out, opt_state) if with_opt_state else out


def trained(trainer, params, batches):
  """Run ``trainer``: [(loss, grad norm, params in model order on the
  host)] per step, and the last state."""
  state, got = trainer.init(params), []
  for batch in batches:
    state, stats = trainer.step(state, batch)
    assert not bool(stats.skipped)
    got.append((stats.loss, stats.grad_norm,
                jax.device_get(trainer.params(state))))
  return got, state


# -- Data parallelism: an MLP with one layer per optimizer -----------------

DP_GROUPS = {name: name for name in OPTIMIZERS} | {'out': 'lamb'}


def mlp_params():
  """Layers ``[5 -> 16]``, ``[16 -> 16]`` x 6, ``out [16 -> 3]``; ``out.b``
  (3 elements) does not split 8 ways, every other leaf does."""
  keys = iter(jax.random.split(jax.random.key(3), len(OPTIMIZERS) + 1))
  params = {}
  for i, name in enumerate(OPTIMIZERS):
    d_in = 5 if i == 0 else 16
    params[name] = {'w': jax.random.normal(next(keys), (d_in, 16),
                                           jnp.float64) / d_in**0.5,
                    'b': jnp.full(16, 0.1, jnp.float64)}
  params['out'] = {'w': jax.random.normal(next(keys), (16, 3),
                                          jnp.float64) / 4,
                   'b': jnp.full(3, 0.1, jnp.float64)}
  return params


def mlp_loss(params, batch):
  h = batch['x']
  for name in OPTIMIZERS:
    h = jnp.tanh(h @ params[name]['w'] + params[name]['b'])
  y = h @ params['out']['w'] + params['out']['b']
  return optax.losses.squared_error(y, batch['y']).mean()


def mlp_batches():
  return make_batches(3, 16, dtype=np.float64)


@functools.cache
def mlp_reference(max_grad_norm):
  """``reference`` of the MLP, once per clipping (call under x64)."""
  return reference(mlp_loss, mlp_params(), mlp_batches(),
                   each_optimizer(DP_GROUPS), max_grad_norm)


@pytest.mark.parametrize('zero_stage,max_grad_norm', [(0, None), (1, None),
                                                      (3, 0.05)])
def test_data_parallel(x64, zero_stage, max_grad_norm):
  """Every optimizer in DP with ZeRO 0/1/3; ``max_grad_norm=c`` (ZeRO-3)
  equals ``chain(clip_by_global_norm(c), optimizer)``."""
  trainer = jaxpar.data_parallel.trainer(
      mlp_loss, each_optimizer(DP_GROUPS), mesh=jaxpar.make_mesh(data=8),
      zero_stage=zero_stage, num_microbatches=2, max_grad_norm=max_grad_norm)
  want = mlp_reference(max_grad_norm)
  if max_grad_norm is not None:
    assert float(want[0][1]) > max_grad_norm     # clipping is exercised
  tree_allclose(trained(trainer, mlp_params(), mlp_batches())[0], want,
                rtol=1e-9, atol=1e-10)


# Transforms whose update takes the loss (value=), and schedule-free, whose
# evaluation params read the optimizer state next to the params.
LOSS_TAKING = {
    # rtol=0.5: a step that does not halve the loss is a plateau, so the
    # scale drops within the 3 steps
    'reduce_on_plateau': lambda: optax.chain(
        optax.adam(0.01, eps=1e-6), optax.contrib.reduce_on_plateau(
            factor=0.5, patience=0, rtol=0.5, accumulation_size=1)),
    'schedule_free': lambda: optax.contrib.schedule_free_adamw(
        0.01, eps=1e-6),
}


@pytest.mark.parametrize('name', list(LOSS_TAKING))
def test_data_parallel_transforms_that_take_the_loss(x64, name):
  """``reduce_on_plateau`` (its update needs ``value=``) and
  ``schedule_free`` in DP ZeRO-3 equal optax on one device, and
  ``schedule_free_eval_params(trainer.opt_state(state),
  trainer.params(state))`` works on what the trainer gives (logical shapes:
  no leaf of the small MLP splits 8 ways, so all are stored padded)."""
  params = helpers.mlp_params(dtype=np.float64)
  trainer = jaxpar.data_parallel.trainer(
      helpers.mlp_loss, LOSS_TAKING[name](), mesh=jaxpar.make_mesh(data=8),
      zero_stage=3)
  want, opt_state = reference(helpers.mlp_loss, params, mlp_batches(),
                              LOSS_TAKING[name](), with_opt_state=True)
  got, state = trained(trainer, params, mlp_batches())
  tree_allclose(got, want, rtol=1e-9, atol=1e-10)
  got_opt = trainer.opt_state(state)
  tree_allclose(got_opt, opt_state, rtol=1e-9, atol=1e-12)
  if name == 'reduce_on_plateau':
    assert float(opt_state[1].scale) < 1      # the plateau rule acted
  else:
    tree_allclose(
        optax.contrib.schedule_free_eval_params(got_opt, trainer.params(state)),
        optax.contrib.schedule_free_eval_params(opt_state, want[-1][2]),
        rtol=1e-9, atol=1e-12)


def test_data_parallel_refuses_a_transform_needing_more_than_the_loss():
  """A line search also needs ``value_fn=``: refused at the first step,
  naming it, before anything is compiled."""
  params = helpers.mlp_params()
  trainer = jaxpar.data_parallel.trainer(helpers.mlp_loss, optax.lbfgs(),
                                         mesh=jaxpar.make_mesh(data=8))
  with pytest.raises(TypeError, match="'value_fn'.*value=loss"):
    trainer.step(jaxpar.TrainState.create(params, optax.lbfgs()),
                 make_batches(1, 16)[0])


# -- 3D: a GPT on data=2 x stage=2 x tensor=2, against the dense GPT ------

CONFIG = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16, num_heads=2,
                       num_layers=3)
# num_layers -> schedule: 3 layers on 2 stages, counts (2, 1): one stage holds
# two layers, the other one and an identity slot; 5 layers on 4 interleaved
# stages, counts (2, 1, 1, 1), so 3 identity slots (no layers, no state).
SCHEDULES = {3: lambda: jaxpar.pipeline.one_f_one_b(2, 2),
             5: lambda: jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2)}
# Per-layer statistics see one layer (LAMB, LARS, Adafactor, Muon), and the
# ndim mask of clip_adamw sees the dense shapes (attention biases are 2-D:
# not decayed), as on the dense model.
GPT_GROUPS = {'embed': 'lamb', 'pos': 'lamb', 'attn': 'clip_adamw',
              'fc_in': 'adafactor', 'fc_out': 'muon', 'ln1': 'lars',
              'ln2': 'lars', 'lm_head': 'multisteps',
              'ln_f': 'inject_hyperparams'}


@functools.cache
def gpt_setup(num_layers):
  """Dense float64 GPT params, their pipeline split, 3 batches."""
  config = CONFIG._replace(num_layers=num_layers)
  params = jax.tree.map(lambda x: x.astype(jnp.float64),
                        gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0))))
  schedule = SCHEDULES[num_layers]()
  pp, split = gpt.split_for_pipeline(params,
                                      num_stages=schedule.num_stages)
  rng = np.random.default_rng(0)
  data = [(rng.integers(0, 16, (8, 8)), rng.integers(0, 16, (8, 8)))
          for _ in range(3)]
  return config, params, schedule, pp, split, data


@functools.cache
def gpt_reference(num_layers, max_grad_norm):
  """``reference`` of the dense GPT, once per model and clipping (x64)."""
  config, params, *_, data = gpt_setup(num_layers)
  return reference(functools.partial(gpt.gpt_loss, config=config), params,
                   data, each_optimizer(GPT_GROUPS), max_grad_norm)


@pytest.mark.parametrize('zero_stage,max_grad_norm,num_layers',
                         [(0, None, 3), (1, None, 3), (3, 0.5, 5)])
def test_3d_2x2x2(x64, zero_stage, max_grad_norm, num_layers, tmp_path):
  """Every optimizer in 3D with ZeRO 0/1/3 gives the dense GPT's numbers
  (``SCHEDULES``); the ZeRO-3 state saves and restores with schedule=."""
  _, _, schedule, pp, split, data = gpt_setup(num_layers)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, each_optimizer(GPT_GROUPS),
      schedule=schedule, mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES,
      zero_stage=zero_stage,
      max_grad_norm=max_grad_norm)
  got, state = trained(trainer, pp, data)
  want = gpt_reference(num_layers, max_grad_norm)
  if max_grad_norm is not None:
    assert float(want[0][1]) > max_grad_norm     # clipping is exercised
  tree_allclose([(loss, norm, gpt.merge_from_pipeline(p, split))
                 for loss, norm, p in got], want, rtol=1e-9, atol=1e-10)
  # The compiled step (cached): no collective runs beside the tick loop.
  if zero_stage == 3:
    # Adafactor's (1,) placeholders are no stage leaves: schedule= saves
    # them. Once, on the ZeRO-3 state (params and moments split over data,
    # identity slots): its optimizer state is laid out as ZeRO-1's, and
    # zero_stage=0 states with schedule= are test_checkpoint.py's and
    # test_from_nnx.py's.
    assert_round_trip(tmp_path, state, trainer.init(pp), schedule=schedule)
  assert_collectives_ordered(trainer.step.lower(state, data[0]).compile())


def assert_collectives_ordered(compiled):
  """No collective runs beside a loop of collectives (XLA:CPU hangs)."""
  assert jaxpar.hlo.unordered_collectives(compiled) == []


# -- 3D with LAMB on every layer: no collective runs beside the pipeline ---

def lamb_and_adafactor():
  """LAMB on every param but the MLP matrices, which Adafactor factors."""
  return optax.partition(
      {'lamb': optax.lamb(0.01, eps=1e-6),
       'adafactor': optax.adafactor(0.01, min_dim_size_to_factor=16,
                                    eps=1e-12)},
      lambda params: jax.tree_util.tree_map_with_path(
          lambda path, _: 'adafactor' if any(
              getattr(k, 'key', None) in ('fc_in', 'fc_out') for k in path)
          else 'lamb', params))


@functools.cache
def lamb_and_adafactor_reference():
  """``reference`` of the dense 3-layer GPT, two steps (call under x64)."""
  config, params, *_, data = gpt_setup(3)
  return reference(functools.partial(gpt.gpt_loss, config=config), params,
                   data[:2], lamb_and_adafactor())


@pytest.mark.parametrize('zero_stage', [1, 3])
def test_3d_lamb_adafactor_collectives_ordered(x64, zero_stage):
  """LAMB and Adafactor in 3D (ZeRO 1/3; ZeRO 0: ``test_3d_2x2x2``) give
  the dense GPT's numbers, and every collective of the step after the
  pipeline's tick loop reads its result (``jaxpar.hlo.unordered_collectives``). The update's reshards of
  the params (LAMB's trust ratios read them) did not: on XLA:CPU they ran
  beside the loop's collectives and the step aborted after the 40-second
  rendezvous timeout in 13 of 14 runs (issue 32), while this test's results
  were right whenever it finished."""
  _, _, schedule, pp, split, data = gpt_setup(3)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, lamb_and_adafactor(),
      schedule=schedule, mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=split.mask, tensor_rules=gpt.TENSOR_RULES,
      zero_stage=zero_stage)
  state = trainer.init(pp)
  compiled = trainer.step.lower(state, data[0]).compile()
  got, _ = trained(trainer, pp, data[:2])
  tree_allclose([(loss, norm, gpt.merge_from_pipeline(p, split))
                 for loss, norm, p in got], lamb_and_adafactor_reference(),
                rtol=1e-9, atol=1e-10)
  assert_collectives_ordered(compiled)
