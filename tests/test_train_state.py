"""jaxpar.train_state: the shared update (model state, optax's ``value=``)
and the skip guard (consecutive non-finite steps stop a loop; isolated ones
do not)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
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


# -- the update -----------------------------------------------------------------


def test_update_carries_the_model_state_unless_skipped():
  """``model_state=`` is the forward's new model state: kept with the step,
  dropped (the old one kept) when the step is skipped; ``None`` keeps it.
  A 3-field ``TrainState`` still builds (``model_state=None``)."""
  assert jaxpar.TrainState(0, {}, ()).model_state is None
  state = jaxpar.TrainState.create({'w': jnp.ones(2)}, optax.sgd(0.5),
                                   model_state={'count': jnp.int32(3)})
  @jax.jit   # one program (eager, each op compiles)
  def update(loss, model_state):
    return jaxpar.train_state.apply_gradients(
        state, {'w': jnp.ones(2)}, loss=loss, optimizer=optax.sgd(0.5),
        model_state=model_state)
  new, _ = update(1.0, {'count': jnp.int32(4)})
  assert int(new.model_state['count']) == 4 and int(new.step) == 1
  new, stats = update(np.nan, {'count': jnp.int32(4)})
  assert bool(stats.skipped) and int(new.model_state['count']) == 3
  assert int(update(1.0, None)[0].model_state['count']) == 3


def test_update_passes_the_loss_as_value():
  """optax's ``value=`` convention: ``reduce_on_plateau`` sees the loss;
  ``check_update_args`` names an argument a step cannot give."""
  opt = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(
      patience=0, factor=0.5, accumulation_size=1))
  state = jaxpar.TrainState.create({'w': jnp.ones(2)}, opt)
  new, _ = jax.jit(lambda s: jaxpar.train_state.apply_gradients(
      s, {'w': jnp.ones(2)}, loss=jnp.float32(2.5), optimizer=opt))(state)
  assert float(new.opt_state[1].best_value) == 2.5
  lbfgs = optax.lbfgs()
  with pytest.raises(TypeError, match="'value_fn'"):
    jaxpar.train_state.check_update_args(lbfgs, state.params,
                                         lbfgs.init(state.params))
