"""Inspect compiled XLA programs: which collectives they run and how many bytes.

Parallel layouts are judged by their communication, so jaxpar's tests and
benchmarks read it from the optimized HLO that XLA actually runs
(``jax.jit(f).lower(*args).compile().as_text()``), not from the jaxpr.

What is counted, per device, statically (an op inside a ``while``/``scan`` body
counts once however often the loop runs):

* the five collective kinds in ``KINDS``: ``all-reduce``, ``all-gather``,
  ``reduce-scatter``, ``collective-permute`` and ``all-to-all``;
* one collective is one HLO instruction: a synchronous op (``all-reduce(...)``)
  or an asynchronous pair (``all-gather-start`` ... ``all-gather-done``) counts
  once (the ``-start``); a collective wrapped in an ``async-start`` or a fusion
  counts once, where its body holds it; a combined (variadic) all-reduce of
  several arrays is one op.

Bytes are those of the whole buffer the collective works on, per device:
``max(operand bytes, result bytes)``, i.e. the gathered result of an
all-gather, the un-scattered input of a reduce-scatter, and the (equal) input
and output of an all-reduce, collective-permute or all-to-all. A ring
implementation moves about ``(n - 1) / n`` of it per device for all-gather and
reduce-scatter and twice that for all-reduce, over a group of ``n`` devices.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import numpy as np

__all__ = ['KINDS', 'Collective', 'Unordered', 'collective_bytes',
           'collective_counts', 'collectives', 'control_flow',
           'unordered_collectives']

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute',
         'all-to-all')

# `%name = <shape> opcode(operands), attributes` -- one instruction per line in
# XLA's printer. The shape may be a tuple `(f32[2]{0}, u32[])`; the opcode is
# the first lower-case token directly followed by `(`.
_INSTRUCTION = re.compile(
    r'^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>.*?)\s*'
    r'(?<![\w.\-])(?P<op>[a-z][a-z0-9\-]*)\((?P<rest>.*)$')
_ARRAY_SHAPE = re.compile(
    r'\b(?P<dtype>[a-z]+\d*(?:e\d+m\d+\w*)?)\[(?P<dims>[\d,]*)\]')
_DTYPE_BITS = {
    'pred': 8, 's2': 2, 'u2': 2, 's4': 4, 'u4': 4, 's8': 8, 'u8': 8,
    's16': 16, 'u16': 16, 'f16': 16, 'bf16': 16, 's32': 32, 'u32': 32,
    'f32': 32, 's64': 64, 'u64': 64, 'f64': 64, 'c64': 64, 'c128': 128,
    'token': 0,
}


class Collective(NamedTuple):
  """One collective op of a compiled program.

  Attributes:
    kind: one of ``KINDS``, e.g. ``'all-reduce'``.
    name: the HLO instruction name (of the ``-start`` for asynchronous ops).
    operand_bytes: bytes of its operands on one device.
    result_bytes: bytes of its result on one device (of the ``-done`` for
      asynchronous ops).
  """
  kind: str
  name: str
  operand_bytes: int
  result_bytes: int

  @property
  def bytes(self) -> int:
    """``max(operand_bytes, result_bytes)``: the whole buffer."""
    return max(self.operand_bytes, self.result_bytes)


def _hlo_text(program: Any) -> str:
  if isinstance(program, str):
    return program
  if hasattr(program, 'compile') and hasattr(program, 'as_text'):
    raise TypeError(
        f'got a {type(program).__name__} (lowered, not yet optimized by XLA); '
        'pass lowered.compile() or its .as_text(), so the collectives counted '
        'are those XLA actually runs.')
  if hasattr(program, 'as_text'):
    text = program.as_text()
    if isinstance(text, str):
      return text
  raise TypeError(
      'expected a compiled program (jax.jit(f).lower(*args).compile()) or its '
      f'HLO text (.as_text()), got {type(program).__name__}.')


def _shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string; tuples are summed."""
  total_bits = 0
  for m in _ARRAY_SHAPE.finditer(shape):
    dtype = m.group('dtype')
    if dtype.startswith('f8') or dtype.startswith('f4'):
      bits = int(dtype[1])
    elif dtype in _DTYPE_BITS:
      bits = _DTYPE_BITS[dtype]
    else:
      continue
    dims = [int(d) for d in m.group('dims').split(',') if d]
    total_bits += bits * int(np.prod(dims, dtype=np.int64))
  return (total_bits + 7) // 8


def _operands(rest: str) -> list[str]:
  """The top-level operand strings of `rest` = text after the opcode's `(`."""
  depth, start, out = 0, 0, []
  for i, ch in enumerate(rest):
    if ch in '([{':
      depth += 1
    elif ch in ')]}':
      if depth == 0:
        out.append(rest[start:i])
        return [o.strip() for o in out if o.strip()]
      depth -= 1
    elif ch == ',' and depth == 0:
      out.append(rest[start:i])
      start = i + 1
  return [o.strip() for o in out if o.strip()]


def collectives(program: Any) -> list[Collective]:
  """Every collective op of a compiled program, in program-text order.

  Args:
    program: a ``jax.stages.Compiled`` (``jax.jit(f).lower(*a).compile()``) or
      its HLO text.

  Returns:
    list of ``Collective(kind, name, operand_bytes, result_bytes)``, one per
    op as defined in the module docstring.

  Raises:
    TypeError: for a ``Lowered`` (not yet compiled) program or other objects.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> total = jax.shard_map(lambda x: jax.lax.psum(x, 'tensor'), mesh=mesh,
    ...                       in_specs=P('tensor'), out_specs=P())
    >>> x = jax.ShapeDtypeStruct((8,), jnp.float32,
    ...                          sharding=jax.NamedSharding(mesh, P('tensor')))
    >>> compiled = jax.jit(total).lower(x).compile()
    >>> [(c.kind, c.bytes) for c in jaxpar.hlo.collectives(compiled)]
    [('all-reduce', 8)]
  """
  text = _hlo_text(program)
  shapes: dict[str, str] = {}
  instructions = []
  for line in text.splitlines():
    m = _INSTRUCTION.match(line)
    if m is None:
      continue
    shapes[m.group('name')] = m.group('shape')
    instructions.append(m)
  done_result = {}   # start name -> shape of its -done
  for m in instructions:
    if m.group('op').endswith('-done'):
      operands = _operands(m.group('rest'))
      if operands:
        done_result[operands[0].split()[-1].lstrip('%')] = m.group('shape')
  found = []
  for m in instructions:
    op, name = m.group('op'), m.group('name')
    kind = op[:-len('-start')] if op.endswith('-start') else op
    if kind not in KINDS:
      continue
    operand_bytes = 0
    for operand in _operands(m.group('rest')):
      parts = operand.rsplit(None, 1)
      if len(parts) == 2:   # printed with its shape: `f32[4]{0} %p`
        operand_bytes += _shape_bytes(parts[0])
      else:
        operand_bytes += _shape_bytes(shapes.get(parts[0].lstrip('%'), ''))
    result = m.group('shape')
    if op.endswith('-start'):   # the -start's tuple holds operands too
      result = done_result.get(name, result)
    found.append(Collective(kind, name, operand_bytes, _shape_bytes(result)))
  return found


def collective_counts(program: Any) -> dict[str, int]:
  """Number of collective ops of each kind (all of ``KINDS``, zeros included).

  Args:
    program: a compiled program or its HLO text (see ``collectives``).

  Returns:
    ``{'all-reduce': n, 'all-gather': n, 'reduce-scatter': n,
    'collective-permute': n, 'all-to-all': n}``; an async pair or a fused
    collective counts once, a loop body's ops once.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> total = jax.shard_map(lambda x: jax.lax.psum(x, 'tensor'), mesh=mesh,
    ...                       in_specs=P('tensor'), out_specs=P())
    >>> x = jax.ShapeDtypeStruct((8,), jnp.float32,
    ...                          sharding=jax.NamedSharding(mesh, P('tensor')))
    >>> jaxpar.hlo.collective_counts(jax.jit(total).lower(x).compile())
    {'all-reduce': 1, 'all-gather': 0, 'reduce-scatter': 0,
     'collective-permute': 0, 'all-to-all': 0}
  """
  counts = dict.fromkeys(KINDS, 0)
  for c in collectives(program):
    counts[c.kind] += 1
  return counts


def collective_bytes(program: Any) -> dict[str, int]:
  """Bytes per device of each collective kind, summed over its ops.

  Args:
    program: a compiled program or its HLO text (see ``collectives``).

  Returns:
    ``{kind: sum of max(operand_bytes, result_bytes)}`` over ``KINDS`` (zeros
    included): the whole buffer each op works on, e.g. an all-gather of a
    ``f32[4]`` shard over 4 devices counts its ``f32[16]`` result, 64 bytes.

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jaxpar.make_mesh(tensor=4, devices=jax.devices()[:4])
    >>> gather = jax.shard_map(
    ...     lambda x: jax.lax.all_gather(x, 'tensor', tiled=True), mesh=mesh,
    ...     in_specs=P('tensor'), out_specs=P(), check_vma=False)
    >>> x = jax.ShapeDtypeStruct((16,), jnp.float32,
    ...                          sharding=jax.NamedSharding(mesh, P('tensor')))
    >>> jaxpar.hlo.collective_bytes(jax.jit(gather).lower(x).compile())[
    ...     'all-gather']                          # the gathered f32[16]
    64
  """
  total = dict.fromkeys(KINDS, 0)
  for c in collectives(program):
    total[c.kind] += c.bytes
  return total


class Unordered(NamedTuple):
  """A collective that may run beside a loop of collectives (see
  ``unordered_collectives``).

  Attributes:
    computation: the HLO computation holding both (e.g. the entry one).
    loop: the earlier ``while``/``conditional``/``call`` that holds
      collectives.
    op: the later collective (or loop, branch or call holding collectives)
      that does not depend on ``loop``'s result.
  """
  computation: str
  loop: str
  op: str


# `[ENTRY ]%name (params) -> result {` -- a computation's first line.
_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s.*\{\s*$')
_CALLED = re.compile(
    r'\b(?:body|condition|calls|true_computation|false_computation)='
    r'%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_NESTED = ('while', 'conditional', 'call', 'async-start')


def _computations(text: str) -> dict[str, list]:
  """``{computation name: [instruction match, ...]}`` in printed order (a
  scheduled module prints each computation in its schedule's order)."""
  comps, current = {}, None
  for line in text.splitlines():
    if not line.startswith(' '):
      m = _COMPUTATION.match(line)
      current = comps.setdefault(m.group('name'), []) if m else None
      continue
    m = _INSTRUCTION.match(line)
    if m is not None and current is not None:
      current.append(m)
  return comps


def _called(m: re.Match) -> list[str]:
  """The computations an instruction runs (loop body and condition, branches,
  called or async-wrapped computations); not reducers' ``to_apply``."""
  rest = m.group('rest')
  names = _CALLED.findall(rest)
  for group in _BRANCHES.findall(rest):
    names += [b.strip().lstrip('%') for b in group.split(',') if b.strip()]
  return names


def _holders(comps: dict[str, list]) -> set[str]:
  """Names of the computations that (transitively) run a collective."""
  holds: dict[str, bool] = {}

  def visit(name: str) -> bool:
    if name not in holds:
      holds[name] = False   # a cycle cannot add a collective
      holds[name] = any(_is_collective(m) or any(map(visit, _called(m)))
                        for m in comps.get(name, ()))
    return holds[name]
  return {name for name in comps if visit(name)}


def _is_collective(m: re.Match) -> bool:
  op = m.group('op')
  return (op[:-len('-start')] if op.endswith('-start') else op) in KINDS


def _loop_ancestors(instructions: list, loops: set[str]) -> dict[str, set]:
  """For each instruction, the ``loops`` whose results it reads, following
  tuples element by element (a ``get-tuple-element`` of a ``tuple`` or an
  ``opt-barrier`` of one reads that element only: XLA:CPU gives neither a
  buffer of its own, so it orders nothing at run time)."""
  by_name = {m.group('name'): m for m in instructions}
  ancestors: dict[str, set] = {}

  def operand_names(m):
    return [o.split()[-1].lstrip('%') for o in _operands(m.group('rest'))]

  def of(name: str) -> set:
    if name not in by_name:
      return set()
    return ancestors.get(name, set()) | ({name} & loops)

  for m in instructions:
    name, operands = m.group('name'), operand_names(m)
    source = by_name.get(operands[0]) if operands else None
    if m.group('op') == 'get-tuple-element' and source is not None:
      if source.group('op') == 'opt-barrier':
        inner = operand_names(source)
        source = by_name.get(inner[0]) if inner else None
      if source is not None and source.group('op') == 'tuple':
        index = int(re.search(r'index=(\d+)', m.group('rest')).group(1))
        ancestors[name] = of(operand_names(source)[index])
        continue
    ancestors[name] = set().union(*map(of, operands)) if operands else set()
  return ancestors


def unordered_collectives(program: Any) -> list[Unordered]:
  """Collectives that may run beside a loop of collectives, on XLA:CPU.

  XLA:CPU orders one device's collectives by launch only, and a ``while``
  (or ``conditional``, ``call``) holding collectives counts as launched as
  soon as its body goes asynchronous. A later collective that does not read
  the loop's result can then run beside the loop's own collectives, in a
  different order on each device; each waiting collective blocks a thread of
  one shared pool (as many threads as devices), and once it is full the
  program hangs until the 40-second rendezvous timeout aborts the process.
  A program is safe when every collective (or loop of collectives) after
  such a loop in the same computation depends on it; this lists the pairs
  that do not.

  Args:
    program: a compiled program or its HLO text (see ``collectives``).

  Returns:
    list of ``Unordered(computation, loop, op)``, in schedule order; empty
    when the collectives of every computation are ordered.

  Example:
    >>> import jaxpar
    >>> hlo = '''HloModule m, is_scheduled=true
    ... %body (p: f32[2]) -> f32[2] {
    ...   %p = f32[2]{0} parameter(0)
    ...   ROOT %sum = f32[2]{0} all-reduce(%p), to_apply=%add
    ... }
    ... ENTRY %main (x: f32[2], y: f32[2]) -> (f32[2], f32[2]) {
    ...   %x = f32[2]{0} parameter(0)
    ...   %y = f32[2]{0} parameter(1)
    ...   %loop = f32[2]{0} while(%x), condition=%cond, body=%body
    ...   %late = f32[2]{0} all-reduce(%y), to_apply=%add
    ...   ROOT %out = (f32[2]{0}, f32[2]{0}) tuple(%loop, %late)
    ... }'''
    >>> jaxpar.hlo.unordered_collectives(hlo)   # `late` reads y, not `loop`
    [Unordered(computation='main', loop='loop', op='late')]
    >>> jaxpar.hlo.unordered_collectives(hlo.replace('all-reduce(%y)',
    ...                                              'all-reduce(%loop)'))
    []
  """
  comps = _computations(_hlo_text(program))
  holders = _holders(comps)
  found = []
  for computation, instructions in comps.items():
    bearing = [m for m in instructions
               if _is_collective(m) or set(_called(m)) & holders]
    loops = {m.group('name') for m in bearing if m.group('op') in _NESTED}
    if not loops:
      continue
    ancestors = _loop_ancestors(instructions, loops)
    for i, later in enumerate(bearing):
      for earlier in bearing[:i]:
        name = earlier.group('name')
        if name in loops and name not in ancestors[later.group('name')]:
          found.append(Unordered(computation, name, later.group('name')))
  return found


def control_flow(program: Any, computation: str | None = None
                 ) -> dict[str, int]:
  """The program's data-dependent control flow: what XLA:GPU syncs on.

  On XLA:GPU a ``while`` reads its predicate, and a ``conditional`` its
  branch index, back to the host each time it runs, unless XLA records it
  in a command buffer (``docs/executor.md``, "Cost on GPU"). A ``while``
  with a ``known_trip_count`` (a ``lax.scan`` or ``fori_loop`` of static
  length) is not counted.

  Args:
    program: a compiled program or its HLO text (see ``collectives``).
    computation: count in this computation and what it runs (a loop's
      body, say); default the entry computation: the whole program.

  Returns:
    ``{'while': n, 'conditional': n}``, each instruction once (an op in a
    loop's body counts once however often the loop runs).

  Example:
    >>> import jax, jax.numpy as jnp, jaxpar
    >>> gated = jax.jit(lambda p, x: jax.lax.cond(p, jnp.sin, jnp.cos, x))
    >>> jaxpar.hlo.control_flow(gated.lower(True, 1.).compile())
    {'while': 0, 'conditional': 1}
  """
  text = _hlo_text(program)
  comps = _computations(text)
  entry = re.search(r'^ENTRY\s+%?([\w.\-]+)', text, re.M)
  counts, seen = {'while': 0, 'conditional': 0}, set()

  def visit(name: str) -> None:
    if name in seen:
      return
    seen.add(name)
    for m in comps.get(name, ()):
      op = m.group('op')
      counts['while'] += (op == 'while'
                          and 'known_trip_count' not in m.group('rest'))
      counts['conditional'] += op == 'conditional'
      for callee in _called(m):
        visit(callee)
  visit(computation or (entry.group(1) if entry else ''))
  return counts
