"""The layout planner: how to train a model on N devices, chosen by prediction.

``plan(model, optimizer, batch=..., devices=...)`` lists every layout --
``data x stage x tensor`` (``Layout``), schedule (every constructor, and
``pipeline.search``'s for the best meshes), microbatches, ZeRO stage,
remat policy -- predicts each one's memory per device (``memory``: exact
arguments, the schedule's stash slots, the step's temporaries; from
compiled steps where the devices are here, one compile per stage shape) and
step time (``step_time``: measured or datasheet FLOP/s, alpha-beta
collectives, the schedule's tick table), and ranks the ones that fit. The
``Plan`` builds the best one's ``Trainer`` and params. A ``Profile`` (built
in: ``PROFILES``; measured: ``measure_profile``) ranks layouts for devices
that are not here. ``docs/planning.md`` has the model and its accuracy.

Example:
  >>> import jaxpar
  >>> from jaxpar.models import gpt
  >>> config = gpt.GPTConfig(vocab_size=16, seq_len=8, d_model=16,
  ...                        num_heads=2, num_layers=2)
  >>> plan = jaxpar.plan(config, batch=16, devices=8, profile='H100-SXM')
  >>> plan.best.layout.devices, plan.best.fits
  (8, True)
"""

from jaxpar.planner._calibrate import measure_profile as measure_profile
from jaxpar.planner._checks import parse_size as parse_size
from jaxpar.planner._layout import Layout as Layout
from jaxpar.planner._layout import SearchArgs as SearchArgs
from jaxpar.planner._layout import layouts as layouts
from jaxpar.planner._measure import Measured as Measured
from jaxpar.planner._measure import measure as measure
from jaxpar.planner._measure import spearman as spearman
from jaxpar.planner._measure import summary as summary
from jaxpar.planner._memory import Memory as Memory
from jaxpar.planner._memory import memory as memory
from jaxpar.planner._model import ModelSpec as ModelSpec
from jaxpar.planner._plan import DEFAULT_COMPILES as DEFAULT_COMPILES
from jaxpar.planner._plan import Candidate as Candidate
from jaxpar.planner._plan import Plan as Plan
from jaxpar.planner._plan import plan as plan
from jaxpar.planner._profile import PROFILES as PROFILES
from jaxpar.planner._profile import Profile as Profile
from jaxpar.planner._time import StepTime as StepTime
from jaxpar.planner._time import step_time as step_time

__all__ = [
    'Candidate', 'DEFAULT_COMPILES', 'Layout', 'Measured', 'Memory', 'ModelSpec', 'PROFILES',
    'Plan', 'Profile', 'SearchArgs', 'StepTime', 'layouts', 'measure',
    'measure_profile',
    'memory', 'parse_size', 'plan', 'spearman', 'step_time', 'summary',
]
