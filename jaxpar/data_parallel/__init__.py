"""Data parallelism with ZeRO: the DP trainer, ZeRO's specs and blocks, padded storage.

``trainer(loss_fn, optimizer, mesh=...)`` is single-device optax training on
the global batch, exactly, with the batch split over ``data``. Its
``zero_stage`` 1 splits the optimizer state over ``data`` and 3 the params
too (FSDP). The ZeRO building blocks (``data_spec``, ``gathered``,
``reduce_gradients``, ...) are what ``jaxpar.parallel`` composes with the
pipeline and tensor axes. ``from_nnx(model, loss=...)`` gives a Flax NNX
model as ``model_trainer`` takes it; the model state (BatchNorm statistics) rides
in ``TrainState.model_state``. Behind this API: ``_trainer`` (the step),
``_specs`` (spec arithmetic), ``_state`` (placing a state from outside
``jit``), ``_blocks`` (collectives inside ``shard_map``), ``_padding``
(storage of leaves that no dim divides), ``_from_nnx`` (the NNX model) and
``_model_state`` (the model state threaded and merged over ``data``).
What jaxpar's other packages use beyond this API (padded-storage plumbing,
ZeRO's checks) is in ``internal``.

**ZeRO.** Plain data parallelism keeps the params and the optimizer state on
every device: for Adam in float32 that is 16 bytes per parameter on each of
the ``N`` devices. ZeRO (Rajbhandari et al., 2020) keeps ``1/N`` of them per
device instead, with the same maths.

**Layout = shardings, plus padding.** A ZeRO state is an ordinary
``TrainState`` of global ``jax.Array``s; their ``NamedSharding`` says what
is split. ``data_spec`` adds the ``data`` axis to one dim of each leaf's
``PartitionSpec`` (on top of any tensor/stage split): the largest dim not yet
split whose size divides by ``N``, else the largest split one that still
divides. With ``pad=True`` (what ``trainer`` uses) a leaf that no dim
divides is split too, along its largest unsplit dim, which is stored
zero-padded up to a multiple of ``N`` (as torch FSDP and DeepSpeed do): the
leaf is then a ``Padded(value, shape)`` node, ``value`` the padded array and
``shape`` the logical one. Each device holds ``ceil(d/N)`` rows of it, at
most one row more than ``1/N``. Users see logical shapes: the optimizer
runs on the unpadded leaves (so padding never enters a norm, a mean or a
factored moment), and ``Trainer.params`` and ``jaxpar.checkpoint`` give
logical arrays (``np.asarray`` of a ``Padded`` leaf too). So a ZeRO state
saves and restores onto any mesh, any data size and any ``zero_stage``. A
zero-size leaf is never split (it holds no bytes).

* ``zero_stage=1``: the params-shaped subtrees of ``opt_state`` (Adam's
  ``mu`` and ``nu``, momentum traces, ``MultiSteps``' accumulator: subtrees
  with the structure and leaf shapes of ``params``, where ``optax.masked``
  and ``optax.multi_transform`` may hold ``optax.MaskedNode`` for the leaves
  they skip) get ``data_spec``; params and every other leaf stay as they
  are.
* ``zero_stage=3``: the params too.

**One step**, the building blocks inside ``jax.shard_map``, then the
update on global arrays (``jaxpar.train_state.sharded_update``)::

  stage 1: g_d = grad(loss)(params, batch_d)            full, local batch
           g   = psum_scatter(g_d, data, dim) / N       my 1/N of the mean
  stage 3: g   = grad(loss o all_gather)(p_d, batch_d) / N   (the gather's
                                                        transpose scatters)
  then, on global arrays under jit:
           params, opt = optimizer.update(g, opt, params)  XLA partitions it:
           norms and trust ratios get their all-reduce, elementwise maths
           runs on each device's 1/N; stage 1 all-gathers the new params.

Because the update sees global arrays, *every* optax transform is exact in
every stage -- clipping, ``lamb``, ``lars``, ``adafactor``, ``muon``,
``MultiSteps``, ``inject_hyperparams`` -- and communication stays at ZeRO's
bytes (``P`` = params bytes): stage 1 reduce-scatters ``P`` and all-gathers
``P`` (one all-reduce's worth); stage 3 all-gathers ``P`` per microbatch in
the forward pass (and again in the backward, where XLA does not reuse it)
and reduce-scatters ``P``; the norms add a few scalars.

**Stage 3 gathering.** ``gathered`` runs the loss on the slices and
gathers each param where the loss first uses it. A cast to the compute
dtype runs on the slice (bfloat16 is gathered, its gradient reduce-scattered
in float32); a ``lax.scan`` over stacked ``[L, ...]`` leaves (``nnx.scan``
too) gathers one layer per iteration inside its body and reduce-scatters
that layer's gradient in the backward's body; every gather sits in a
``jax.checkpoint`` that keeps no gathered param for the backward pass, which
gathers again. Between forward and backward only the ``1/N`` slices stay
alive, and in a scan one layer's full params at a time.

Example:
  >>> import jax, jax.numpy as jnp, numpy as np, optax, jaxpar
  >>> mesh = jaxpar.make_mesh(data=8)
  >>> params = {'w': jnp.ones((16, 3)), 'b': jnp.zeros(3)}
  >>> state = jaxpar.TrainState.create(params, optax.adam(0.1))
  >>> state = jaxpar.data_parallel.shard_state(state, mesh=mesh, zero_stage=3)
  >>> state.params['w'].sharding.spec, state.params['w'].sharding.shard_shape(
  ...     (16, 3))
  (P('data',), (2, 3))

  No dim of ``b`` divides by 8: it is stored padded from 3 to 8 entries.

  >>> b = state.params['b']
  >>> b.shape, b.value.shape, b.value.sharding.spec
  ((3,), (8,), P('data',))

  On ``data=6`` no dim of ``w`` divides either: it is padded to 18 rows.

  >>> mesh6 = jaxpar.make_mesh(data=6, devices=jax.devices()[:6])
  >>> state6 = jaxpar.data_parallel.shard_state(state, mesh=mesh6, zero_stage=3)
  >>> w = state6.params['w']
  >>> w.shape, w.value.shape, w.value.addressable_shards[0].data.shape
  ((16, 3), (18, 3), (3, 3))
  >>> np.asarray(w).shape
  (16, 3)
"""

from jaxpar.data_parallel._blocks import gather as gather
from jaxpar.data_parallel._blocks import gathered as gathered
from jaxpar.data_parallel._blocks import reduce_gradients as reduce_gradients
from jaxpar.data_parallel._from_nnx import DataParallelModel as DataParallelModel
from jaxpar.data_parallel._from_nnx import from_nnx as from_nnx
from jaxpar.data_parallel._padding import Padded as Padded
from jaxpar.data_parallel._specs import data_dim as data_dim
from jaxpar.data_parallel._specs import data_spec as data_spec
from jaxpar.data_parallel._specs import data_specs as data_specs
from jaxpar.data_parallel._specs import state_specs as state_specs
from jaxpar.data_parallel._state import StateBytes as StateBytes
from jaxpar.data_parallel._state import bytes_per_device as bytes_per_device
from jaxpar.data_parallel._state import shard_state as shard_state
from jaxpar.data_parallel._trainer import model_trainer as model_trainer
from jaxpar.data_parallel._trainer import trainer as trainer

__all__ = [
    'DataParallelModel', 'Padded', 'StateBytes', 'bytes_per_device',
    'data_dim', 'data_spec', 'data_specs', 'from_nnx', 'gather', 'gathered',
    'model_trainer', 'reduce_gradients', 'shard_state', 'state_specs',
    'trainer',
]
