"""The executor's options as one value: ``StepOptions``, and ``Embedding``.

The public steps take their options as keyword arguments, check them once
(``StepOptions.checked``) and hand them on as one ``StepOptions`` to the
tick scan (``_tick_scan.run``) and to the one-rank path (``_sequential``).
A layer run in front of stage 0 (an embedding) travels as an ``Embedding``.

Example:
  >>> from jaxpar.pipeline.executor._options import StepOptions
  >>> options = StepOptions(remat_policy='nothing', bubble_fill=1).checked()
  >>> options.stage_axis, options.remat_policy, options.bubble_fill
  ('stage', 'nothing', 1.0)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax

from jaxpar.pipeline.executor._checks import (
    check_bool, check_fill, check_microbatch_offset)
from jaxpar.pipeline.executor._stage_vjp import stash_policy
from jaxpar.train_state.internal import check_compute_dtype, check_key

PyTree = Any


class Embedding(NamedTuple):
  """A layer in front of stage 0, run per microbatch on stage 0's rank.

  Attributes:
    fn: ``fn(params, raw) -> x``, stage 0's input from the microbatch's raw
      rows (e.g. token ids); called ``fn(params, raw, key=k)`` with a key.
    params: its parameters (the same on every rank).
    key: ``None``, or the key microbatch ``i`` folds in its global index
      into (``fold_in(key, microbatch_offset + i)``).
    state: ``None``, or its model state (BatchNorm's statistics): ``fn``
      is then called ``fn(params, raw, state=s)`` and returns ``(x,
      new_state)``, in microbatch order, like a stateful stage.
  """
  fn: Callable[..., jax.Array]
  params: PyTree
  key: jax.Array | None = None
  state: PyTree = None


class StepOptions(NamedTuple):
  """How a pipeline step runs; the public steps' keyword arguments.

  Attributes:
    stage_axis: the mesh axis of the pipeline ranks.
    bubble_fill: the value of unwritten buffer slots and of what idle ranks
      send (``float('nan')`` shows that bubbles never reach the results).
    key: the step's PRNG key, or ``None`` (the functions get no key).
    microbatch_offset: the global index of this shard's first microbatch.
    has_aux: ``loss_fn`` returns ``(loss, aux)``.
    compute_dtype: the dtype the functions compute in, or ``None``.
    remat_policy: what a stage's forward keeps for its backward
      (``stash_policy``; ``None`` means ``'everything'``).
    input_grads: compute the cotangent of the batch (``PipelineGrads.
      inputs``).
    w_recompute: ``I`` keeps nothing for ``W``; ``W`` recomputes the
      cotangent chain it needs (``StageVJP``): less memory between a
      schedule's ``I`` and ``W``, one more matrix product per weight in
      ``W``.
  """
  stage_axis: str = 'stage'
  bubble_fill: float = 0.0
  key: jax.Array | None = None
  microbatch_offset: Any = 0
  has_aux: bool = False
  compute_dtype: Any = None
  remat_policy: Any = 'dots'
  input_grads: bool = True
  w_recompute: bool = False

  def checked(self) -> StepOptions:
    """These options, checked: a ``TypeError`` or ``ValueError`` names the
    first bad one; ``bubble_fill`` comes back a float and ``compute_dtype``
    a NumPy dtype (or ``None``)."""
    if not isinstance(self.stage_axis, str):
      raise TypeError(f'stage_axis={self.stage_axis!r} must be the name of '
                      "the pipeline's mesh axis, a str such as 'stage'.")
    check_key(self.key)
    check_microbatch_offset(self.microbatch_offset)
    check_bool(self.has_aux, 'has_aux')
    check_bool(self.input_grads, 'input_grads')
    check_bool(self.w_recompute, 'w_recompute')
    stash_policy(self.remat_policy)
    return self._replace(bubble_fill=check_fill(self.bubble_fill),
                         compute_dtype=check_compute_dtype(self.compute_dtype))
