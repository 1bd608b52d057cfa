"""jaxpar: data, tensor and pipeline parallelism for JAX as pure functions.

The root holds what every part shares -- the mesh (``make_mesh``,
``simulate_cpu_devices``), the training state and the ``Trainer`` shape
(``train_state``), ``vma`` (``lift`` and the varying-axes pair
``varying_axes`` / ``vary``) and the HLO counters -- and one subpackage per
capability:
``data_parallel`` (with ZeRO), ``tensor_parallel``, ``pipeline`` (schedules
and executor), ``parallel`` (the 3D trainer and ``from_nnx``),
``checkpoint``, ``models``, ``planner`` (``plan``: the layout for a model
on N devices), ``async_ps``, ``distributed`` and ``cli``.

Example:
  >>> import jaxpar
  >>> jaxpar.make_mesh(data=2, stage=2, tensor=2).axis_names
  ('data', 'stage', 'tensor')
"""

from jaxpar import async_ps as async_ps
from jaxpar import checkpoint as checkpoint
from jaxpar import data_parallel as data_parallel
from jaxpar import distributed as distributed
from jaxpar import hlo as hlo
from jaxpar import models as models
from jaxpar import parallel as parallel
from jaxpar import pipeline as pipeline
from jaxpar import planner as planner
from jaxpar import tensor_parallel as tensor_parallel
from jaxpar import train_state as train_state
from jaxpar import vma as vma
from jaxpar.async_ps import AsyncParameterServer as AsyncParameterServer
from jaxpar.mesh import make_mesh as make_mesh
from jaxpar.mesh import simulate_cpu_devices as simulate_cpu_devices
from jaxpar.planner import plan as plan
from jaxpar.train_state import SkipCount as SkipCount
from jaxpar.train_state import StepStats as StepStats
from jaxpar.train_state import TooManySkippedError as TooManySkippedError
from jaxpar.train_state import Trainer as Trainer
from jaxpar.train_state import TrainState as TrainState
from jaxpar.train_state import count_skipped as count_skipped

__version__ = '0.18.2'

__all__ = [
    'AsyncParameterServer', 'SkipCount', 'StepStats', 'TooManySkippedError',
    'TrainState', 'Trainer', 'async_ps', 'checkpoint', 'count_skipped',
    'data_parallel', 'distributed', 'hlo', 'make_mesh', 'models', 'parallel',
    'pipeline', 'plan', 'planner', 'simulate_cpu_devices', 'tensor_parallel',
    'train_state', 'vma',
]
