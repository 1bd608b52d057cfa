"""The options every trainer takes, checked and meant the same way in each.

``data_parallel.trainer``, ``parallel.trainer`` and the pipeline executor
share these checks: the optimizer (any optax ``GradientTransformation``) and
what its update may ask for, ``max_grad_norm``, ``remat_policy`` (a name of
``REMAT_POLICIES`` or a ``jax.checkpoint`` policy), ``key`` and
``compute_dtype`` (with ``cast_params``, the cast every step applies).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any


def check_optimizer(optimizer: Any) -> optax.GradientTransformation:
  """``optimizer`` as an optax ``GradientTransformation``, else ``TypeError``.

  ``optax.MultiSteps`` (a wrapper class) gives its
  ``gradient_transformation()``.

  Example:
    >>> import optax
    >>> from jaxpar.train_state import internal
    >>> opt = internal.check_optimizer(
    ...     optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2))
    >>> isinstance(opt, optax.GradientTransformation)
    True
  """
  if isinstance(optimizer, optax.MultiSteps):
    optimizer = optimizer.gradient_transformation()
  if not isinstance(optimizer, optax.GradientTransformation):
    raise TypeError(
        f'optimizer must be an optax.GradientTransformation (e.g. '
        f'optax.adam(1e-3)), got {type(optimizer).__name__}: {optimizer!r}.')
  return optimizer


def check_max_grad_norm(max_grad_norm: Any) -> None:
  """``TypeError``/``ValueError`` unless ``max_grad_norm`` is None or > 0."""
  if max_grad_norm is None:
    return
  if isinstance(max_grad_norm, bool) or not isinstance(
      max_grad_norm, (int, float)) and not (
          hasattr(max_grad_norm, 'dtype') and jnp.ndim(max_grad_norm) == 0):
    raise TypeError(f'max_grad_norm must be a number or None, got '
                    f'{type(max_grad_norm).__name__}: {max_grad_norm!r}.')
  if not max_grad_norm > 0:
    raise ValueError(
        f'max_grad_norm={max_grad_norm!r} must be > 0, or None for no '
        'clipping.')


def check_update_args(optimizer: optax.GradientTransformation,
                      params: PyTree, opt_state: PyTree) -> None:
  """``TypeError`` if ``optimizer.update`` needs an argument the step lacks.

  The step calls ``optimizer.update(grads, opt_state, params, value=loss)``
  (``apply_gradients``); a transform that requires more keyword arguments
  (``grad`` and ``value_fn`` of optax's line searches, ``optax.lbfgs``)
  cannot run in it. Abstract evaluation only (``jax.eval_shape``) on
  ``params``-shaped gradients.

  Example:
    >>> import jax.numpy as jnp, optax, jaxpar
    >>> params = {'w': jnp.ones(3)}
    >>> opt = optax.contrib.reduce_on_plateau()
    >>> jaxpar.train_state.check_update_args(opt, params, opt.init(params))
  """
  def update(params, opt_state):
    return optax.with_extra_args_support(optimizer).update(
        params, opt_state, params, value=jnp.zeros((), jnp.float32))
  try:
    jax.eval_shape(update, params, opt_state)
  except TypeError as e:
    if 'required keyword-only argument' not in str(e):
      raise
    raise TypeError(
        f"optimizer.update needs an argument a train step cannot give ({e}). "
        'Each step calls optimizer.update(grads, opt_state, params, '
        'value=loss): value= is the mean loss of the batch, nothing else is '
        'passed. Use a transform that needs at most value= (e.g. not a line '
        'search, which also needs value_fn=).') from e


# Only jax's policies: one that also saved what collectives produce would
# turn ZeRO-3's gathered params into residuals of the params alone, which
# XLA then hoists out of the pipeline's tick loop and keeps (+55% scratch
# measured).
REMAT_POLICIES: dict[str, Callable[..., Any] | None] = {
    'everything': None,   # every residual jax.vjp lists: no recompute
    'dots': jax.checkpoint_policies.dots_saveable,
    'dots_no_batch': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'nothing': jax.checkpoint_policies.nothing_saveable,   # inputs alone
}


def check_remat_policy(remat_policy: Any) -> Callable[..., Any] | None:
  """The ``jax.checkpoint`` policy a trainer's ``remat_policy`` names.

  One meaning in every trainer (``data_parallel.trainer``,
  ``parallel.trainer``, the pipeline executor): what the backward pass keeps
  of the forward, the rest being recomputed.

  Args:
    remat_policy: a name of ``REMAT_POLICIES`` -- ``'everything'`` (keep
      every residual: no recompute), ``'dots'``
      (``jax.checkpoint_policies.dots_saveable``: matmul outputs kept,
      elementwise work recomputed), ``'dots_no_batch'``
      (``dots_with_no_batch_dims_saveable``: attention scores recomputed),
      ``'nothing'`` (keep the inputs, recompute the forward) -- or any
      ``jax.checkpoint_policies`` policy (e.g.
      ``save_only_these_names('ffn')``). ``None`` means ``'everything'``.

  Returns:
    The policy function, or ``None`` for ``'everything'`` (and ``None``).

  Raises:
    ValueError: an unknown name. TypeError: neither a name nor callable.

  Example:
    >>> import jax
    >>> from jaxpar.train_state import check_remat_policy
    >>> check_remat_policy('dots') is jax.checkpoint_policies.dots_saveable
    True
    >>> check_remat_policy(None) is check_remat_policy('everything') is None
    True
  """
  if remat_policy is None:
    return REMAT_POLICIES['everything']
  if isinstance(remat_policy, str):
    if remat_policy not in REMAT_POLICIES:
      raise ValueError(f'remat_policy={remat_policy!r} is not one of '
                       f'{sorted(REMAT_POLICIES)}; pass one of them or a '
                       'jax.checkpoint_policies policy.')
    return REMAT_POLICIES[remat_policy]
  if callable(remat_policy):
    return remat_policy
  raise TypeError(f'remat_policy={remat_policy!r} must be a name '
                  f'({sorted(REMAT_POLICIES)}) or a jax.checkpoint policy.')


def check_key(key: Any) -> None:
  """``TypeError`` unless ``key`` is ``None`` or one PRNG key."""
  if key is None:
    return
  dtype, shape = getattr(key, 'dtype', None), np.shape(key)
  typed = dtype is not None and jnp.issubdtype(dtype, jax.dtypes.prng_key)
  raw = dtype == np.uint32 and shape == (2,)
  if not (typed and shape == () or raw):
    raise TypeError(
        f'key must be one PRNG key, e.g. jax.random.key(0), got '
        f'{type(key).__name__} {dtype}{list(shape)}: to train with a fresh '
        'key each step pass the step key (the trainers and the executor '
        'fold in the step, microbatch and stage).')


def check_compute_dtype(compute_dtype: Any) -> np.dtype | None:
  """``None`` or a floating dtype (``'bfloat16'``, ``jnp.bfloat16``, ...)."""
  if compute_dtype is None:
    return None
  try:
    dtype = jnp.dtype(compute_dtype)
  except TypeError:
    dtype = None
  if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f'compute_dtype={compute_dtype!r} must be None (compute in the '
        "params' dtype) or a floating dtype, e.g. jnp.bfloat16 or "
        "'bfloat16'.")
  return dtype


def cast_params(fn: Callable[..., Any], dtype: Any) -> Callable[..., Any]:
  """``fn`` on its first argument (the params) cast to ``dtype``.

  The cast is part of the stage, so ``StageVJP`` finds the cast params to
  depend on the params alone and recomputes them rather than stash them;
  its transpose casts the params' cotangents back to their dtype.

  Example:
    >>> import jax.numpy as jnp
    >>> from jaxpar.train_state import cast_params
    >>> f = cast_params(lambda p, x: p['w'] * x, jnp.bfloat16)
    >>> f({'w': jnp.ones(2)}, 3).dtype
    dtype(bfloat16)
  """
  return lambda params, *args, **kwargs: fn(optax.tree.cast(params, dtype),
                                            *args, **kwargs)
