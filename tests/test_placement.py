"""Stage placement: where logical stages sit on ranks, and moving stage
leaves between rank order ``[p, v, ...]`` and model order.

``jaxpar.pipeline.stages_to_ranks`` / ``ranks_to_stages`` (the executor's
``_placement``) move a tree leaf by leaf; ``jaxpar.parallel.stages_like`` /
``stages_in_model_order`` (``jaxpar/parallel/_placement.py``, what
checkpoints and ``Trainer.params`` use) move whole trees of global arrays,
keeping their shards.
"""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jaxpar
from jaxpar import pipeline as sch
from jaxpar.pipeline import local_stages, ranks_to_stages, stages_to_ranks


def test_placement_round_trip():
  for schedule in (sch.one_f_one_b(4, 4), sch.interleaved_one_f_one_b(2, 2, 3),
                   sch.zero_bubble_v(4, 4)):
    tree = {'a': np.arange(schedule.num_stages * 2).reshape(-1, 2)}
    ranks = stages_to_ranks(tree, schedule)
    assert ranks['a'].shape == (schedule.num_ranks,
                                schedule.num_stages // schedule.num_ranks, 2)
    for r, stages in enumerate(local_stages(schedule)):
      for j, k in enumerate(stages):
        np.testing.assert_array_equal(ranks['a'][r, j], tree['a'][k])
    np.testing.assert_array_equal(ranks_to_stages(ranks, schedule)['a'],
                                  tree['a'])
  ranks = stages_to_ranks(np.arange(4), sch.zero_bubble_v(2, 2))
  np.testing.assert_array_equal(ranks, [[0, 3], [1, 2]])


def test_stage_placements_move_whole_trees_and_keep_shards():
  """``stages_like`` / ``stages_in_model_order`` (what checkpoints and
  ``Trainer.params`` use) equal the executor's per-leaf moves, keep the
  shards of global arrays, and refuse leaves of the wrong placement."""
  schedule = jaxpar.pipeline.zero_bubble_v(2, 2)
  mesh = jaxpar.make_mesh(stage=2, tensor=4)
  model = {'w': np.arange(4 * 8 * 4, dtype=np.float32).reshape(4, 8, 4),
           'b': np.arange(4, dtype=np.float32)}
  ranks = jaxpar.pipeline.stages_to_ranks(model, schedule)
  like = {'w': jax.device_put(ranks['w'], NamedSharding(
              mesh, P('stage', None, None, 'tensor'))),
          'b': jax.device_put(ranks['b'], NamedSharding(mesh, P('stage')))}
  placed = jaxpar.parallel.stages_like(model, like, schedule)
  for k in model:
    np.testing.assert_array_equal(placed[k], ranks[k])
    assert placed[k].sharding.is_equivalent_to(like[k].sharding, placed[k].ndim)
  back = jaxpar.parallel.stages_in_model_order(placed, schedule)
  for k in model:
    np.testing.assert_array_equal(back[k], model[k])
  assert back['w'].sharding.spec == P('stage', None, 'tensor')
  with pytest.raises(ValueError, match=r"stages\['w'\] has shape \(4, 8, 4\)"
                     r".*\(num_ranks, num_stages // num_ranks\) = \(2, 2\)"):
    jaxpar.parallel.stages_in_model_order(model, schedule)
  with pytest.raises(ValueError, match='schedule.num_stages=4'):
    jaxpar.parallel.stages_like(ranks, like, schedule)
  with pytest.raises(TypeError, match='must be a jaxpar.pipeline.Schedule'):
    jaxpar.parallel.stages_in_model_order(placed, 'zero_bubble_v')
