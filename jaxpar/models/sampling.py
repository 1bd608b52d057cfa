"""Text from a trained GPT: greedy or temperature sampling, one token a step.

The dense model (``gpt.gpt_apply``) predicts the next token from the last
``config.seq_len`` tokens at most (its position table's length)::

  window_t = tokens[max(0, n_t - S) : n_t]          n_t = prompt + t tokens
  next_t   = argmax(logits_t)                       temperature 0 (greedy)
           ~ softmax(logits_t / temperature)        temperature > 0

Short windows are left-aligned in a zero-padded ``[1, S]`` buffer: causal
attention makes the logits at position ``n_t - 1`` blind to the padding, so
every step runs one program of one shape (a ``lax.scan`` over the new
tokens, no cache). Params may be sharded (``Trainer.params``): ``jit``
partitions the forward and never gathers the model on purpose.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar._validate import check_int
from jaxpar.models import gpt


def _check(prompt, length, temperature, key, config) -> np.ndarray:
  prompt = np.asarray(prompt)
  if prompt.ndim != 1 or prompt.size == 0 or not np.issubdtype(
      prompt.dtype, np.integer):
    raise ValueError(f'prompt must be a non-empty 1-D array of token ids, got '
                     f'shape {prompt.shape} dtype {prompt.dtype}; e.g. '
                     "np.frombuffer(b'Once', np.uint8).")
  if prompt.min() < 0 or prompt.max() >= config.vocab_size:
    raise ValueError(f'prompt ids must lie in [0, {config.vocab_size}), got '
                     f'[{prompt.min()}, {prompt.max()}].')
  length = check_int('length', length, fix='(tokens to generate)')
  if not (isinstance(temperature, (int, float, np.floating))
          and not isinstance(temperature, bool)):
    raise TypeError(f'temperature={temperature!r} must be a number.')
  if not math.isfinite(temperature) or temperature < 0:
    raise ValueError(f'temperature={temperature} must be finite and >= 0 '
                     '(0: greedy).')
  if temperature > 0 and key is None:
    raise ValueError(f'temperature={temperature} samples: pass key=, e.g. '
                     'jax.random.key(0), or temperature=0 for greedy.')
  return prompt.astype(np.int32)


def generate(params: dict, prompt, *, config: gpt.GPTConfig, length: int,
             temperature: float = 0.0, key: jax.Array | None = None
             ) -> jax.Array:
  """``length`` tokens that follow ``prompt``, from the dense GPT's params.

  Args:
    params: ``gpt.gpt_params(model)`` or ``gpt.merge_from_pipeline(...)``.
    prompt: int ``[P]``, ``P >= 1`` token ids (bytes for a byte-level model).
    config: the model's ``GPTConfig``.
    length: new tokens to generate.
    temperature: 0 picks the most likely token (greedy); ``T > 0`` samples
      from ``softmax(logits / T)`` with ``key``.
    key: a ``jax.random.key``, needed when ``temperature > 0``.

  Returns:
    int32 ``[length]``: the new tokens only.

  Example:
    >>> import jax.numpy as jnp, numpy as np
    >>> from flax import nnx
    >>> from jaxpar.models import gpt, sampling
    >>> config = gpt.GPTConfig(vocab_size=16, seq_len=4, d_model=8,
    ...                        num_heads=2, num_layers=1)
    >>> params = gpt.gpt_params(gpt.GPT(config, rngs=nnx.Rngs(0)))
    >>> out = sampling.generate(params, np.array([1, 2]), config=config,
    ...                         length=6)
    >>> out.shape                     # longer than seq_len: a sliding window
    (6,)
    >>> first = jnp.argmax(gpt.gpt_apply(params, jnp.array([[1, 2]]),
    ...                                  config=config)[0, -1])
    >>> bool(out[0] == first)
    True
  """
  prompt = _check(prompt, length, temperature, key, config)
  if key is None:
    key = jax.random.key(0)   # unused by greedy decoding
  return _generate(params, jnp.asarray(prompt), key, config=config,
                   length=int(length), temperature=float(temperature))


@functools.partial(jax.jit, static_argnames=('config', 'length', 'temperature'))
def _generate(params, prompt, key, *, config, length, temperature):
  s, n0 = config.seq_len, prompt.shape[0]
  # tokens[:n] are known; a window of S starts at max(0, n - S).
  tokens = jnp.zeros(max(n0 + length, s), jnp.int32).at[:n0].set(prompt)

  def step(tokens, t):
    n = n0 + t
    start = jnp.maximum(n - s, 0)
    window = jax.lax.dynamic_slice(tokens, (start,), (s,))
    logits = gpt.gpt_apply(params, window[None], config=config)[0, n - 1 - start]
    if temperature == 0:
      new = jnp.argmax(logits).astype(jnp.int32)
    else:
      new = jax.random.categorical(jax.random.fold_in(key, t),
                                   logits / temperature).astype(jnp.int32)
    return tokens.at[n].set(new), new

  return jax.lax.scan(step, tokens, jnp.arange(length))[1]
