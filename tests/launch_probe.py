"""A process for ``jaxpar.distributed.launch`` tests that starts instantly (no JAX).

``python -m launch_probe env DIR`` writes the ``JAXPAR_*`` variables it got to
``DIR/<JAXPAR_PROCESS_ID>.json`` (and the cores it may run on, as
``"cores"``); ``fail RANK``: process ``RANK`` exits with
``FAIL_CODE`` at once, the others sleep; ``sleep``: all sleep; ``stubborn
DIR``: all write their pid to ``DIR/<JAXPAR_PROCESS_ID>.pid``, print a line
and sleep, ignoring SIGTERM as a JAX worker of a ``jax.distributed`` job does
(its preemption notifier takes the signal), so only SIGKILL stops them;
``stuck RANK``: two JAX processes (``JAXPAR_LOCAL_DEVICE_COUNT`` devices each,
``Timeouts(collective=5, shutdown=3)``) run a step with an all-reduce, in
which process ``RANK`` sleeps forever (an ``io_callback``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

FAIL_CODE = 3
SLEEP_S = 120


def main(argv: list[str]) -> int:
  mode, rank = argv[0], os.environ['JAXPAR_PROCESS_ID']
  if mode == 'env':
    with open(os.path.join(argv[1], f'{rank}.json'), 'w') as f:
      json.dump({**{k: v for k, v in os.environ.items()
                    if k.startswith('JAXPAR_')},
                 'cores': sorted(os.sched_getaffinity(0))}, f)
    return 0
  if mode == 'fail' and rank == argv[1]:
    return FAIL_CODE
  if mode == 'stuck':
    return _stuck(int(argv[1]))
  if mode == 'stubborn':
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f'probe {rank} ignores SIGTERM', flush=True)
    with open(os.path.join(argv[1], f'{rank}.pid.tmp'), 'w') as f:
      f.write(str(os.getpid()))
    os.replace(os.path.join(argv[1], f'{rank}.pid.tmp'),
               os.path.join(argv[1], f'{rank}.pid'))
  time.sleep(SLEEP_S)
  return 0


def _stuck(rank: int) -> int:
  """A step whose all-reduce process ``rank`` never reaches."""
  # JAX is imported here only: the other modes start instantly.
  import jaxpar
  jaxpar.distributed.initialize(
      timeouts=jaxpar.distributed.Timeouts(collective=5, shutdown=3))
  import jax
  import numpy as np
  from jax.experimental import io_callback
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  def hang(x):
    if jax.process_index() == rank:
      print(f'process {rank} sleeps inside the step', flush=True)
      time.sleep(SLEEP_S)
    return x

  def local(x):
    x = io_callback(hang, jax.ShapeDtypeStruct(x.shape, x.dtype), x)
    return jax.lax.psum(x, 'data')

  mesh = jaxpar.make_mesh(data=jax.device_count())
  step = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P('data'),
                               out_specs=P()))
  x = jax.device_put(np.ones(jax.device_count(), np.float32),
                     NamedSharding(mesh, P('data')))
  print(f'process {jax.process_index()}: step', flush=True)
  print(np.asarray(step(x)), flush=True)
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv[1:]))
