"""What a machine does per second: ``Profile``, the built-in ones, and the
alpha-beta cost of a collective.

A ``Profile`` is a device and its links as numbers: FLOP/s its blocks
reach, its memory, its memory bandwidth, and the latency (alpha) and
bandwidth (beta) of its links -- within a node and, for axes that span
nodes, between them. The built-in GPU profiles take their numbers from the
vendors' datasheets (``source``); ``measure_profile`` (``_calibrate``)
builds one for the devices at hand from a short micro-benchmark.

A collective over ``n`` devices of a ``b``-byte buffer costs (ring
algorithms; Thakur et al., 2005)::

  all-reduce               2 (n-1) alpha + 2 (n-1)/n b / beta
  all-gather, reduce-scatter (n-1) alpha +   (n-1)/n b / beta   (b: whole)
  ppermute (one message)       alpha +           b / beta

Example:
  >>> from jaxpar.planner import PROFILES
  >>> h100 = PROFILES['H100-SXM']
  >>> h100.memory_bytes / 2**30
  80.0
  >>> round(1e6 * h100.collective('all-reduce', 2**30, 8))   # 1 GiB, 8 GPUs
  4218
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'ppermute')
# The remat policies whose one-rank program ``measure_profile`` times
# against ``'dots'`` (``Profile.policy_factors``).
POLICY_FACTORS = ('nothing', 'everything')


def _in_log_tokens(tokens: float, at, values) -> float:
  """``values`` measured at ``at`` tokens, interpolated at ``tokens`` in
  log tokens (held at the ends): how every measured curve is read."""
  return float(np.interp(np.log(tokens), np.log(at), values))


class Profile(NamedTuple):
  """A device and its links.

  Attributes:
    name: for tables.
    flops: FLOP/s one device's training blocks reach (peak x efficiency).
    memory_bytes: memory of one device.
    hbm_bandwidth: bytes/s of device memory (the optimizer update's bound).
    link_bandwidth: bytes/s one device sends within a node (beta).
    link_latency: seconds per message hop within a node (alpha).
    node_devices: devices per node; an axis group wider than this (the
      mesh is ``('data', 'stage', 'tensor')``, tensor innermost) uses
      ``inter_bandwidth`` / ``inter_latency``.
    inter_bandwidth, inter_latency: the same between nodes.
    block_overhead: seconds each layer of a pipeline block (``F``, ``I`` or
      ``W``) costs besides its FLOPs (kernel launches; on a CPU the slower
      rate of small matmuls).
    tick_overhead: seconds of one tick of the pipeline executor's scan
      besides its blocks and messages (its while loops and message switch,
      the slot reads and writes).
    microbatch_overhead: the same for one microbatch of the plain scan a
      single stage rank runs (``stage = 1``).
    block_rates: ``((tokens, FLOP/s), ...)`` measured: the rate one layer's
      ``F + I + W`` reached at that many tokens per microbatch, its fixed
      costs included (``measure_profile``). Where given it replaces
      ``flops`` and ``block_overhead`` for blocks (``rate``): on a CPU one
      64-token sequence runs at half the rate of four, and large
      microbatches fall out of cache, which no line through a few points
      follows.
    block_shares: ``(F, I, W)``: each block's share of a layer's ``F + I +
      W`` time, each run as its own program as the pipeline's tick scan runs
      them (measured; equal on paper). On a CPU ``I``, which holds the
      backward's non-matmul work, takes ~40%: a tick where one rank runs an
      ``I`` and another an ``F`` lasts the ``I`` (``TickTable.makespan``),
      which equal shares under-predict by ~10% for 1F1B and V-Half on 2
      ranks.
    tensor_efficiency: the share of the ideal ``t``-fold speed-up a block's
      compute reaches split over ``tensor`` (its collectives costed apart):
      1 on paper; ``tensor_shares`` replaces it where measured
      (``tensor_share``).
    source: where the numbers come from.
    kind_factors: ``((tokens, (F, I, W, B, R)), ...)`` measured: each pipeline
      block, run as its own program or (the largest tokens, with 2 devices)
      inside a 2-rank step's tick scan, in seconds per second of the
      one-rank program (``block_rates``) at that many tokens per
      microbatch; empty: ``block_shares`` (``block_factors``).
    head_seconds: ``((tokens, seconds), ...)`` measured: the embedding,
      head and loss, forward and backward, for one microbatch of that many
      tokens; a line through them (a fixed cost and one per token) gives
      ``head``. Empty: the head's FLOPs at the block rate.
    zero3_layer_seconds: measured: ZeRO-3's collectives for one layer and
      microbatch as the trainers run them (``data_parallel.gathered``: each
      param array gathered in the forward and again in the backward, its
      gradient reduce-scattered, one at a time). 0: from ``collective``,
      one collective per layer each (on paper).
    alone_speedup: measured: how much faster a process runs a block while
      the other processes wait than while they all run (on a CPU host they
      share, the waiting ones' cores join in); a pipeline tick with idle
      ranks runs its blocks that much faster (``_time``). 1 on paper.
    first_touch_bandwidth: measured: bytes/s at which a step writes the
      buffers it allocates (its temporaries and outputs). On a CPU each
      call maps them afresh and every page faults in on its first write
      (~1.7 GiB/s on 2 processes here, against ~17 in place); 0 (on
      paper): a device's pooled allocator, no cost apart from the writes
      its blocks already pay.
    tensor_shares: ``((tokens, share), ...)`` measured on two devices:
      ``tensor_efficiency`` at that many tokens per microbatch. On a CPU the
      elementwise work that tensor parallelism repeats, and each half
      product's fixed costs, weigh most at small microbatches: 0.26 at 64
      tokens, 0.71 at 512, 0.78 at 2048 here.
    policy_factors: ``((tokens, (nothing, everything)), ...)`` measured:
      the one-rank program (``stage = 1``) under each of
      ``POLICY_FACTORS`` in seconds per second of it under ``'dots'``
      (``policy_factor``). On a CPU its recompute costs less than the
      forward's FLOPs say and storing every residual more than none: 1.05
      and 1.17 here (16 sequences of the CLI's GPT).
  """
  name: str
  flops: float
  memory_bytes: float
  hbm_bandwidth: float
  link_bandwidth: float
  link_latency: float
  node_devices: int = 8
  inter_bandwidth: float | None = None
  inter_latency: float | None = None
  block_overhead: float = 0.0
  tick_overhead: float = 0.0
  microbatch_overhead: float = 0.0
  block_rates: tuple[tuple[float, float], ...] = ()
  block_shares: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)
  tensor_efficiency: float = 1.0
  source: str = ''
  kind_factors: tuple[tuple[float, tuple[float, ...]], ...] = ()
  head_seconds: tuple[tuple[float, float], ...] = ()
  zero3_layer_seconds: float = 0.0
  alone_speedup: float = 1.0
  first_touch_bandwidth: float = 0.0
  tensor_shares: tuple[tuple[float, float], ...] = ()
  policy_factors: tuple[tuple[float, tuple[float, ...]], ...] = ()

  def block_factors(self, tokens: float) -> dict[str, float]:
    """``{'F', 'I', 'W', 'B', 'R'}``: each pipeline block's seconds per
    second of the one-rank program at ``tokens`` per microbatch (``R``:
    ``W`` re-running ``I``'s chain, ``w_recompute``): ``kind_factors``
    interpolated in log tokens (held at its ends), else ``block_shares``
    (``B = I + W``); ``R = I + W`` where not measured.

    Example:
      >>> p = Profile('p', 1e9, 1, 1, 1, 1, kind_factors=(
      ...     (64, (0.4, 0.6, 0.4, 0.8)), (256, (0.3, 0.4, 0.3, 0.6))))
      >>> [round(v, 2) for v in p.block_factors(128).values()]
      [0.35, 0.5, 0.35, 0.7, 0.85]
    """
    if not self.kind_factors:
      f, i, w = self.block_shares
      return {'F': f, 'I': i, 'W': w, 'B': i + w, 'R': i + w}
    at, values = zip(*self.kind_factors)
    out = {k: _in_log_tokens(tokens, at, column)
           for k, column in zip('FIWBR', zip(*values))}
    out.setdefault('R', out['I'] + out['W'])
    return out

  def tensor_share(self, tokens: float) -> float:
    """The share of the ideal speed-up over ``tensor`` at ``tokens`` per
    microbatch: ``tensor_shares`` interpolated in log tokens (held at its
    ends), else ``tensor_efficiency``.

    Example:
      >>> p = Profile('p', 1e9, 1, 1, 1, 1, tensor_shares=((64, 0.3),
      ...                                                  (1024, 0.7)))
      >>> p.tensor_share(256), p.tensor_share(4096), Profile(
      ...     'q', 1e9, 1, 1, 1, 1, tensor_efficiency=0.8).tensor_share(64)
      (0.5, 0.7, 0.8)
    """
    if not self.tensor_shares:
      return self.tensor_efficiency
    at, shares = zip(*self.tensor_shares)
    return _in_log_tokens(tokens, at, shares)

  def policy_factor(self, policy: str, tokens: float) -> float | None:
    """The one-rank program's seconds under ``policy`` per second of it
    under ``'dots'`` at ``tokens`` per microbatch: ``policy_factors``
    interpolated in log tokens (held at its ends); 1 for ``'dots'``;
    ``None`` where not measured (the time model then counts the
    recompute's FLOPs).

    Example:
      >>> p = Profile('p', 1e9, 1, 1, 1, 1, policy_factors=(
      ...     (64, (1.2, 1.0)), (1024, (1.0, 1.2))))
      >>> p.policy_factor('nothing', 256), p.policy_factor('dots', 64)
      (1.1, 1.0)
      >>> p.policy_factor('dots_no_batch', 64) is None
      True
    """
    if policy == 'dots':
      return 1.0
    if not self.policy_factors or policy not in POLICY_FACTORS:
      return None
    at, values = zip(*self.policy_factors)
    column = [v[POLICY_FACTORS.index(policy)] for v in values]
    return _in_log_tokens(tokens, at, column)

  def head(self, tokens: float) -> float | None:
    """Seconds of the embedding, head and loss (forward and backward) of
    one microbatch of ``tokens``: the line through ``head_seconds``
    (``None`` without).

    Example:
      >>> p = Profile('p', 1e9, 1, 1, 1, 1, head_seconds=((64, 2e-3),
      ...                                                  (1024, 5e-3)))
      >>> round(p.head(2048), 6)
      0.0082
    """
    if not self.head_seconds:
      return None
    (t0, s0), (t1, s1) = self.head_seconds[0], self.head_seconds[-1]
    slope = (s1 - s0) / (t1 - t0) if t1 != t0 else 0.0
    return max(s0 + slope * (tokens - t0), 0.0)

  def rate(self, tokens: float) -> tuple[float, float]:
    """``(FLOP/s, seconds of fixed cost per layer-block)`` of a block at
    ``tokens`` per microbatch: ``block_rates`` interpolated in log tokens
    (held at its ends), fixed costs included; else ``flops``,
    ``block_overhead``.

    Example:
      >>> p = Profile('p', 1e9, 1, 1, 1, 1, block_rates=((64, 1e9), (256, 4e9)))
      >>> p.rate(128)[0] / 1e9, p.rate(4096)
      (2.5, (4000000000.0, 0.0))
    """
    if not self.block_rates:
      return self.flops, self.block_overhead
    tokens_at, rates = zip(*self.block_rates)
    return _in_log_tokens(tokens, tokens_at, rates), 0.0

  def collective(self, kind: str, nbytes: float, n: int, *,
                 span: int | None = None) -> float:
    """Seconds of one ``kind`` collective of ``nbytes`` over ``n`` devices.

    ``span``: how many consecutive devices the group covers (``n`` times
    its stride in the mesh); beyond ``node_devices`` the inter-node link.
    """
    if n <= 1:
      return 0.0
    inter = (span or n) > self.node_devices and self.inter_bandwidth
    beta = self.inter_bandwidth if inter else self.link_bandwidth
    alpha = (self.inter_latency or self.link_latency) if inter else (
        self.link_latency)
    if kind == 'all-reduce':
      return 2 * (n - 1) * alpha + 2 * (n - 1) / n * nbytes / beta
    if kind in ('all-gather', 'reduce-scatter'):
      return (n - 1) * alpha + (n - 1) / n * nbytes / beta
    if kind == 'ppermute':
      return alpha + nbytes / beta
    raise ValueError(f'kind={kind!r} is not one of {KINDS}.')


# Dense BF16 tensor-core peak x 0.4 (the model FLOPs utilisation that
# Megatron-LM and torchtitan report for 8B-70B training on H100s is 38-45%).
_MFU = 0.4
# Per-tick and per-layer costs on a GPU are ESTIMATES, not measured (no GPU
# here): on XLA:GPU each of a tick's 5 branch ops (4 zero-or-one-trip while
# loops and the message switch; ``pipeline.executor``'s ``_tick_scan``)
# reads its predicate back to the host, ~10 us each (a device-to-host copy
# and a stream sync); a plain scan's trip reads one; a layer's block is
# ~10 fused kernels at ~2 us each to launch.
_GPU_OVERHEADS = {'block_overhead': 20e-6, 'tick_overhead': 50e-6,
                  'microbatch_overhead': 10e-6}
PROFILES = {
    'H100-SXM': Profile(
        'H100-SXM', flops=989e12 * _MFU, memory_bytes=80 * 2**30,
        hbm_bandwidth=3.35e12, link_bandwidth=450e9, link_latency=3e-6,
        node_devices=8, inter_bandwidth=50e9, inter_latency=10e-6,
        **_GPU_OVERHEADS,
        source='NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16, 80 GB '
        'HBM3 at 3.35 TB/s, NVLink 4 900 GB/s (450 GB/s each way); one 400 '
        'Gb/s NDR InfiniBand NIC per GPU between nodes (50 GB/s); blocks at '
        '40% of peak; overheads per layer-block, tick and microbatch: '
        'estimates, not measured (docs/planning.md)'),
    'A100-SXM-80GB': Profile(
        'A100-SXM-80GB', flops=312e12 * _MFU, memory_bytes=80 * 2**30,
        hbm_bandwidth=2.0e12, link_bandwidth=300e9, link_latency=3e-6,
        node_devices=8, inter_bandwidth=25e9, inter_latency=10e-6,
        **_GPU_OVERHEADS,
        source='NVIDIA A100 80GB SXM datasheet: 312 TFLOP/s dense BF16, '
        '2.0 TB/s HBM2e, NVLink 3 600 GB/s (300 each way); one 200 Gb/s HDR '
        'InfiniBand NIC per GPU (25 GB/s); blocks at 40% of peak; overheads '
        'per layer-block, tick and microbatch: estimates, not measured '
        '(docs/planning.md)'),
}
