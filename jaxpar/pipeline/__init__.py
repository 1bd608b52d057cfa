"""Pipeline parallelism: schedules as data and the executor that runs them."""

from jaxpar.pipeline.schedule import Action as Action
from jaxpar.pipeline.schedule import Schedule as Schedule
from jaxpar.pipeline.schedule import ScheduleError as ScheduleError
from jaxpar.pipeline.schedule import gpipe as gpipe
from jaxpar.pipeline.schedule import interleaved_1f1b as interleaved_1f1b
from jaxpar.pipeline.schedule import one_f_one_b as one_f_one_b
from jaxpar.pipeline.schedule import zbv as zbv
from jaxpar.pipeline.schedule import zero_bubble_h1 as zero_bubble_h1
from jaxpar.pipeline.simulate import SimResult as SimResult
