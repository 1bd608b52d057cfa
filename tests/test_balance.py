"""balance: the exact min-max contiguous partition, against brute force."""

import itertools
import math

import jax
import numpy as np
import pytest
from flax import nnx

from jaxpar.models import gpt
from jaxpar.pipeline import balance, stage_costs


def brute_force(costs, num_stages, first, last):
  """The smallest slowest stage over every composition of len(costs)."""
  n = len(costs)
  best = math.inf
  for cuts in itertools.combinations(range(1, n), num_stages - 1):
    counts = np.diff((0, *cuts, n))
    best = min(best, max(stage_costs(costs, counts, first=first, last=last)))
  return best


@pytest.mark.parametrize('seed', range(40))
def test_optimal_against_brute_force(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(1, 10))
  s = int(rng.integers(1, n + 1))
  costs = rng.choice([rng.random(n) * 10, rng.integers(0, 5, n)])
  first, last = (float(rng.choice([0, 1, 3])) for _ in range(2))
  counts = balance(list(costs), s, first=first, last=last)
  assert len(counts) == s and sum(counts) == n and min(counts) >= 1
  got = max(stage_costs(costs, counts, first=first, last=last))
  assert math.isclose(got, brute_force(costs, s, first, last), rel_tol=1e-12,
                      abs_tol=1e-12)


def test_even_costs_match_the_gpt_split():
  # Equal costs: the first L % S stages one more layer, like LayerSplit.
  assert balance([1.0] * 6, 4) == (2, 2, 1, 1)
  assert balance([1.0] * 7, 3) == (3, 2, 2)


def test_embedding_and_head_pull_layers_off_the_end_stages():
  assert balance([1] * 8, 4) == (2, 2, 2, 2)
  assert balance([1] * 8, 4, first=1, last=2) == (2, 3, 2, 1)
  counts = balance([1] * 8, 4, last=2.5)
  assert counts[-1] == 1 and max(stage_costs([1] * 8, counts, last=2.5)) == 3.5


def test_numpy_inputs():
  assert balance(np.array([3, 1, 1, 1]), np.int64(2)) == (1, 3)


@pytest.mark.parametrize('args, error, message', [
    (([1, 2], 3), ValueError, r'num_stages must be in \[1, 2\]'),
    (([1, 2], 0), ValueError, r'num_stages must be in \[1, 2\]'),
    (([1, -2], 1), ValueError, r'layer_costs\[1\]=-2.0 must be a finite'),
    (([1, float('nan')], 1), ValueError, 'must be a finite number'),
    (([1, 'a'], 1), TypeError, r"layer_costs\[1\]='a' must be a number"),
    (([1, 2], 1.5), TypeError, 'num_stages=1.5 must be an int'),
    (([1, 2], True), TypeError, 'must be an int'),
])
def test_errors(args, error, message):
  with pytest.raises(error, match=message):
    balance(*args)


def test_first_and_last_are_checked():
  with pytest.raises(ValueError, match='last=-1'):
    balance([1, 2], 2, last=-1)


def test_gpt_split_accepts_balanced_counts():
  model = gpt.GPT(gpt.GPTConfig(num_layers=5, d_model=16, num_heads=2,
                                vocab_size=8, seq_len=8), rngs=nnx.Rngs(0))
  params = gpt.gpt_params(model)
  counts = balance([1.0] * 5, 3, first=1.0, last=1.0)
  assert counts == (2, 2, 1)  # stage costs 3, 2, 2 (embed, head: 1 each)
  pipe, split = gpt.split_for_pipeline(params, num_stages=3, counts=counts)
  assert split.counts == counts and split.slots == max(counts)
  assert jax.tree.leaves(pipe.stages)[0].shape[:2] == (3, max(counts))
  back = gpt.merge_from_pipeline(pipe, split)
  assert jax.tree.all(jax.tree.map(np.array_equal, back, params))
  with pytest.raises(ValueError, match=r'counts=\(2, 2\): need 3 positive'):
    gpt.split_for_pipeline(params, num_stages=3, counts=(2, 2))
