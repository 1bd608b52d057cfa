"""Integrity records of checkpoints: what was written, verified before use.

``jaxpar.checkpoint.save`` lets orbax write a step (atomically: under a
temporary name, renamed when complete), then adds two kinds of records next to
orbax's files in the step directory::

  <step>/jaxpar_files.process_<i>.json   # process i: crc32 and size of every
                                         # file it wrote (its shards' data,
                                         # process 0 also orbax's metadata)
  <step>/jaxpar_integrity.json           # process 0, written last: versions,
                                         # process count, one checksum per array

The second file is the commit mark: a step without it is *incomplete* (a save
killed after orbax's rename) and is never used. ``verify_files`` re-reads every
recorded file before a restore (bytes on disk), ``verify_arrays`` checks the
restored values leaf by leaf (``array_checksums``: a position-weighted sum of
the values' bits, modulo 2**32, in integer arithmetic -- on the devices, or
with numpy for arrays on CPU devices -- so it does not depend on the sharding
or on the reduction order).

Every failure is a ``CheckpointError`` (a ``ValueError``) of one line naming
the step, the file or array, and what to do.

Example:
  >>> import jax.numpy as jnp, jaxpar
  >>> sums, finite = jaxpar.checkpoint.array_checksums({'w': jnp.ones(3)})
  >>> sorted(sums), finite
  (['w'], {'w': True})
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import zlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import multihost_utils

PyTree = Any

RECORD = 'jaxpar_integrity.json'
FILES = 'jaxpar_files.process_{}.json'
# Record format 2 keys arrays by their ``/``-joined path (format 1, jaxpar
# 0.1: ``.``-joined, as orbax names them; still verified).
FORMAT = 2
_CHUNK = 1 << 20
# orbax's per-process files: ocdbt.process_<i>/..., array_metadatas/process_<i>
_PROCESS_FILE = re.compile(r'(?:^|/)(?:ocdbt\.)?process_(\d+)(?:/|$)')


class CheckpointError(ValueError):
  """A checkpoint step that is incomplete, damaged or unreadable (one line)."""


def leaf_name(path: tuple, separator: str = '/') -> str:
  """A leaf's path, ``/``-joined as every jaxpar param path:
  ``opt_state/0/mu/stages/w``."""
  return jax.tree_util.keystr(path, simple=True, separator=separator)


def _words(x, xp):
  """The bits of every element of ``x`` as uint32 (64-bit: low ^ high)."""
  if xp.iscomplexobj(x):
    x = xp.stack([x.real, x.imag], axis=-1)
  if x.dtype == bool:
    x = x.astype(np.uint8)
  size = np.dtype(x.dtype).itemsize
  unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
  bits = (lax.bitcast_convert_type(x, unsigned) if xp is jnp
          else np.ascontiguousarray(x).view(unsigned))
  if size == 8:
    return ((bits & 0xFFFFFFFF).astype(np.uint32)
            ^ (bits >> 32).astype(np.uint32))
  return bits.astype(np.uint32)


def _flat_index(shape: tuple[int, ...], xp, sharding) -> Any:
  """uint32 row-major flat index of every element, in ``shape`` (no reshape:
  a sharded array cannot be flattened without choosing a new sharding)."""
  if xp is np:
    return np.arange(int(np.prod(shape)), dtype=np.uint32).reshape(shape)
  index = jnp.zeros(shape, np.uint32, out_sharding=sharding)
  for d in range(len(shape)):
    stride = np.uint32(int(np.prod(shape[d + 1:])) % 2**32)
    index += lax.broadcasted_iota(np.uint32, shape, d,
                                  out_sharding=sharding) * stride
  return index


def _checksum(x, xp):
  """``sum(word[i] * (2 i + 1)) mod 2**32`` over the flat index ``i``."""
  words = _words(x, xp)
  sharding = jax.typeof(words).sharding if xp is jnp else None
  weights = _flat_index(words.shape, xp, sharding) * np.uint32(2) + np.uint32(1)
  return xp.sum(words * weights, dtype=np.uint32)


def _finite(x, xp):
  if not xp.issubdtype(x.dtype, np.inexact):
    return xp.asarray(True)
  return xp.all(xp.isfinite(x))


@jax.jit
def _device_sums(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  return (jnp.stack([_checksum(x, jnp) for x in leaves]),
          jnp.stack([_finite(x, jnp) for x in leaves]))


def _on_host(x: Any) -> bool:
  """Reduced with numpy: host values, and arrays whose devices are all this
  host's CPUs (the same memory: no program to compile for each tree)."""
  return not isinstance(x, jax.Array) or (x.is_fully_addressable and all(
      d.platform == 'cpu' for d in x.sharding.device_set))


def array_checksums(tree: PyTree, *, on_device: bool | None = None
                    ) -> tuple[dict[str, int], dict[str, bool]]:
  """Per-leaf checksums (uint32 as int) and all-finite flags of ``tree``.

  ``jax.Array`` leaves on accelerators, or spread over processes, are
  reduced on their devices (one jitted program per device set; every
  process of a multi-process run must call it with the same tree); host
  values, and arrays on this host's CPU devices, with numpy (a program per
  tree would cost more to compile than the sums). Both give the same
  numbers, whatever the sharding.

  Args:
    tree: a pytree of arrays and numbers.
    on_device: ``True`` reduces every ``jax.Array`` on its devices, ``False``
      every leaf with numpy (fully addressable arrays only); ``None``
      chooses as above.

  Returns:
    ``(checksums, finite)``: dicts keyed by leaf path (``/``-joined).

  Example:
    >>> import jax, jax.numpy as jnp, numpy as np, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> x = jax.device_put(jnp.arange(16.).reshape(4, 4), jax.NamedSharding(
    ...     jaxpar.make_mesh(data=2, tensor=4), P('data', 'tensor')))
    >>> on_device = jaxpar.checkpoint.array_checksums([x], on_device=True)
    >>> on_device == jaxpar.checkpoint.array_checksums([np.asarray(x)])
    True
  """
  if on_device is not None and not isinstance(on_device, bool):
    raise TypeError(f'on_device={on_device!r} must be True, False or None.')
  named = [(leaf_name(p), x) for p, x in jax.tree_util.tree_leaves_with_path(
      tree)]
  if on_device is False and any(
      isinstance(x, jax.Array) and not x.is_fully_addressable
      for _, x in named):
    raise ValueError('on_device=False sums with numpy, which needs every '
                     'array on this process; arrays spread over processes '
                     'need on_device=None or True.')
  groups: dict[Any, list[int]] = {}
  for i, (_, x) in enumerate(named):
    host = (_on_host(x) if on_device is None
            else not (on_device and isinstance(x, jax.Array)))
    key = None if host else frozenset(x.sharding.device_set)
    groups.setdefault(key, []).append(i)
  sums, finite = {}, {}
  for key, idx in groups.items():
    if key is None:
      values = [(_checksum(np.asarray(named[i][1]), np),
                 _finite(np.asarray(named[i][1]), np)) for i in idx]
    else:
      s, f = _device_sums([named[i][1] for i in idx])
      values = zip(np.asarray(s), np.asarray(f))
    for i, (s, f) in zip(idx, values):
      sums[named[i][0]] = int(s)
      finite[named[i][0]] = bool(f)
  return sums, finite


def _crc32(path: str) -> int:
  crc = 0
  with open(path, 'rb') as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _owner(rel: str) -> int:
  """The process that writes ``rel``: orbax's per-process files, else 0."""
  match = _PROCESS_FILE.search(rel)
  return int(match.group(1)) if match else 0


def _what(rel: str) -> str:
  if 'ocdbt.process_' in rel:
    return f'array data written by process {_owner(rel)}'
  return 'orbax metadata'


def _write_json(path: str, value: Any) -> None:
  """Written under a temporary name and renamed: never half a file."""
  tmp = f'{path}.tmp{os.getpid()}'
  with open(tmp, 'w') as f:
    json.dump(value, f)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)


def _sync(name: str) -> None:
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)


def write_records(step_dir: str, step: int, checksums: dict[str, int]) -> None:
  """Writes this process's file record, then (process 0) the commit mark.

  Called by every process after orbax finished the step; returns when the
  step is complete in all processes.
  """
  pid = jax.process_index()
  files = {}
  for root, _, names in os.walk(step_dir):
    for name in names:
      rel = os.path.relpath(os.path.join(root, name), step_dir)
      if not rel.startswith('jaxpar_') and _owner(rel) == pid:
        full = os.path.join(step_dir, rel)
        files[rel] = {'crc32': _crc32(full), 'bytes': os.path.getsize(full)}
  _write_json(os.path.join(step_dir, FILES.format(pid)),
              {'process': pid, 'files': files})
  _sync(f'jaxpar_checkpoint_files_{step}')
  if pid == 0:
    _write_json(os.path.join(step_dir, RECORD), {
        'format': FORMAT, 'step': step,
        'jaxpar': importlib.metadata.version('jaxpar'),
        'jax': jax.__version__,
        'orbax': importlib.metadata.version('orbax-checkpoint'),
        'num_processes': jax.process_count(), 'arrays': checksums})
  _sync(f'jaxpar_checkpoint_record_{step}')


def _fix(step_dir: str) -> str:
  return (f'restore an earlier step (jaxpar.checkpoint.latest_step(directory) '
          f'gives the newest good one) or delete {step_dir}')


def _read_json(path: str, step_dir: str, step: int, missing: str) -> dict:
  try:
    with open(path) as f:
      return json.load(f)
  except FileNotFoundError:
    raise CheckpointError(
        f'checkpoint step {step} ({step_dir}) is incomplete: '
        f'{os.path.basename(path)} is missing ({missing}); '
        f'{_fix(step_dir)}.') from None
  except (OSError, ValueError) as e:
    raise CheckpointError(
        f'checkpoint step {step} ({step_dir}) is damaged: '
        f'{os.path.basename(path)} is unreadable ({type(e).__name__}); '
        f'{_fix(step_dir)}.') from None


def verify_files(step_dir: str, step: int) -> dict:
  """Checks every recorded file of a step; returns the commit record.

  Raises:
    CheckpointError: the step is incomplete (no commit mark or file record),
      or a file is missing, has another size or another crc32.
  """
  record = _read_json(
      os.path.join(step_dir, RECORD), step_dir, step,
      'the save did not finish, or the step was not written by '
      'jaxpar.checkpoint.save')
  for pid in range(int(record.get('num_processes', 1))):
    files = _read_json(os.path.join(step_dir, FILES.format(pid)), step_dir,
                       step, f'the file record of process {pid}')
    for rel, want in sorted(files.get('files', {}).items()):
      full = os.path.join(step_dir, rel)
      if not os.path.isfile(full):
        problem = 'is missing'
      elif os.path.getsize(full) != want['bytes']:
        problem = (f'has {os.path.getsize(full)} bytes, {want["bytes"]} were '
                   'written')
      elif _crc32(full) != want['crc32']:
        problem = 'does not match the crc32 recorded at save'
      else:
        continue
      raise CheckpointError(
          f'checkpoint step {step} ({step_dir}) is damaged: {rel} '
          f'({_what(rel)}) {problem}; {_fix(step_dir)}.')
  return record


def verify_arrays(record: dict, tree: PyTree, step_dir: str,
                  step: int) -> None:
  """``CheckpointError`` if a restored leaf differs from its saved checksum."""
  saved = record.get('arrays', {})
  sums, _ = array_checksums(tree)
  key = {name: name for name in sums}
  if record.get('format', 1) == 1:   # keyed by '.'-joined paths
    key = {leaf_name(p): leaf_name(p, '.')
           for p, _ in jax.tree_util.tree_leaves_with_path(tree)}
  for name, value in sums.items():
    if saved.get(key[name], value) != value:
      raise CheckpointError(
          f'checkpoint step {step} ({step_dir}) is damaged: array {name!r} '
          f'read back with checksum {value}, {saved[key[name]]} was saved; '
          f'{_fix(step_dir)}.')


def unreadable(step_dir: str, step: int, error: BaseException
               ) -> CheckpointError:
  """The one-line error for an orbax / tensorstore failure on a step."""
  first = (str(error).strip().splitlines() or [''])[0][:300]
  return CheckpointError(
      f'checkpoint step {step} ({step_dir}) cannot be read: '
      f'{type(error).__name__}: {first}; {_fix(step_dir)}.')
