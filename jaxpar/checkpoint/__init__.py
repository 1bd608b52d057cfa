"""Checkpoints: orbax save / restore of sharded states, with integrity records.

``save`` writes every shard from the device that holds it, with checksums
(``array_checksums``) and a per-process file record; ``restore`` reads onto
any target mesh and sharding, verifying both; ``latest_step`` finds the newest
complete step. A damaged checkpoint raises ``CheckpointError``.
"""

from jaxpar.checkpoint._checkpoint import latest_step as latest_step
from jaxpar.checkpoint._checkpoint import restore as restore
from jaxpar.checkpoint._checkpoint import save as save
from jaxpar.checkpoint._integrity import CheckpointError as CheckpointError
from jaxpar.checkpoint._integrity import array_checksums as array_checksums

__all__ = ['CheckpointError', 'array_checksums', 'latest_step', 'restore',
           'save']
