"""Collectives counted from compiled HLO: CPU programs and GPU-style text."""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

import jaxpar
from jaxpar import hlo

N = 4


@pytest.fixture(scope='module')
def mesh():
  return jaxpar.make_mesh(tensor=N, devices=jax.devices()[:N])


def compile_on(mesh, fn, x, spec=P('tensor'), out_specs=P('tensor')):
  f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=out_specs))
  return f.lower(jax.device_put(x, NamedSharding(mesh, spec))).compile()


def every_kind(x):   # x: f32[4] shard of f32[16]
  gathered = jax.lax.all_gather(x, 'tensor', tiled=True)                 # [16]
  return (jax.lax.psum(x, 'tensor'),
          gathered,
          jax.lax.psum_scatter(gathered, 'tensor', tiled=True),          # [4]
          jax.lax.ppermute(x, 'tensor', [(i, (i + 1) % N) for i in range(N)]),
          jax.lax.all_to_all(gathered.reshape(N, -1), 'tensor', 0, 0,
                             tiled=True))                                # [4,4]


def test_one_of_each_kind(mesh):
  compiled = compile_on(mesh, every_kind, jnp.arange(16.0))
  assert hlo.collective_counts(compiled) == dict.fromkeys(hlo.KINDS, 1)
  # f32: shard 16 B, gathered/unscattered 64 B, all-to-all buffer 64 B.
  assert hlo.collective_bytes(compiled) == {
      'all-reduce': 16, 'all-gather': 64, 'reduce-scatter': 64,
      'collective-permute': 16, 'all-to-all': 64}
  ops = {c.kind: c for c in hlo.collectives(compiled)}
  assert (ops['all-gather'].operand_bytes, ops['all-gather'].result_bytes) == (
      16, 64)
  assert (ops['reduce-scatter'].operand_bytes,
          ops['reduce-scatter'].result_bytes) == (64, 16)
  # Text in, same answer.
  assert hlo.collective_counts(compiled.as_text()) == hlo.collective_counts(
      compiled)


def test_no_collectives(mesh):
  compiled = compile_on(mesh, lambda x: 2 * x, jnp.arange(16.0))
  assert hlo.collectives(compiled) == []
  assert hlo.collective_counts(compiled) == dict.fromkeys(hlo.KINDS, 0)


def test_collectives_scale_with_the_program(mesh):
  """Two dependent psums are two ops, of float64 size."""
  with jax.enable_x64(True):
    compiled = compile_on(
        mesh, lambda x: jax.lax.psum(x * jnp.sin(jax.lax.psum(x, 'tensor')),
                                     'tensor'),
        jnp.arange(16.0), out_specs=P())
  assert hlo.collective_counts(compiled)['all-reduce'] == 2
  assert hlo.collective_bytes(compiled)['all-reduce'] == 2 * 4 * 8


def test_loop_body_counts_once(mesh):
  def ring(x):
    def body(carry, _):
      return jax.lax.ppermute(carry, 'tensor',
                              [(i, (i + 1) % N) for i in range(N)]), None
    return jax.lax.scan(body, x, None, length=5)[0]
  counts = hlo.collective_counts(compile_on(mesh, ring, jnp.arange(16.0)))
  assert counts['collective-permute'] == 1


# GPU-style text: async start/done pairs, an async-wrapped reduce-scatter,
# operand shapes printed inline, a combined (variadic) all-reduce, names
# without '%'.
GPU_TEXT = """\
HloModule jit_f, is_scheduled=true, num_partitions=4

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %add.1 = f32[] add(f32[] %x, f32[] %y)
}

%async_computation (param_0: bf16[16,8]) -> bf16[4,8] {
  %param_0 = bf16[16,8]{1,0} parameter(0)
  ROOT %reduce-scatter.1 = bf16[4,8]{1,0} reduce-scatter(bf16[16,8]{1,0} %param_0), channel_id=3, replica_groups={{0,1,2,3}}, dimensions={0}, to_apply=%add
}

ENTRY %main (p0: f32[4], p1: bf16[16,8], p2: f64[2,3]) -> f32[16] {
  %p0 = f32[4]{0} parameter(0)
  %p1 = bf16[16,8]{1,0} parameter(1)
  p2 = f64[2,3]{1,0} parameter(2)
  %all-gather-start = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="jit(f)/all_gather"}
  %all-gather-done = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %all-gather-start)
  all-reduce-start = f64[2,3]{1,0} all-reduce-start(p2), channel_id=2, replica_groups={{0,1,2,3}}, to_apply=%add
  all-reduce-done = f64[2,3]{1,0} all-reduce-done(all-reduce-start)
  %reduce-scatter-start = ((bf16[16,8]{1,0}), bf16[4,8]{1,0}) async-start(bf16[16,8]{1,0} %p1), calls=%async_computation
  %reduce-scatter-done = bf16[4,8]{1,0} async-done(((bf16[16,8]{1,0}), bf16[4,8]{1,0}) %reduce-scatter-start)
  %collective-permute-start = (f32[16]{0}, f32[16]{0}, u32[], u32[]) collective-permute-start(f32[16]{0} %all-gather-done), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %collective-permute-done = f32[16]{0} collective-permute-done((f32[16]{0}, f32[16]{0}, u32[], u32[]) %collective-permute-start)
  %all-reduce.7 = (f32[16]{0}, f32[4]{0}) all-reduce(f32[16]{0} %collective-permute-done, f32[4]{0} %p0), channel_id=5, replica_groups={{0,1,2,3}}, to_apply=%add
  ROOT %get-tuple-element = f32[16]{0} get-tuple-element(%all-reduce.7), index=0
}
"""


def test_gpu_style_async_text():
  assert hlo.collective_counts(GPU_TEXT) == {
      'all-reduce': 2, 'all-gather': 1, 'reduce-scatter': 1,
      'collective-permute': 1, 'all-to-all': 0}
  assert hlo.collective_bytes(GPU_TEXT) == {
      'all-reduce': 2 * 3 * 8 + (16 + 4) * 4,   # f64[2,3]; f32[16] + f32[4]
      'all-gather': 16 * 4,                      # the -done's f32[16]
      'reduce-scatter': 16 * 8 * 2,              # bf16[16,8] before scatter
      'collective-permute': 16 * 4,
      'all-to-all': 0}
  names = [c.name for c in hlo.collectives(GPU_TEXT)]
  assert names == ['reduce-scatter.1', 'all-gather-start', 'all-reduce-start',
                   'collective-permute-start', 'all-reduce.7']


def test_rejects_uncompiled_and_other_objects(mesh):
  f = jax.jit(jax.shard_map(lambda x: x, mesh=mesh, in_specs=P('tensor'),
                            out_specs=P('tensor')))
  lowered = f.lower(jax.device_put(np.zeros(4, np.float32),
                                   NamedSharding(mesh, P('tensor'))))
  with pytest.raises(TypeError, match=r'pass lowered.compile\(\)'):
    hlo.collective_counts(lowered)
  with pytest.raises(TypeError, match='got int'):
    hlo.collective_bytes(3)
