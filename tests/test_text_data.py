"""Byte-level text data, sampling and model FLOPs: the split, batches as a
pure function of (seed, step), their bounds, bad files refused with the
path and the fix, generation against the dense model step by step, and
6N + 12LdS against a hand count."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxpar
from jaxpar.cli import text_data as data, demo
from jaxpar.models import flops
from jaxpar.models import gpt, sampling


def test_split_holds_out_the_last_tenth():
  tokens = np.arange(1000) % 256
  parts = data.split(tokens.astype(np.uint8))
  assert len(parts.train) == 900 and len(parts.held_out) == 100
  np.testing.assert_array_equal(np.concatenate(parts), tokens)


def test_load_text_reads_bytes_and_splits(tmp_path):
  raw = ('héllo wörld\n' * 100).encode()
  path = tmp_path / 'text.txt'
  path.write_bytes(raw)
  parts = data.load_text(path, seq_len=16)
  assert parts.train.dtype == np.uint8
  assert parts.train.tobytes() + parts.held_out.tobytes() == raw
  assert len(parts.held_out) == len(raw) // 10


def test_batches_are_a_pure_function_of_seed_and_step():
  tokens = np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint8)
  kw = dict(batch=8, seq_len=32)
  a = data.text_batch(tokens, seed=1, step=7, **kw)
  np.testing.assert_array_equal(a, data.text_batch(tokens, seed=1, step=7,
                                                   **kw))
  assert not np.array_equal(a[0], data.text_batch(tokens, seed=1, step=8,
                                                  **kw)[0])
  assert not np.array_equal(a[0], data.text_batch(tokens, seed=2, step=7,
                                                  **kw)[0])
  ids, targets = a
  assert ids.shape == targets.shape == (8, 32) and ids.dtype == np.int32
  np.testing.assert_array_equal(ids[:, 1:], targets[:, :-1])
  # Each row is a window of the text: find it.
  for row_ids, row_targets in zip(ids, targets):
    start = next(s for s in range(len(tokens) - 32)
                 if np.array_equal(tokens[s:s + 32], row_ids))
    assert tokens[start + 32] == row_targets[-1]


def test_batches_reach_both_ends_and_stay_inside():
  """A text of exactly seq_len + 1 bytes has one window; longer texts are
  sampled up to the last byte, never past it."""
  seq_len = 6
  tokens = np.arange(seq_len + 1, dtype=np.uint8)
  ids, targets = data.text_batch(tokens, seed=0, step=0, batch=4,
                                 seq_len=seq_len)
  np.testing.assert_array_equal(ids, np.tile(tokens[:-1], (4, 1)))
  np.testing.assert_array_equal(targets, np.tile(tokens[1:], (4, 1)))
  tokens = np.arange(20, dtype=np.uint8)
  firsts = np.concatenate([data.text_batch(tokens, seed=0, step=s, batch=64,
                                           seq_len=seq_len)[0][:, 0]
                           for s in range(4)])
  assert firsts.min() == 0 and firsts.max() == 20 - seq_len - 1
  ids, targets = data.held_out_batch(tokens, batch=5, seq_len=seq_len)
  assert ids[0, 0] == 0 and targets[-1, -1] == 19
  with pytest.raises(ValueError, match='fewer than one sequence'):
    data.text_batch(tokens[:seq_len], seed=0, step=0, batch=1,
                    seq_len=seq_len)


def test_bad_arguments_name_the_value():
  tokens = np.zeros(100, np.uint8)
  with pytest.raises(TypeError, match='batch=True must be an int'):
    data.text_batch(tokens, seed=0, step=0, batch=True, seq_len=4)
  with pytest.raises(ValueError, match='seq_len=0 must be an int >= 1'):
    data.held_out_batch(tokens, batch=2, seq_len=0)
  assert data.text_batch(tokens, seed=0, step=0, batch=np.int64(2),
                         seq_len=4)[0].shape == (2, 4)


@pytest.mark.parametrize('case,message', [
    ('missing', 'no such file'),
    ('directory', 'is a directory'),
    ('empty', 'has 0 bytes'),
    ('short', 'has 100 bytes; sequences of 64 bytes need at least 650'),
])
def test_bad_files_are_refused_with_the_path_and_the_fix(tmp_path, case,
                                                         message):
  path = tmp_path / case
  if case == 'directory':
    path.mkdir()
  elif case == 'empty':
    path.write_bytes(b'')
  elif case == 'short':
    path.write_bytes(b'x' * 100)
  with pytest.raises(ValueError, match=message) as e:
    data.load_text(path, seq_len=64)
  assert str(path) in str(e.value) and '\n' not in str(e.value)
  assert data.min_file_size(64) == 650


def test_unigram_entropy():
  uniform = np.arange(256, dtype=np.uint8).repeat(3)
  np.testing.assert_allclose(data.unigram_entropy(uniform), np.log(256))
  assert data.unigram_entropy(np.zeros(10, np.uint8)) == 0.0


def random_params(config: gpt.GPTConfig, dtype=np.float32) -> dict:
  """Random params of ``gpt_params``' structure (``eval_shape``: building
  the model eagerly compiles dozens of tiny programs)."""
  shapes = gpt.gpt_params(nnx.eval_shape(lambda: gpt.GPT(config,
                                                          rngs=nnx.Rngs(0))))
  rng = np.random.default_rng(1)
  return jax.tree.map(
      lambda s: rng.normal(scale=0.3, size=s.shape).astype(dtype), shapes)


def test_held_out_loss_on_the_mesh_is_the_dense_loss(x64):
  """The demo's evaluation: the dense loss of the sharded params (ZeRO-3,
  interleaved stages on 2x2x2) equals gpt_loss on one device, float64."""
  config = gpt.GPTConfig(vocab_size=256, seq_len=8, d_model=16, num_heads=2,
                         num_layers=4)
  params = random_params(config, np.float64)
  pp, layout = gpt.split_for_pipeline(params, num_stages=4)
  trainer = jaxpar.parallel.trainer(
      gpt.embed_fn, gpt.stage_fn, gpt.head_loss_fn, optax.adam(1e-3),
      schedule=jaxpar.pipeline.interleaved_one_f_one_b(2, 2, 2),
      mesh=jaxpar.make_mesh(data=2, stage=2, tensor=2),
      stage_mask=layout.mask, zero_stage=3, tensor_rules=gpt.TENSOR_RULES)
  text = data.split(np.frombuffer(open(__file__, 'rb').read(), np.uint8))
  evaluate = demo.held_out_loss(trainer, layout, config, text, batch=8)
  held = data.held_out_batch(text.held_out, batch=8, seq_len=8)
  np.testing.assert_allclose(evaluate(trainer.init(pp)),
                             gpt.gpt_loss(params, held, config=config),
                             rtol=1e-10)


TINY = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8, num_heads=2,
                     num_layers=2)


def test_flops_per_token_by_hand():
  """L=2, d=8, V=16, S=4, r=4: per block q,k,v,o 4*(64+8)=288, MLP
  8*32+32 + 32*8+8 = 552, two LayerNorms 32 -> 872; final LN 16, head
  8*16+16 = 144: N = 2*872 + 160 = 1904. Attention 12*2*8*4 = 768."""
  assert flops.gpt_params_without_embeddings(TINY) == 1904
  assert flops.gpt_flops_per_token(TINY) == 6 * 1904 + 768
  params = gpt.gpt_params(nnx.eval_shape(lambda: gpt.GPT(TINY,
                                                          rngs=nnx.Rngs(0))))
  total = sum(x.size for x in jax.tree.leaves(params))
  assert total == 1904 + 16 * 8 + 4 * 8   # + token and position tables


def test_peak_flops_only_for_known_gpus():
  class Device:
    def __init__(self, platform, kind):
      self.platform, self.device_kind = platform, kind
  assert flops.peak_flops(Device('gpu', 'NVIDIA H100 80GB HBM3')) == 989e12
  assert flops.peak_flops(Device('gpu', 'NVIDIA H200')) == 989e12
  assert flops.peak_flops(Device('gpu', 'Tesla T4')) is None
  assert flops.peak_flops(jax.devices()[0]) is None


@pytest.fixture(scope='module')
def tiny_params():
  return random_params(TINY)


def _reference(params, prompt, length, pick):
  """Token by token: the dense model on the last seq_len tokens."""
  apply = jax.jit(gpt.gpt_apply, static_argnames='config')
  tokens = list(prompt)
  for t in range(length):
    window = jnp.array([tokens[-TINY.seq_len:]])
    logits = apply(params, window, config=TINY)[0, -1]
    tokens.append(int(pick(logits, t)))
  return tokens[len(prompt):]


def test_greedy_generation_is_argmax_of_the_dense_model(tiny_params):
  prompt = np.array([3, 1, 4])
  out = sampling.generate(tiny_params, prompt, config=TINY, length=5)
  assert out.dtype == jnp.int32
  # 3 + 5 tokens > seq_len 4: the window slides.
  assert out.tolist() == _reference(tiny_params, prompt, 5,
                                    lambda logits, t: jnp.argmax(logits))


def test_temperature_samples_with_the_key(tiny_params):
  key, temperature = jax.random.key(5), 0.7
  out = sampling.generate(tiny_params, [2], config=TINY, length=5,
                          temperature=temperature, key=key)
  assert out.tolist() == _reference(
      tiny_params, [2], 5, lambda logits, t: jax.random.categorical(
          jax.random.fold_in(key, t), logits / temperature))
  other = sampling.generate(tiny_params, [2], config=TINY, length=5,
                            temperature=temperature, key=jax.random.key(6))
  assert other.tolist() != out.tolist()


@pytest.mark.parametrize('kwargs,error,message', [
    (dict(prompt=[]), ValueError, 'non-empty 1-D'),
    (dict(prompt=[16]), ValueError, r'lie in \[0, 16\)'),
    (dict(length=True), TypeError, 'length=True must be an int'),
    (dict(length=0), ValueError, 'length=0 must be an int >= 1'),
    (dict(temperature=-1.0), ValueError, 'finite and >= 0'),
    (dict(temperature=0.5), ValueError, 'pass key='),
])
def test_generate_refuses_bad_arguments(tiny_params, kwargs, error, message):
  args = dict(prompt=[1], length=2, temperature=0.0) | kwargs
  with pytest.raises(error, match=message):
    sampling.generate(tiny_params, args.pop('prompt'), config=TINY, **args)
