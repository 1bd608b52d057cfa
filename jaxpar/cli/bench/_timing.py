"""Timing and compiled-program helpers shared by the benchmark modules."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import jax


def median_seconds(fn: Callable, *args, repeats: int = 5, warmup: int = 1) -> float:
  """Median wall time of ``jax.block_until_ready(fn(*args))`` after warm-up."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def compile_stats(jitted, *args) -> dict:
  """Compile ``jitted`` for ``args``: seconds and ``memory_analysis`` bytes."""
  start = time.perf_counter()
  compiled = jitted.lower(*args).compile()
  seconds = time.perf_counter() - start
  mem = compiled.memory_analysis()
  return {'compile_s': seconds,
          'temp_bytes': int(mem.temp_size_in_bytes),
          'argument_bytes': int(mem.argument_size_in_bytes),
          'output_bytes': int(mem.output_size_in_bytes)}


def wall_and_cpu_seconds(steps: dict[str, Callable], args: tuple,
                         repeats: int) -> dict[str, tuple[float, float]]:
  """Median wall and process-CPU seconds of each step, after a warm-up.

  The steps take turns within each repetition, so that load from other
  processes hits them alike; repetition ``r`` starts with the ``r``-th step
  (rotated rounds), so that no step always runs after the same one. CPU time
  (``time.process_time``) sums all the process's threads: it counts the
  work, whatever the number of cores.
  """
  for fn in steps.values():  # compile everything before timing anything
    jax.block_until_ready(fn(*args))
  wall = {name: [] for name in steps}
  cpu = {name: [] for name in steps}
  order = list(steps.items())
  for rep in range(repeats):
    turn = rep % len(order)
    for name, fn in order[turn:] + order[:turn]:
      w, c = time.perf_counter(), time.process_time()
      jax.block_until_ready(fn(*args))
      wall[name].append(time.perf_counter() - w)
      cpu[name].append(time.process_time() - c)
  return {name: (statistics.median(wall[name]), statistics.median(cpu[name]))
          for name in steps}
