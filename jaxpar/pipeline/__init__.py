"""Pipeline parallelism: schedules as data and the executor that runs them."""

from jaxpar.pipeline._action import Action as Action
from jaxpar.pipeline.schedule import Schedule as Schedule
from jaxpar.pipeline.schedule import ScheduleError as ScheduleError
from jaxpar.pipeline.constructors import gpipe as gpipe
from jaxpar.pipeline.constructors import interleaved_1f1b as interleaved_1f1b
from jaxpar.pipeline.constructors import one_f_one_b as one_f_one_b
from jaxpar.pipeline.constructors import zbv as zbv
from jaxpar.pipeline.constructors import zero_bubble_h1 as zero_bubble_h1
from jaxpar.pipeline.simulate import DEFAULT_COSTS as DEFAULT_COSTS
from jaxpar.pipeline.simulate import SimResult as SimResult
from jaxpar.pipeline.simulate import check_costs as check_costs
from jaxpar.pipeline.simulate import peak_memory as peak_memory
from jaxpar.pipeline.vshape import dualpipev as dualpipev
from jaxpar.pipeline.stage_balance import balance as balance
from jaxpar.pipeline.schedule_search import search as search
from jaxpar.pipeline.vshape import v_half as v_half
from jaxpar.pipeline.vshape import v_min as v_min
from jaxpar.pipeline.lower import LoweredSchedule as LoweredSchedule
from jaxpar.pipeline.lower import lower as lower
from jaxpar.pipeline.executor import PipelineGrads as PipelineGrads
from jaxpar.pipeline.executor import pipeline_apply as pipeline_apply
from jaxpar.pipeline.executor import pipeline_apply_local as pipeline_apply_local
from jaxpar.pipeline.executor import pipeline_step as pipeline_step
from jaxpar.pipeline.executor import pipeline_step_local as pipeline_step_local
from jaxpar.pipeline.executor import ranks_to_stages as ranks_to_stages
from jaxpar.pipeline.executor import stages_to_ranks as stages_to_ranks
