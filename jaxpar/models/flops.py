"""Model FLOPs of a GPT, and the peak FLOP/s of the device they run on.

Training FLOPs per token (PaLM, Chowdhery et al. 2022, appendix B)::

  flops_per_token = 6 N + 12 L d S

* ``6 N``: every matmul weight does one multiply-add (2 FLOPs) per token in
  the forward and two in the backward (input and weight gradients). ``N``
  counts the parameters of the matmuls and of what runs beside them (biases,
  LayerNorms, LM head), but not the token and position embeddings, which
  are looked up, not multiplied.
* ``12 L d S``: attention's ``Q K^T`` and ``A V``, ``2 S d`` multiply-adds
  per token and layer forward, times 3 for the backward; counted over the
  full ``S x S`` score matrix (the causal mask's zeros too), as in PaLM.

Model FLOPs count what the model needs, not what the hardware runs: no
recomputation, no pipeline identity slots. ``achieved = flops_per_token x
tokens/s``; MFU is ``achieved / peak``.
"""

from __future__ import annotations

from typing import Any

from jaxpar.models.gpt import GPTConfig

# Dense bf16 tensor-core peaks (no sparsity), FLOP/s, from NVIDIA's data
# sheets: H100 SXM5 989.4 TFLOP/s; H200 has the same chip (989.4).
PEAK_FLOPS = {'H100': 989e12, 'H200': 989e12}


def gpt_params_without_embeddings(config: GPTConfig) -> int:
  """``N``: the GPT's parameters minus the token and position tables.

  Per block ``4 (d^2 + d)`` attention (q, k, v, out with biases),
  ``2 r d^2 + r d + d`` MLP (``r = mlp_ratio``), ``4 d`` for two
  LayerNorms; then ``2 d`` final LayerNorm and ``d V + V`` LM head.

  Example:
    >>> import jax
    >>> from flax import nnx
    >>> from jaxpar.models import flops
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig()
    >>> model = gpt.GPT(config, rngs=nnx.Rngs(0))
    >>> params = gpt.gpt_params(model)
    >>> total = sum(x.size for x in jax.tree.leaves(params))
    >>> embeddings = params['embed']['embedding'].size + params['pos'].size
    >>> flops.gpt_params_without_embeddings(config) == total - embeddings
    True
  """
  d, r, v = config.d_model, config.mlp_ratio, config.vocab_size
  block = 4 * (d * d + d) + (2 * r * d * d + r * d + d) + 4 * d
  return config.num_layers * block + 2 * d + d * v + v


def gpt_flops_per_token(config: GPTConfig) -> int:
  """Training FLOPs per token, forward and backward: ``6 N + 12 L d S``.

  Example:
    >>> from jaxpar.models import flops
    >>> from jaxpar.models import gpt
    >>> config = gpt.GPTConfig(vocab_size=256, seq_len=64, d_model=128,
    ...                        num_heads=4, num_layers=4)
    >>> flops.gpt_flops_per_token(config)       # 6 x 826,368 + 12 x 4 x 128 x 64
    5351424
  """
  attention = 12 * config.num_layers * config.d_model * config.seq_len
  return 6 * gpt_params_without_embeddings(config) + attention


def peak_flops(device: Any) -> float | None:
  """Dense bf16 peak FLOP/s of a known GPU (``device.device_kind``), else None.

  Known: ``PEAK_FLOPS`` (H100, H200: 989 TFLOP/s). CPUs and other GPUs give
  ``None``: no MFU is claimed against a guessed peak.

  Example:
    >>> import jax
    >>> from jaxpar.models import flops
    >>> flops.peak_flops(jax.devices()[0]) is None          # a CPU
    True
  """
  if getattr(device, 'platform', None) != 'gpu':
    return None
  kind = str(getattr(device, 'device_kind', ''))
  return next((peak for name, peak in PEAK_FLOPS.items() if name in kind),
              None)
