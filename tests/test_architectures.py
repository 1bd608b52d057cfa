"""Architectures as their authors write them, pipelined as written (#40).

Each model is plain Flax, unchanged; each layout is compared with the model
on one device, float64: ``jax.value_and_grad`` of the model and one SGD step.

- a Linen MLP wrapped whole by ``nnx.bridge.ToNNX`` (blocks ``blocks_0 ...``);
- a T5-style encoder-decoder (shared embedding, cross-attention): both
  stacks pipelined, the encoder output a side input of every decoder block;
- pytree batches (dict and tuple inputs) in both trainers;
- a fused gate|up projection split over ``tensor`` on ``stage`` x ``tensor``:
  refused with a ``ValueError`` naming the rule, never an abort (in a
  subprocess with a timeout, in case a regression hangs XLA:CPU).
"""

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import jaxpar
from helpers import tree_allclose

F64 = dict(param_dtype=jnp.float64)
LR = 0.1


def mesh(**sizes):
  n = int(np.prod(list(sizes.values())))
  return jaxpar.make_mesh(**sizes, devices=jax.devices()[:n])


def one_step(model, loss):
  """The one-device reference: ``(loss, params after one SGD step)``."""
  value, grads = nnx.jit(nnx.value_and_grad(loss))(model)
  params = jax.tree.map(lambda p, g: p - LR * g, nnx.state(model, nnx.Param),
                        nnx.state(grads, nnx.Param))
  return value, nnx.to_pure_dict(params)


def pipelined_step(pm, model, batch, schedule, **options):
  """``(loss, the model's params after one step)`` of ``model_trainer``."""
  sizes = options.pop('mesh')
  trainer = jaxpar.parallel.model_trainer(pm, optax.sgd(LR), schedule=schedule,
                                          mesh=mesh(**sizes), **options)
  state, stats = trainer.step(trainer.init(pm.params), batch)
  pm.update(model, jax.device_get(trainer.params(state)))
  return stats.loss, nnx.to_pure_dict(nnx.state(model, nnx.Param))


# ------------------------------------------------- a Linen model, ToNNX-wrapped


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + jnp.tanh(nn.Dense(4, param_dtype=jnp.float64)(x))


class LinenMLP(nn.Module):
  def setup(self):
    self.inp = nn.Dense(4, param_dtype=jnp.float64)
    self.blocks = [LinenBlock() for _ in range(3)]
    self.out = nn.Dense(1, param_dtype=jnp.float64)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


def wrapped_mlp(x):
  return nnx.bridge.lazy_init(nnx.bridge.ToNNX(LinenMLP(), rngs=nnx.Rngs(0)),
                              x)


def linen_functions():
  """``embed`` and ``head_loss`` of the wrapped MLP: its Linen submodules
  by ``method=``."""
  embed = lambda m, x: m(x, method=lambda mod, x: mod.inp(x))
  head_loss = lambda m, y, t: jnp.mean(
      (m(y, method=lambda mod, y: mod.out(y)) - t) ** 2)
  return embed, head_loss


def test_linen_model_wrapped_by_to_nnx_float64(x64):
  rng = np.random.default_rng(0)
  x, t = rng.normal(size=(8, 3)), rng.normal(size=(8, 1))
  want = one_step(wrapped_mlp(x), lambda m: jnp.mean((m(x) - t) ** 2))
  model = wrapped_mlp(x)
  embed, head_loss = linen_functions()
  pm = jaxpar.parallel.from_nnx(model, blocks='blocks', num_stages=2,
                                head=['out'], embed=embed, head_loss=head_loss)
  assert pm.params.stages['Dense_0']['kernel'].shape == (2, 2, 4, 4)
  got = pipelined_step(pm, model, (x, t), jaxpar.pipeline.one_f_one_b(2, 2),
                       mesh=dict(data=2, stage=2))
  tree_allclose(got, want)
  # The same layers named one by one: the same cut.
  by_path = jaxpar.parallel.from_nnx(
      model, blocks=['blocks_0', 'blocks_1', 'blocks_2'], num_stages=2,
      head=['out'], embed=embed, head_loss=head_loss)
  tree_allclose(by_path.params, pm.from_state(nnx.state(model, nnx.Param)))


def test_blocks_not_found_lists_the_paths_that_work(x64):
  embed, head_loss = linen_functions()
  with pytest.raises(ValueError, match=r"blocks='layers': ToNNX has no "
                     r"attribute 'layers'.*name several layers of this "
                     r"model: \['blocks'\]"):
    jaxpar.parallel.from_nnx(wrapped_mlp(np.ones((2, 3))), blocks='layers',
                             num_stages=2, embed=embed, head_loss=head_loss)


# ------------------------------------------ a T5-style encoder-decoder (plain)

D, HEADS, VOCAB = 8, 2, 16


class Attention(nnx.Module):
  def __init__(self, rngs):
    self.q, self.k, self.v, self.o = (
        nnx.Linear(D, D, use_bias=False, rngs=rngs, **F64) for _ in range(4))

  def __call__(self, x, kv, mask):
    heads = lambda a: a.reshape(a.shape[:-1] + (HEADS, D // HEADS))
    q, k, v = heads(self.q(x)), heads(self.k(kv)), heads(self.v(kv))
    logits = jnp.einsum('bqhd,bkhd->bhqk', q, k) / np.sqrt(D // HEADS)
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e30))
    return self.o(jnp.einsum('bhqk,bkhd->bqhd', probs, v).reshape(x.shape))


class MLP(nnx.Module):
  def __init__(self, rngs):
    self.wi = nnx.Linear(D, 2 * D, use_bias=False, rngs=rngs, **F64)
    self.wo = nnx.Linear(2 * D, D, use_bias=False, rngs=rngs, **F64)

  def __call__(self, x):
    return self.wo(jax.nn.relu(self.wi(x)))


class EncoderBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm1, self.norm2 = (nnx.RMSNorm(D, rngs=rngs, **F64)
                              for _ in range(2))
    self.attn, self.mlp = Attention(rngs), MLP(rngs)

  def __call__(self, x, pad):          # pad [b, s]: True at real tokens
    h = self.norm1(x)
    x = x + self.attn(h, h, pad[:, None, None, :])
    return x + self.mlp(self.norm2(x))


class DecoderBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm1, self.norm2, self.norm3 = (nnx.RMSNorm(D, rngs=rngs, **F64)
                                          for _ in range(3))
    self.self_attn, self.cross_attn = Attention(rngs), Attention(rngs)
    self.mlp = MLP(rngs)

  def __call__(self, x, enc, pad):
    h = self.norm1(x)
    x = x + self.self_attn(h, h, jnp.tril(jnp.ones((x.shape[1],) * 2, bool)))
    x = x + self.cross_attn(self.norm2(x), enc, pad[:, None, None, :])
    return x + self.mlp(self.norm3(x))


class Stack(nnx.Module):
  def __init__(self, block, n, rngs):
    self.layers = nnx.List([block(rngs) for _ in range(n)])
    self.final_norm = nnx.RMSNorm(D, rngs=rngs, **F64)


class T5(nnx.Module):
  def __init__(self, rngs, encoder=2, decoder=1):
    self.shared = nnx.Embed(VOCAB, D, rngs=rngs, **F64)
    self.encoder = Stack(EncoderBlock, encoder, rngs)
    self.decoder = Stack(DecoderBlock, decoder, rngs)

  def __call__(self, src, tgt):
    pad = src != 0
    enc = self.shared(src)
    for layer in self.encoder.layers:
      enc = layer(enc, pad)
    enc = self.encoder.final_norm(enc)
    dec = self.shared(tgt)
    for layer in self.decoder.layers:
      dec = layer(dec, enc, pad)
    return self.shared.attend(self.decoder.final_norm(dec))


def xent(logits, targets):
  return optax.losses.softmax_cross_entropy_with_integer_labels(
      logits, targets).mean()


# The cut: both stacks (and the encoder's final norm between them) are
# blocks; the carried activation is a dict, the decoder's blocks read the
# encoder output and the padding mask from it.
T5_CUT = dict(
    blocks=['encoder.layers', 'encoder.final_norm', 'decoder.layers'],
    embed=lambda m, i: {'enc': m.shared(i['src']), 'dec': m.shared(i['tgt']),
                        'pad': i['src'] != 0},
    block={'encoder.layers': lambda b, a: {**a, 'enc': b(a['enc'], a['pad'])},
           'encoder.final_norm': lambda b, a: {**a, 'enc': b(a['enc'])},
           'decoder.layers': lambda b, a: {**a, 'dec': b(a['dec'], a['enc'],
                                                         a['pad'])}},
    head_loss=lambda m, a, t: xent(
        m.shared.attend(m.decoder.final_norm(a['dec'])), t))
T5_RULES = {r'(self_|cross_)?attn/[qkv]/kernel': (None, 'tensor'),
            r'(self_|cross_)?attn/o/kernel': ('tensor', None),
            r'mlp/wi/kernel': (None, 'tensor'),
            r'mlp/wo/kernel': ('tensor', None)}


def t5_batch(size=8):
  rng = np.random.default_rng(0)
  src = rng.integers(1, VOCAB, (size, 5))
  src[::2, -2:] = 0                                   # padding
  return ({'src': src, 'tgt': rng.integers(1, VOCAB, (size, 4))},
          rng.integers(0, VOCAB, (size, 4)))


def t5_reference(batch):
  inputs, targets = batch
  return one_step(T5(nnx.Rngs(0)), lambda m: xent(
      m(inputs['src'], inputs['tgt']), targets))


@pytest.mark.parametrize('layout', ['zero_bubble_v', '3d-rules'])
def test_encoder_decoder_pipelines_both_stacks_float64(x64, layout):
  """4 layers (2 encoder, its final norm, 1 decoder) on the stages; the
  decoder blocks read the encoder output and the padding mask from the
  carried activation. ZB-V (4 stages on 2 ranks), and 1F1B over data x
  stage x tensor with Megatron rules."""
  batch = t5_batch()
  model = T5(nnx.Rngs(0))
  if layout == 'zero_bubble_v':
    schedule, sizes, rules = (jaxpar.pipeline.zero_bubble_v(2, 2),
                              dict(data=2, stage=2), None)
  else:
    schedule, sizes, rules = (jaxpar.pipeline.one_f_one_b(2, 2),
                              dict(data=2, stage=2, tensor=2), T5_RULES)
  pm = jaxpar.parallel.from_nnx(model, num_stages=schedule.num_stages,
                                tensor_rules=rules, **T5_CUT)
  assert sorted(pm.params.stages) == ['decoder.layers', 'encoder.final_norm',
                                      'encoder.layers']
  assert pm.tied(pm.params, *batch) == (('shared', 'embedding'),)
  got = pipelined_step(pm, model, batch, schedule, mesh=sizes)
  tree_allclose(got, t5_reference(batch))


# ----------------------------------------- a fused projection over `tensor`

FUSED = textwrap.dedent('''
    import jaxpar; jaxpar.simulate_cpu_devices(8)
    import jax, jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    jax.config.update('jax_enable_x64', True)

    class Block(nnx.Module):
      def __init__(self, rngs):
        self.gate_up = nnx.Linear(8, 32, use_bias=False, rngs=rngs,
                                  param_dtype=jnp.float64)
        self.down = nnx.Linear(16, 8, use_bias=False, rngs=rngs,
                               param_dtype=jnp.float64)
      def __call__(self, x):
        gate, up = jnp.split(self.gate_up(x), 2, axis=-1)
        return x + self.down(jax.nn.silu(gate) * up)

    class Net(nnx.Module):
      def __init__(self, rngs):
        self.inp = nnx.Linear(4, 8, rngs=rngs, param_dtype=jnp.float64)
        self.blocks = nnx.List([Block(rngs) for _ in range(2)])
        self.out = nnx.Linear(8, 1, rngs=rngs, param_dtype=jnp.float64)

    pm = jaxpar.parallel.from_nnx(
        Net(nnx.Rngs(0)), blocks='blocks', num_stages=2,
        embed=lambda m, x: m.inp(x),
        head_loss=lambda m, y, t: jnp.mean((m.out(y) - t) ** 2),
        tensor_rules={'gate_up/kernel': (None, 'tensor'),
                      'down/kernel': ('tensor', None)})
    x = np.ones((8, 4))
    for zero_stage in (0, 3):
      trainer = jaxpar.parallel.model_trainer(
          pm, optax.sgd(0.1), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
          mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
          zero_stage=zero_stage)
      try:
        trainer.step(trainer.init(pm.params), (x, x[:, :1]))
        print('trained')
      except ValueError as e:
        print('refused:', e)
''')


def test_fused_projection_split_over_tensor_is_refused_not_aborted():
  """XLA reshards the halves of a column-split fused projection with a
  collective-permute; XLA:CPU runs it over every device while one stage
  runs the block: it would hang 40 s and abort. The first step refuses it
  with the rule named (ZeRO 0 and 3), before compiling the step."""
  out = subprocess.run([sys.executable, '-c', FUSED], capture_output=True,
                       text=True, timeout=240)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [l for l in out.stdout.splitlines() if l.startswith('refused')]
  assert len(lines) == 2, out.stdout
  for line in lines:
    assert "'gate_up/kernel': ('gate_up/kernel', (None, 'tensor'))" in line
    assert 'Make the fused param two params' in line


class SplitGLU(nnx.Module):
  """The same block with the gate and up projections as two params."""

  def __init__(self, rngs):
    self.gate = nnx.Linear(8, 16, use_bias=False, rngs=rngs, **F64)
    self.up = nnx.Linear(8, 16, use_bias=False, rngs=rngs, **F64)
    self.down = nnx.Linear(16, 8, use_bias=False, rngs=rngs, **F64)

  def __call__(self, x):
    return x + self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class GLUNet(nnx.Module):
  def __init__(self, rngs):
    self.inp = nnx.Linear(4, 8, rngs=rngs, **F64)
    self.blocks = nnx.List([SplitGLU(rngs) for _ in range(2)])
    self.out = nnx.Linear(8, 1, rngs=rngs, **F64)

  def __call__(self, x):
    x = self.inp(x)
    for block in self.blocks:
      x = block(x)
    return self.out(x)


def test_split_gate_and_up_train_exactly_over_tensor_float64(x64):
  """The fix the refusal names: two params, a column rule each."""
  rng = np.random.default_rng(0)
  x, t = rng.normal(size=(8, 4)), rng.normal(size=(8, 1))
  want = one_step(GLUNet(nnx.Rngs(0)), lambda m: jnp.mean((m(x) - t) ** 2))
  model = GLUNet(nnx.Rngs(0))
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=2, embed=lambda m, x: m.inp(x),
      head_loss=lambda m, y, t: jnp.mean((m.out(y) - t) ** 2),
      tensor_rules={'(gate|up)/kernel': (None, 'tensor'),
                    'down/kernel': ('tensor', None)})
  got = pipelined_step(pm, model, (x, t), jaxpar.pipeline.one_f_one_b(2, 2),
                       mesh=dict(data=1, stage=2, tensor=2))
  tree_allclose(got, want)


# ------------------------------------------------------------ pytree batches


class TwoInputs(nnx.Module):
  """A model of two inputs (``a [b, 3]``, ``b [b, 2]``) and a target."""

  def __init__(self, rngs):
    self.a = nnx.Linear(3, 4, rngs=rngs, **F64)
    self.b = nnx.Linear(2, 4, rngs=rngs, **F64)
    self.blocks = nnx.List([nnx.Linear(4, 4, rngs=rngs, **F64)
                            for _ in range(2)])
    self.out = nnx.Linear(4, 1, rngs=rngs, **F64)

  def __call__(self, a, b):
    x = self.a(a) + self.b(b)
    for block in self.blocks:
      x = x + jnp.tanh(block(x))
    return self.out(x)


def two_inputs(kind):
  """``(inputs, targets, unpack)``: the inputs as a dict or a tuple."""
  rng = np.random.default_rng(0)
  a, b, t = (rng.normal(size=(8, n)) for n in (3, 2, 1))
  if kind == 'dict':
    return {'a': a, 'b': b}, t, lambda i: (i['a'], i['b'])
  return (a, b), t, lambda i: i


@pytest.mark.parametrize('kind', ['dict', 'tuple'])
def test_pytree_inputs_in_both_trainers_float64(x64, kind):
  inputs, t, unpack = two_inputs(kind)
  mse = lambda y: jnp.mean((y - t) ** 2)
  want = one_step(TwoInputs(nnx.Rngs(0)), lambda m: mse(m(*unpack(inputs))))
  model = TwoInputs(nnx.Rngs(0))
  dm = jaxpar.data_parallel.from_nnx(
      model, loss=lambda m, batch: jnp.mean(
          (m(*unpack(batch[0])) - batch[1]) ** 2))
  trainer = jaxpar.data_parallel.model_trainer(
      dm, optax.sgd(LR), mesh=mesh(data=2), num_microbatches=2)
  state, stats = trainer.step(trainer.init(dm.params, dm.model_state),
                              (inputs, t))
  tree_allclose((stats.loss, trainer.params(state)), want)
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=2,
      embed=lambda m, i: m.a(unpack(i)[0]) + m.b(unpack(i)[1]),
      block=lambda b, x: x + jnp.tanh(b(x)),
      head_loss=lambda m, y, t: jnp.mean((m.out(y) - t) ** 2))
  got = pipelined_step(pm, model, (inputs, t),
                       jaxpar.pipeline.one_f_one_b(2, 2),
                       mesh=dict(data=2, stage=2))
  tree_allclose(got, want)


def test_pytree_inputs_need_one_batch_axis(x64):
  inputs = {'a': np.ones((8, 3)), 'b': np.ones((6, 2))}
  model = TwoInputs(nnx.Rngs(0))
  pm = jaxpar.parallel.from_nnx(
      model, blocks='blocks', num_stages=2,
      embed=lambda m, i: m.a(i['a']) + m.b(i['b']),
      head_loss=lambda m, y, t: jnp.mean((m.out(y) - t) ** 2))
  trainer = jaxpar.parallel.model_trainer(
      pm, optax.sgd(LR), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
      mesh=mesh(data=2, stage=2))
  with pytest.raises(ValueError, match=r"\['b'\]: 6.*share the batch axis"):
    trainer.step(trainer.init(pm.params), (inputs, np.ones((8, 1))))


# --------------------------------------------- a ResNet with a BatchNorm stem

C = 4


def batch_norm(axis_name, rngs):
  bn = nnx.BatchNorm(C, momentum=0.8, axis_name=axis_name, rngs=rngs, **F64)
  # Flax keeps running statistics in float32; float64 for the 1e-10 check.
  bn.mean, bn.var = (nnx.BatchStat(jnp.zeros(C, jnp.float64)),
                     nnx.BatchStat(jnp.ones(C, jnp.float64)))
  return bn


class ResBlock(nnx.Module):
  def __init__(self, rngs, axis_name=None):
    self.conv1 = nnx.Conv(C, C, (3, 3), rngs=rngs, **F64)
    self.bn1 = batch_norm(axis_name, rngs)
    self.conv2 = nnx.Conv(C, C, (3, 3), rngs=rngs, **F64)
    self.bn2 = batch_norm(axis_name, rngs)

  def __call__(self, x):
    y = jax.nn.relu(self.bn1(self.conv1(x)))
    return jax.nn.relu(x + self.bn2(self.conv2(y)))


class ResNet(nnx.Module):
  def __init__(self, rngs, axis_name=None):
    self.stem_conv = nnx.Conv(3, C, (3, 3), rngs=rngs, **F64)
    self.stem_bn = batch_norm(axis_name, rngs)
    self.blocks = nnx.List([ResBlock(rngs, axis_name) for _ in range(2)])
    self.head = nnx.Linear(C, 4, rngs=rngs, **F64)

  def __call__(self, x):
    h = jax.nn.relu(self.stem_bn(self.stem_conv(x)))
    for block in self.blocks:
      h = block(h)
    return self.head(h.mean((1, 2)))


def test_resnet_with_a_batch_norm_stem_float64(x64):
  """The stem's BatchNorm is a blocks entry of its own (the refusal of
  statistics outside the blocks says so): it runs in stage 0 and its
  running statistics are carried like the blocks'. SyncBatchNorm over
  data=2 x 1F1B: the model as written on one device, run on the global
  microbatches in turn: loss, params and running statistics."""
  rng = np.random.default_rng(0)
  x, t = rng.normal(size=(8, 4, 4, 3)), rng.integers(0, 4, 8)
  with pytest.raises(ValueError, match=r"List the modules.*blocks="
                     r"\['stem_bn', 'blocks'\]"):
    jaxpar.parallel.from_nnx(ResNet(nnx.Rngs(0)), blocks='blocks',
                             num_stages=2, embed=lambda m, x: x,
                             head_loss=lambda m, y, t: y)
  model = ResNet(nnx.Rngs(0), axis_name='data')
  pm = jaxpar.parallel.from_nnx(
      model, blocks=['stem_bn', 'blocks'], num_stages=2,
      embed=lambda m, x: m.stem_conv(x),
      block={'stem_bn': lambda b, h: jax.nn.relu(b(h)),
             'blocks': lambda b, h: b(h)},
      head_loss=lambda m, h, t: xent(m.head(h.mean((1, 2))), t))
  trainer = jaxpar.parallel.model_trainer(
      pm, optax.sgd(LR), schedule=jaxpar.pipeline.one_f_one_b(2, 2),
      mesh=mesh(data=2, stage=2))
  state, stats = trainer.step(trainer.init(pm.params, pm.model_state), (x, t))
  pm.update(model, jax.device_get(trainer.params(state)),
            jax.device_get(state.model_state))

  one = ResNet(nnx.Rngs(0))                      # one device: nothing to sync
  rows = np.arange(8).reshape(2, 2, 2)           # [data, microbatch, row]
  loss = lambda m: sum(xent(m(x[rows[:, i].ravel()]), t[rows[:, i].ravel()])
                       for i in range(2)) / 2
  want, grads = nnx.jit(nnx.value_and_grad(loss))(one)
  nnx.update(one, jax.tree.map(lambda p, g: p - LR * g,
                               nnx.state(one, nnx.Param),
                               nnx.state(grads, nnx.Param)))
  of = lambda m: nnx.to_pure_dict(nnx.state(m, nnx.Any(nnx.Param,
                                                       nnx.BatchStat)))
  tree_allclose((stats.loss, of(model)), (want, of(one)))
