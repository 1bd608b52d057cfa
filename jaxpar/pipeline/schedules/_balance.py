"""Balanced pipeline stages: contiguous layers per stage from measured costs."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from jaxpar.pipeline.schedules._action import as_int


def stage_costs(layer_costs: Sequence[float], counts: Sequence[int], *,
                first: float = 0.0, last: float = 0.0) -> tuple[float, ...]:
  """The cost of each stage when stage ``k`` runs the next ``counts[k]`` layers.

  ``first`` (e.g. the embedding) is added to stage 0, ``last`` (the head and
  loss) to the last stage.

  Example:
    >>> from jaxpar.pipeline import stage_costs
    >>> stage_costs([1, 2, 3, 4], (2, 2), last=1.5)
    (3.0, 8.5)
  """
  bounds = [0, *itertools.accumulate(counts)]
  costs = [float(sum(layer_costs[a:b])) for a, b in zip(bounds, bounds[1:])]
  costs[0] += first
  costs[-1] += last
  return tuple(costs)


def balance(layer_costs: Sequence[float], num_stages: int, *,
            first: float = 0.0, last: float = 0.0) -> tuple[int, ...]:
  """Layers per stage, contiguous, minimising the slowest stage's cost.

  Exact: dynamic programming over contiguous partitions,
  ``tail[k][i] = min over j of max(cost(i..j-1), tail[k-1][j])`` (the
  slowest of ``k`` stages holding layers ``i..L-1``, each at least one
  layer), ``O(num_stages * L^2)`` for ``L`` layers.
  Among optimal partitions, each stage in turn takes the fewest layers that
  reach an even share of the cost left (so equal costs split as
  ``LayerSplit`` does: the first ``L % S`` stages one layer more).

  ``layer_costs`` can be measured, e.g. the FLOPs of each compiled layer
  (``jax.jit(layer).lower(x).compile().cost_analysis()['flops']``) or its
  time. In a pipeline step the slowest stage sets the tick, so this
  minimises the step time's steady part.

  Args:
    layer_costs: ``L >= num_stages`` non-negative finite costs, in model order.
    num_stages: the number of stages ``S >= 1``.
    first: extra cost of stage 0 (the embedding), ``>= 0``.
    last: extra cost of the last stage (the head and the loss), ``>= 0``.

  Returns:
    ``counts``, a tuple of ``S`` positive ints summing to ``L``: stage ``k``
    holds layers ``sum(counts[:k]) .. sum(counts[:k+1]) - 1``. Pass it to
    ``jaxpar.models.gpt.split_for_pipeline(params, num_stages=S,
    counts=counts)``.

  Raises:
    TypeError: for a non-int ``num_stages`` or non-numeric costs.
    ValueError: for ``num_stages`` outside ``[1, L]`` or negative or
      non-finite costs.

  Example:
    >>> from jaxpar.pipeline import balance
    >>> balance([1, 1, 1, 1, 1, 1], 3)
    (2, 2, 2)
    >>> balance([5, 1, 1, 1, 1, 5], 3)
    (1, 4, 1)
    >>> balance([1, 1, 1, 1, 1, 1], 3, first=2, last=2)   # embed, head: 4 3 3
    (2, 3, 1)
  """
  costs = _check(layer_costs, num_stages, first, last)
  num_stages = int(num_stages)
  n = len(costs)
  prefix = [0.0, *itertools.accumulate(costs)]

  def cost(i: int, j: int) -> float:  # layers i..j-1 as one stage
    return (prefix[j] - prefix[i] + (first if i == 0 else 0.0)
            + (last if j == n else 0.0))

  # tail[k][i]: the slowest of k stages holding layers i..n-1 (n - i >= k).
  tail = [[math.inf] * (n + 1) for _ in range(num_stages + 1)]
  tail[0][n] = 0.0
  for k in range(1, num_stages + 1):
    for i in range(n - k, -1, -1):
      tail[k][i] = min(max(cost(i, j), tail[k - 1][j])
                       for j in range(i + 1, n - k + 2))
  # Front to back, among the cuts that keep the optimum each stage takes the
  # fewest layers reaching an even share of what is left (else the most).
  counts, i = [], 0
  for k in range(num_stages, 0, -1):
    keep = [j for j in range(i + 1, n - k + 2)
            if max(cost(i, j), tail[k - 1][j]) <= tail[num_stages][0]]
    share = cost(i, n) / k
    j = next((j for j in keep if cost(i, j) >= share), keep[-1])
    counts.append(j - i)
    i = j
  return tuple(counts)


def _check(layer_costs, num_stages, first, last) -> list[float]:
  call = (f'balance(layer_costs of length {len(layer_costs)}, '
          f'num_stages={num_stages!r})')
  stages = as_int(num_stages, 'balance: num_stages')
  values = []
  for what, value in [*((f'layer_costs[{i}]', c)
                        for i, c in enumerate(layer_costs)),
                      ('first', first), ('last', last)]:
    try:
      value = float(value)
    except (TypeError, ValueError):
      raise TypeError(f'{call}: {what}={value!r} must be a number.') from None
    if not math.isfinite(value) or value < 0:
      raise ValueError(f'{call}: {what}={value!r} must be a finite number '
                       '>= 0 (a time or a FLOP count).')
    values.append(value)
  if not 1 <= stages <= len(layer_costs):
    raise ValueError(
        f'{call}: every stage needs at least one layer, so num_stages must '
        f'be in [1, {len(layer_costs)}]; use fewer stages or split layers.')
  return values[:-2]
