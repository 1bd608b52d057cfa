"""Checks of the data-parallel trainer's input, eager and abstract
(``jax.eval_shape``): each error names the value, the rule and the fix."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxpar.train_state import TrainState, cast_params
from jaxpar.train_state.internal import PyTree


def dtype_of(x) -> np.dtype:
  """``x.dtype``, or numpy's type of a Python scalar."""
  return x.dtype if hasattr(x, 'dtype') else np.result_type(x)


def check_float_params(params: PyTree) -> None:
  """``TypeError`` naming the first leaf of ``params`` that is not floating
  point: the step differentiates every leaf (``jax.grad`` fails on integers
  with a message naming none), so say which one and what to do, eagerly."""
  for path, leaf in jax.tree_util.tree_leaves_with_path(params):
    dtype = dtype_of(leaf)
    if not jnp.issubdtype(dtype, jnp.inexact):
      name = jax.tree_util.keystr(path, simple=True, separator='/')
      raise TypeError(
          f'params leaf {name!r} has dtype {dtype}; the step differentiates '
          'every leaf of params, so each must be floating point: cast it '
          "(e.g. .astype('float32')) if it is a weight, or keep integer data "
          'out of params (in the batch, or closed over in loss_fn).')


def _check_aux(aux) -> None:
  for path, leaf in jax.tree_util.tree_leaves_with_path(aux):
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
      raise TypeError(
          f'loss_fn aux leaf {jax.tree_util.keystr(path)} has dtype '
          f'{leaf.dtype}; aux is averaged over microbatches and devices, so '
          'return float metrics (e.g. accuracy as float32).')


def _under_mesh(fn: Callable[..., Any], mesh: Mesh | None
                ) -> Callable[..., Any]:
  """``fn`` with the mesh's axes bound, for abstract evaluation: a loss may
  use collectives over them (``nnx.BatchNorm(axis_name='data')``)."""
  if mesh is None:
    return fn
  return jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(),
                       check_vma=False)


def check_loss_fn(loss_fn, params, batch, *, has_aux: bool, key: Any = None,
                  model_state: PyTree = None, carries_state: bool = False,
                  mesh: Mesh | None = None, compute_dtype: Any = None) -> None:
  """``TypeError`` unless ``loss_fn(params, batch[, key=k])`` gives a float
  scalar (``carries_state``: ``loss_fn(params, batch, state=model_state[,
  key=k]) -> (out, model_state)``, the new model state shaped like the
  old), on params cast to ``compute_dtype`` when given. Abstract evaluation
  only (``jax.eval_shape``), on ``mesh``'s axes when given: nothing is
  compiled.
  """
  call = ('loss(m, batch)' if carries_state else
          'loss_fn(params, batch' + (')' if key is None else ', key=k)'))

  def run(params, batch, model_state, key):
    extras = {} if key is None else {'key': key}
    if carries_state:
      extras['state'] = model_state
    return loss_fn(params, batch, **extras)
  if compute_dtype is not None:
    run = cast_params(run, compute_dtype)
  out = jax.eval_shape(_under_mesh(run, mesh), params, batch, model_state,
                       key)
  if carries_state:
    out, new = out
    _check_new_model_state(model_state, new)
  if has_aux:
    if not (isinstance(out, tuple) and len(out) == 2):
      raise TypeError(
          f'has_aux=True needs {call} to return (loss, aux), got {out}.')
    out, aux = out
    _check_aux(aux)
  if not hasattr(out, 'shape') or out.shape != ():
    raise TypeError(
        f'{call} must return a scalar (the mean loss over '
        f'the examples it gets), got {out}. Reduce it, e.g. with .mean()'
        + ('' if has_aux else ', or pass has_aux=True if it returns (loss, aux)')
        + '.')
  if not jnp.issubdtype(out.dtype, jnp.floating):
    raise TypeError(f'{call} must return a float scalar, got {out.dtype}.')


def _check_new_model_state(old: PyTree, new: PyTree) -> None:
  """``ValueError`` unless the forward's model state is shaped like the old
  one (the step carries it from one step to the next)."""
  shapes = lambda tree: jax.tree.map(lambda x: (np.shape(x), dtype_of(x)),
                                     tree)
  if shapes(old) != shapes(new):
    raise ValueError(
        f'the model state after the forward pass {shapes(new)} differs from '
        f'the one before {shapes(old)}: the step carries it from one step '
        'to the next, so the forward may update variables but not add, '
        'remove or reshape them (create every variable in __init__).')



def check_opt_state(state: TrainState,
                    optimizer: optax.GradientTransformation) -> None:
  """``ValueError`` unless ``state.opt_state`` is ``optimizer.init``-shaped.

  Abstract evaluation only; the message says how to make a fitting state.
  """
  want = jax.eval_shape(optimizer.init, state.params)
  shapes = lambda tree: (jax.tree.structure(tree),
                         [np.shape(x) for x in jax.tree.leaves(tree)])
  if shapes(want) != shapes(state.opt_state):
    raise ValueError(
        'state.opt_state does not have the structure and shapes of '
        'optimizer.init(state.params) (got '
        f'{jax.tree.structure(state.opt_state)}, want '
        f'{jax.tree.structure(want)}); create the state with this optimizer: '
        'trainer.init(params) or TrainState.create(params, optimizer).')
