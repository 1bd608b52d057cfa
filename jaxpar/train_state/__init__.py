"""The training state, step statistics, ``Trainer``, the update, the skip guard.

Every jaxpar train step has one shape, like optax's ``(init, update)`` pair:
``Trainer(init, step, params)``. Every step also ends in the same update,
``apply_gradients``: ``optimizer.update`` on the *global* (sharded) arrays,
under ``jit``, so that XLA's partitioner inserts whatever collectives an
optax transform needs (a global norm, LAMB's per-leaf trust ratios,
Adafactor's factored moments, Muon's matrix products). Any optax
``GradientTransformation`` therefore gives single-device results under any
sharding; the sharding only decides where the bytes live.

One module per noun: ``_state`` (``TrainState``, ``StepStats``,
``Trainer``), ``_update`` (``apply_gradients``, ``sharded_update``,
``global_norm``), ``_options`` (the options every trainer shares:
``REMAT_POLICIES``, ``check_remat_policy``, ``cast_params``, ...),
``_placement`` (a state placed on a mesh) and ``_skips`` (the skip guard).
What jaxpar's other packages share beyond this API is in ``internal``.

**The skip guard.** Every jaxpar train step skips an update whose loss or
gradient is not finite (``StepStats.skipped``): one bad batch costs one step.
Many in a row mean the run has diverged (or the data is broken) and further
steps only burn time. ``count_skipped`` keeps the count in a small NamedTuple
and raises ``TooManySkippedError`` after ``max_skipped`` consecutive skips, so
the loop stops before it saves anything: the last good checkpoint stays the
newest (``jaxpar.checkpoint.save`` also refuses non-finite params).

Example:
  >>> import jaxpar
  >>> count = jaxpar.SkipCount()
  >>> for skipped in [False, True, False]:       # e.g. stats from a step
  ...   count = jaxpar.count_skipped(count, skipped, max_skipped=2)
  >>> count
  SkipCount(consecutive=0, total=1)
"""

from jaxpar.train_state._options import REMAT_POLICIES as REMAT_POLICIES
from jaxpar.train_state._options import cast_params as cast_params
from jaxpar.train_state._options import (
    check_remat_policy as check_remat_policy)
from jaxpar.train_state._options import check_update_args as check_update_args
from jaxpar.train_state._skips import SkipCount as SkipCount
from jaxpar.train_state._skips import (
    TooManySkippedError as TooManySkippedError)
from jaxpar.train_state._skips import count_skipped as count_skipped
from jaxpar.train_state._state import StepStats as StepStats
from jaxpar.train_state._state import Trainer as Trainer
from jaxpar.train_state._state import TrainState as TrainState
from jaxpar.train_state._update import apply_gradients as apply_gradients
from jaxpar.train_state._update import global_norm as global_norm
from jaxpar.train_state._update import sharded_update as sharded_update

__all__ = [
    'REMAT_POLICIES', 'SkipCount', 'StepStats', 'TooManySkippedError',
    'TrainState', 'Trainer', 'apply_gradients', 'cast_params',
    'check_remat_policy', 'check_update_args', 'count_skipped',
    'global_norm', 'sharded_update',
]
