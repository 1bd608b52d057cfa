"""Several processes, one mesh: ``jax.distributed`` set-up and a local launcher.

Two jobs, one module each: ``initialize`` joins this process to a
multi-process job (flags, environment, or Slurm / Open MPI / Kubernetes
detection), ``is_main_process`` and ``to_host`` work inside it
(``_runtime.py``, with the ``Timeouts`` a run waits for a peer that stops
answering); ``launch`` starts N local processes with gloo CPU
collectives (``python -m jaxpar launch``), on a ``free_port``, and owns
them: one failing stops all, SIGTERM/SIGINT are forwarded, SIGABRT (a
stack dump) then SIGKILL follow after ``GRACE_S`` seconds, every exit is
named, and on Linux the workers die with the launcher, even when it is
SIGKILLed (``_launch.py``).
"""

from jaxpar.distributed._launch import GRACE_S as GRACE_S
from jaxpar.distributed._launch import free_port as free_port
from jaxpar.distributed._launch import launch as launch
from jaxpar.distributed._runtime import (
    ENV_COLLECTIVE_TIMEOUT as ENV_COLLECTIVE_TIMEOUT)
from jaxpar.distributed._runtime import ENV_COORDINATOR as ENV_COORDINATOR
from jaxpar.distributed._runtime import (
    ENV_HEARTBEAT_TIMEOUT as ENV_HEARTBEAT_TIMEOUT)
from jaxpar.distributed._runtime import (
    ENV_LOCAL_DEVICE_COUNT as ENV_LOCAL_DEVICE_COUNT)
from jaxpar.distributed._runtime import ENV_NUM_PROCESSES as ENV_NUM_PROCESSES
from jaxpar.distributed._runtime import ENV_PROCESS_ID as ENV_PROCESS_ID
from jaxpar.distributed._runtime import (
    ENV_SHUTDOWN_TIMEOUT as ENV_SHUTDOWN_TIMEOUT)
from jaxpar.distributed._runtime import Timeouts as Timeouts
from jaxpar.distributed._runtime import initialize as initialize
from jaxpar.distributed._runtime import is_main_process as is_main_process
from jaxpar.distributed._runtime import to_host as to_host

__all__ = ['ENV_COLLECTIVE_TIMEOUT', 'ENV_COORDINATOR', 'ENV_HEARTBEAT_TIMEOUT',
           'ENV_LOCAL_DEVICE_COUNT', 'ENV_NUM_PROCESSES', 'ENV_PROCESS_ID',
           'ENV_SHUTDOWN_TIMEOUT', 'GRACE_S', 'Timeouts', 'free_port',
           'initialize', 'is_main_process', 'launch', 'to_host']
