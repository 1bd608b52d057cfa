"""jaxpar.train_state's skip guard: consecutive non-finite steps stop a loop;
isolated ones do not."""

import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar


def stats(skipped):
  return jaxpar.StepStats(jnp.float32(1.0), jnp.float32(1.0),
                          jnp.asarray(skipped))


def test_counts_runs_and_totals():
  count = jaxpar.SkipCount()
  for flag in [False, True, True, False, True, np.bool_(False)]:
    count = jaxpar.count_skipped(count, stats(flag) if flag else flag,
                                max_skipped=3)
  assert count == jaxpar.SkipCount(consecutive=0, total=3)


def test_stops_at_max_skipped():
  count = jaxpar.SkipCount()
  count = jaxpar.count_skipped(count, stats(True), max_skipped=2, step=7)
  with pytest.raises(jaxpar.TooManySkippedError,
                     match=r'2 consecutive steps were skipped .* the last at '
                     r'step 8; stopped \(max_skipped=2\)'):
    jaxpar.count_skipped(count, stats(True), max_skipped=2, step=8)


@pytest.mark.parametrize('count, skipped, max_skipped, error, match', [
    ((0, 0), False, 5, TypeError, 'SkipCount'),
    (jaxpar.SkipCount(), 1, 5, TypeError, 'StepStats or a bool'),
    (jaxpar.SkipCount(), np.zeros(2, bool), 5, TypeError,
     'StepStats or a bool'),
    (jaxpar.SkipCount(), False, 0, ValueError, 'max_skipped=0'),
    (jaxpar.SkipCount(), False, True, TypeError, 'max_skipped=True'),
])
def test_errors(count, skipped, max_skipped, error, match):
  with pytest.raises(error, match=match):
    jaxpar.count_skipped(count, skipped, max_skipped=max_skipped)
