"""jaxpar: data, tensor and pipeline parallelism for JAX as pure functions."""

from jaxpar import async_ps as async_ps
from jaxpar import checkpoint as checkpoint
from jaxpar import distributed as distributed
from jaxpar import guard as guard
from jaxpar import integrity as integrity
from jaxpar import models as models
from jaxpar import parallel as parallel
from jaxpar import pipeline as pipeline
from jaxpar import tensor_parallel as tensor_parallel
from jaxpar import vma as vma
from jaxpar import zero as zero
from jaxpar.async_ps import AsyncParameterServer as AsyncParameterServer
from jaxpar.async_ps import AsyncResult as AsyncResult
from jaxpar.data_parallel import data_parallel_step as data_parallel_step
from jaxpar.mesh import make_mesh as make_mesh
from jaxpar.mesh import simulate_cpu_devices as simulate_cpu_devices
from jaxpar.train_state import StepStats as StepStats
from jaxpar.train_state import TrainState as TrainState

__version__ = '0.1.0'

__all__ = [
    'AsyncParameterServer', 'AsyncResult', 'StepStats', 'TrainState',
    'async_ps', 'checkpoint', 'data_parallel_step', 'distributed', 'guard',
    'integrity',
    'make_mesh', 'models', 'parallel', 'pipeline', 'simulate_cpu_devices',
    'tensor_parallel', 'vma', 'zero',
]
