"""``python -m jaxpar demo``: data-parallel training on 8 simulated CPU devices."""

from __future__ import annotations

import argparse
import json
import time


def _parse(argv):
  parser = argparse.ArgumentParser(prog='python -m jaxpar demo',
                                   description=__doc__)
  parser.add_argument('--steps', type=int, default=200)
  parser.add_argument('--batch', type=int, default=256)
  parser.add_argument('--microbatches', type=int, default=1)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--devices', type=int, default=8)
  parser.add_argument('--json', metavar='PATH')
  args = parser.parse_args(argv)
  for name in ('steps', 'batch', 'microbatches', 'devices'):
    if getattr(args, name) < 1:
      parser.error(f'--{name} must be >= 1, got {getattr(args, name)}')
  if args.batch % (args.devices * args.microbatches):
    parser.error(f'--batch {args.batch} must be a multiple of --devices x '
                 f'--microbatches = {args.devices * args.microbatches}')
  return args


def main(argv: list[str] | None = None) -> int:
  args = _parse(argv)
  import jaxpar  # pylint: disable=g-import-not-at-top
  jaxpar.simulate_cpu_devices(args.devices)
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from tqdm import tqdm  # pylint: disable=g-import-not-at-top

  # A learnable synthetic task: regress a random teacher MLP.
  dims = 32
  model = nnx.Sequential(nnx.Linear(dims, 128, rngs=nnx.Rngs(args.seed)),
                         nnx.gelu, nnx.Linear(128, dims, rngs=nnx.Rngs(args.seed + 1)))
  graphdef, params = nnx.split(model, nnx.Param)
  teacher = np.random.default_rng(args.seed + 2).normal(size=(dims, dims)) / dims**0.5

  def loss_fn(params, batch):
    pred = nnx.merge(graphdef, params)(batch['x'])
    return optax.losses.squared_error(pred, batch['y']).mean()

  optimizer = optax.adam(3e-3)
  mesh = jaxpar.make_mesh(data=jax.device_count())
  step = jaxpar.data_parallel_step(loss_fn, optimizer, mesh=mesh,
                                   num_microbatches=args.microbatches,
                                   max_grad_norm=1.0)
  state = jaxpar.TrainState.create(params, optimizer)
  rng = np.random.default_rng(args.seed + 3)
  history = []
  bar = tqdm(range(args.steps), desc='data-parallel', unit='step')
  start = time.perf_counter()
  for i in bar:
    x = rng.normal(size=(args.batch, dims)).astype(np.float32)
    batch = {'x': x, 'y': np.sin(x @ teacher).astype(np.float32)}
    t0 = time.perf_counter()
    state, stats = step(state, batch)
    loss = float(stats.loss)
    seconds = time.perf_counter() - t0
    history.append({'step': i, 'loss': loss, 'grad_norm': float(stats.grad_norm),
                    'seconds': seconds})
    bar.set_postfix(loss=f'{loss:.4f}', examples_s=f'{args.batch / seconds:,.0f}')
  total = time.perf_counter() - start
  first, last = history[0]['loss'], history[-1]['loss']
  print(f'\nmesh        data={mesh.shape["data"]} ({jax.device_count()} '
        f'{jax.default_backend()} devices)\n'
        f'steps       {args.steps} x batch {args.batch} '
        f'({args.microbatches} microbatch(es) per device)\n'
        f'loss        {first:.4f} -> {last:.4f}\n'
        f'throughput  {args.steps * args.batch / total:,.0f} examples/s '
        f'(incl. compile)')
  if args.json:
    with open(args.json, 'w') as f:
      json.dump({'config': vars(args), 'steps': history}, f, indent=1)
  return 0
