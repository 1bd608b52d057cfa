"""Timing a calibration's programs: ``rounds`` (warm, in rounds over the
programs, the median over them and the processes), ``seconds``,
``own_device`` (the device a process times them on) and ``placed`` (their
inputs, on every process).

Example:
  >>> import jax.numpy as jnp
  >>> from jaxpar.planner._timing import rounds
  >>> [t > 0 for t in rounds([(lambda: jnp.ones(8) + 1, 2)], 3)]
  [True]
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def rounds(calls: Sequence[tuple[Callable, int]], count: int
           ) -> list[float]:
  """Seconds per call of each ``(fn, k)``: ``fn()`` dispatched ``k`` times
  in a row and timed together, in ``count`` rounds over ``calls`` (load
  that comes and goes falls on all alike); warm, as ``planner.measure``
  times steps (each sample right after an untimed run of the same: on a
  CPU a first call after another program's faults its memory back in; such
  samples varied by 40% between runs); the median (a step is a sum of many
  blocks: its fastest round is their typical time; the fastest of each put
  every step 5-29% under its measured time). With several processes each
  sample starts together in all, as their steps do, and all samples count.
  """
  times = np.zeros((count, len(calls)))
  for r in range(count):
    for j, (fn, k) in enumerate(calls):
      jax.block_until_ready([fn() for _ in range(k)])
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices('jaxpar.planner.calibrate')
      start = time.perf_counter()
      jax.block_until_ready([fn() for _ in range(k)])
      times[r, j] = (time.perf_counter() - start) / k
  if jax.process_count() > 1:
    times = np.concatenate(multihost_utils.process_allgather(times))
  return [float(t) for t in np.median(times, axis=0)]


def seconds(fn: Callable, *args, repeats: int) -> float:
  """Wall seconds of ``fn(*args)`` over ``repeats`` calls (``rounds``)."""
  return rounds([(functools.partial(fn, *args), 1)], repeats)[0]


def own_device(devices: Sequence):
  """This process's first device among ``devices`` (else its first local
  one): the device a process times its one-rank programs on."""
  mine = [d for d in devices if d.process_index == jax.process_index()]
  return (mine or jax.local_devices())[0]


def placed(mesh, host: np.ndarray, spec: P = P()) -> jax.Array:
  """``host`` laid out on ``mesh`` by ``spec`` (every process holds it)."""
  return jax.make_array_from_callback(
      host.shape, NamedSharding(mesh, spec), lambda i: host[i])
