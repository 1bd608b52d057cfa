"""Pipeline schedules as data (numpy only, no JAX).

Build (``gpipe``, ``one_f_one_b``, ``interleaved_one_f_one_b``,
``zero_bubble_h1``, ``zero_bubble_v``, ``dualpipe_v``, ``v_half``, ``v_min``,
``search``, ``Schedule.from_csv``), validate (``Schedule.validate``),
simulate (``Schedule.simulate``, ``peak_memory``), time as the executor runs
them (``makespan``), plot, balance layers over stages (``balance``) and lay a
schedule out in time as the executor's ``tick_table``.
"""

from jaxpar.pipeline.schedules._action import Action as Action
from jaxpar.pipeline.schedules._balance import balance as balance
from jaxpar.pipeline.schedules._balance import stage_costs as stage_costs
from jaxpar.pipeline.schedules._constructors import (
    STAGES_PER_RANK as STAGES_PER_RANK)
from jaxpar.pipeline.schedules._constructors import gpipe as gpipe
from jaxpar.pipeline.schedules._constructors import (
    interleaved_one_f_one_b as interleaved_one_f_one_b)
from jaxpar.pipeline.schedules._constructors import one_f_one_b as one_f_one_b
from jaxpar.pipeline.schedules._constructors import (
    zero_bubble_h1 as zero_bubble_h1)
from jaxpar.pipeline.schedules._constructors import (
    zero_bubble_v as zero_bubble_v)
from jaxpar.pipeline.schedules._schedule import Schedule as Schedule
from jaxpar.pipeline.schedules._schedule import ScheduleError as ScheduleError
from jaxpar.pipeline.schedules._search import makespan as makespan
from jaxpar.pipeline.schedules._search import search as search
from jaxpar.pipeline.schedules._simulate import DEFAULT_COSTS as DEFAULT_COSTS
from jaxpar.pipeline.schedules._simulate import SimResult as SimResult
from jaxpar.pipeline.schedules._simulate import peak_memory as peak_memory
from jaxpar.pipeline.schedules._tick_table import KIND_CODES as KIND_CODES
from jaxpar.pipeline.schedules._tick_table import TickTable as TickTable
from jaxpar.pipeline.schedules._tick_table import local_stages as local_stages
from jaxpar.pipeline.schedules._tick_table import tick_table as tick_table
from jaxpar.pipeline.schedules._vshape import dualpipe_v as dualpipe_v
from jaxpar.pipeline.schedules._vshape import v_half as v_half
from jaxpar.pipeline.schedules._vshape import v_min as v_min

__all__ = [
    'Action', 'DEFAULT_COSTS', 'KIND_CODES', 'STAGES_PER_RANK', 'Schedule',
    'ScheduleError',
    'SimResult', 'TickTable', 'balance', 'dualpipe_v', 'gpipe',
    'interleaved_one_f_one_b', 'local_stages', 'makespan', 'one_f_one_b',
    'peak_memory', 'search', 'stage_costs', 'tick_table', 'v_half', 'v_min',
    'zero_bubble_h1', 'zero_bubble_v',
]
