"""Regenerates the ``torch_*.csv`` fixtures from torch.distributed.pipelining.

Run with a separate PyTorch install (never a jaxpar dependency), e.g.
``/tmp/torchvenv/bin/python tests/data/export_torch_schedules.py`` with
torch 2.13.0+cpu. Multi-stage schedules are written by their own
``_dump_csv(path, format='compute_only')``; single-stage ones (GPipe, 1F1B)
have no ``_dump_csv``, so their ``pipeline_order`` rows are written with the
same ``csv.writer`` after dropping the non-compute ``REDUCE_GRAD`` actions.
No process group is needed: the schedules only read the fake stages'
``group_size``, ``group_rank``, ``num_stages`` and ``submod``.
"""

import csv
import os
import types

from torch.distributed.pipelining import schedules

HERE = os.path.dirname(os.path.abspath(__file__))


def stages(p, per_rank):
  return [types.SimpleNamespace(group_size=p, group_rank=0, submod=None,
                                num_stages=p * per_rank, stage_index=i)
          for i in range(per_rank)]


def single(cls, p, m, name):
  order = cls(stages(p, 1)[0], m).pipeline_order
  with open(os.path.join(HERE, name), 'w', newline='') as f:
    writer = csv.writer(f)
    for rank in sorted(order):
      writer.writerow([a for a in order[rank]
                       if a is None or a.computation_type.value != 'REDUCE_GRAD'])


def multi(cls, p, m, per_rank, name):
  cls(stages(p, per_rank), m)._dump_csv(os.path.join(HERE, name),
                                        format='compute_only')


single(schedules.ScheduleGPipe, 4, 8, 'torch_gpipe_p4_m8.csv')
single(schedules.Schedule1F1B, 4, 8, 'torch_1f1b_p4_m8.csv')
multi(schedules.ScheduleInterleaved1F1B, 4, 8, 2,
      'torch_interleaved_1f1b_p4_m8_v2.csv')
multi(schedules.ScheduleInterleaved1F1B, 2, 4, 3,
      'torch_interleaved_1f1b_p2_m4_v3.csv')
multi(schedules.ScheduleInterleavedZeroBubble, 4, 8, 1,
      'torch_zero_bubble_p4_m8.csv')
multi(schedules.ScheduleInterleavedZeroBubble, 2, 4, 2,
      'torch_interleaved_zero_bubble_p2_m4_v2.csv')
multi(schedules.ScheduleZBVZeroBubble, 4, 8, 2, 'torch_zbv_p4_m8.csv')
multi(schedules.ScheduleZBVZeroBubble, 4, 5, 2, 'torch_zbv_p4_m5.csv')
multi(schedules.ScheduleLoopedBFS, 2, 4, 2, 'torch_looped_bfs_p2_m4_v2.csv')
