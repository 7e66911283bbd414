"""Values read from a checkpoint, handled so that a crafted one costs time and memory in
proportion to its size.

`check_pickle` scans a pickle's opcodes before it is unpickled. Unpickling hashes dict keys and
set members as it goes, and later code compares and prints what it built; a pickle that reuses an
object through its memo (`t = (t, t)`, 500 times over) is a few KB that hashes in 2**500 steps,
and one that nests tuples a million deep overflows the C stack. The scan follows the objects the
pickle would build without building any, and refuses it when one of them, unfolded as a tree
(every reference to a shared object counted again, as hashing, comparing and printing go), is
too deep or too large.

`brief` is a repr of bounded length and cost, for putting such a value in an error message.
"""

from __future__ import annotations

import dataclasses
import pickletools
import sys
from itertools import islice
from typing import Any

import torch

from ..errors import BoundedRepr, UnsafePickleError

MAX_DEPTH = 100
"""Deepest nesting a checkpoint's pickle may build, counting an object built by a class (its
arguments, its state) as levels of its own: DCP's `.metadata` nests 11 deep, a non-tensor value
or a dataloader's state a few more."""
MAX_DIMS = 64
"""Most dimensions of a tensor a checkpoint describes (DCP's metadata, a safetensors header)."""
MAX_CHOSEN_KEYS = 4096
"""Most keys of one dict (or members of one set) whose hash a pickle can choose (large ints,
floats, tuples and values built from them): many sharing one hash make building the dict
quadratic (a pickle of under a megabyte then unpickles for seconds). Scalars' hashes are distinct or
randomised per process (strings), and a class's own objects hash as their class says."""
MIN_UNFOLDED = 1 << 20
UNFOLDED_PER_BYTE = 4
"""A pickle of N bytes may build objects that unfold to at most max(MIN_UNFOLDED,
UNFOLDED_PER_BYTE * N) parts. Without sharing, each part takes a byte or more of the pickle
(DCP's `.metadata`, which shares its dtypes, unfolds to about one part per 3 bytes)."""

_GET, _LEAF, _EMPTY, _MARK, _POP, _MEMOIZE, _PUT, _DUP, _NEW, _INTO, _DROP = range(11)
_SPECIAL = {"GET": _GET, "BINGET": _GET, "LONG_BINGET": _GET, "EMPTY_LIST": _EMPTY, "EMPTY_DICT": _EMPTY,
            "EMPTY_SET": _EMPTY, "MARK": _MARK, "POP": _POP, "MEMOIZE": _MEMOIZE, "PUT": _PUT, "BINPUT": _PUT,
            "LONG_BINPUT": _PUT, "DUP": _DUP}


def _action(op: pickletools.OpcodeInfo) -> tuple[int, int, bool]:
    """What `op` does to the unpickler's stack: (kind, how many objects it pops below the topmost
    mark or, without one, in all, whether it pops to the topmost mark)."""
    name, before = op.name, op.stack_before
    marked = pickletools.markobject in before
    n = before.index(pickletools.markobject) if marked else len(before)
    if name in _SPECIAL:
        return _SPECIAL[name], 1 if _SPECIAL[name] == _PUT else n, marked  # PUT looks at the top object
    if name in ("APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"):
        return _INTO, n, marked  # adds what it pops to the object below, which stays
    if not op.stack_after:
        return _DROP, n, marked
    return (_NEW if n or marked else _LEAF), n, marked


_LENGTHS = {pickletools.TAKEN_FROM_ARGUMENT1: (1, False), pickletools.TAKEN_FROM_ARGUMENT4: (4, True),
            pickletools.TAKEN_FROM_ARGUMENT4U: (4, False), pickletools.TAKEN_FROM_ARGUMENT8U: (8, False)}
"""Opcode arguments that are a length (its bytes, signed) and that many bytes."""
_MEMO_ARGS = {"GET", "BINGET", "LONG_BINGET", "PUT", "BINPUT", "LONG_BINPUT"}
_NUMBERS = {"INT": 1, "LONG": 1, "LONG1": 1, "LONG4": 1, "FLOAT": 2, "BINFLOAT": 2}
"""Opcodes of a number that may be a key of chosen hash: an int (1) when it is large (its hash
is the int modulo `sys.hash_info.modulus`), a float (2) always."""
_KEYS = {"SETITEM": 1, "SETITEMS": 1, "DICT": 1, "ADDITEMS": 2, "FROZENSET": 2}
"""Opcodes that hash what they take: every other object from the first (a dict's keys, 1), or
every object (a set's members, 2)."""
_TUPLES = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "FROZENSET"}
"""Opcodes that build a value whose hash follows from its parts' (a pickle can make many share one)."""
_GATHERS = {"TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "LIST", "APPEND", "APPENDS"}
"""Opcodes that put objects in a tuple or list as they are: what a class called on it (`set`,
`frozenset`, `OrderedDict`) may hash, so their count of chosen hashes is carried along."""


def _opcode_table() -> list[tuple | None]:
    """Per opcode byte (None: not an opcode): its `_action`, how its argument is laid out (a
    fixed size, a line (two for GLOBAL and INST), or a length first), whether the argument is a memo index (the
    one argument the scan reads besides numbers), whether it is STOP, and its `_NUMBERS`, `_KEYS`,
    `_TUPLES` and `_GATHERS` entries."""
    table: list[tuple | None] = [None] * 256
    for op in pickletools.opcodes:
        size = 0 if op.arg is None else op.arg.n
        lines = 2 if op.arg is not None and op.arg.name == "stringnl_noescape_pair" else 1  # GLOBAL, INST
        table[ord(op.code)] = (*_action(op), size, lines, op.name in _MEMO_ARGS, op.name == "STOP",
                               _NUMBERS.get(op.name, 0), _KEYS.get(op.name, 0), op.name in _TUPLES,
                               op.name in _GATHERS)
    return table


_OPCODES = _opcode_table()


def check_pickle(data: bytes, what: str) -> int:
    """Raise `UnsafePickleError` naming `what` (the file, or the entry and its file) unless
    `data` is a well-formed pickle whose every object unfolds to at most `MAX_DEPTH` levels and
    max(`MIN_UNFOLDED`, `UNFOLDED_PER_BYTE` * len(data)) parts; return its length, through its
    STOP opcode (what follows is not read by an unpickler). Linear in the size of `data`: about
    three times as long as unpickling it."""
    try:
        found = _scan(data, max(MIN_UNFOLDED, UNFOLDED_PER_BYTE * len(data)))
    except (ValueError, IndexError, KeyError) as e:  # genops' errors, and a stack or memo it lacks
        raise UnsafePickleError(what, f"is not well formed ({type(e).__name__}: {brief(str(e))})", True) from None
    if isinstance(found, str):
        raise UnsafePickleError(what, found)
    return found


def _scan(data: bytes, limit: int) -> int | str:
    """The length of the pickle at the start of `data` (through its STOP), or why the objects
    it builds are unsafe to use; raises on a malformed pickle.

    One pass over the opcodes, with a stack, marks and memo of [unfolded size, depth, taken in]
    per object where the unpickler has the objects, so each object's size and depth are known
    once it is built. An object changed after another one took it in (a pickle that refers to
    itself, or a crafted one) is refused, so that what an object unfolds to is final once it is
    used. Scalars share one entry. The opcodes are walked here rather than with
    `pickletools.genops`, which decodes every argument (the scan reads only memo indices): a
    large `.metadata` is hundreds of thousands of opcodes, and this is what a load pays for them.
    """
    data = bytes(data)
    opcodes, end, pos, modulus = _OPCODES, len(data), 0, sys.hash_info.modulus
    leaf = [1, 0, False, False, 0]  # [unfolded size, depth, taken in, hash chosen, chosen hashes held]
    chosen_leaf = [1, 0, False, True, 0]  # a number whose hash the pickle chooses
    stack: list[list] = []
    marks: list[int] = []
    memo: dict[int, list] = {}
    fence = 0  # the unpickler's: the topmost mark, below which nothing but a mark-popping opcode pops
    while True:
        if pos >= end:
            raise ValueError("the pickle ends before its STOP opcode")
        entry = opcodes[data[pos]]
        if entry is None:
            raise ValueError(f"byte {pos} holds {data[pos]:#04x}, which is not an opcode")
        kind, n, marked, layout, lines, memo_arg, stop, number, keys, builds_tuple, gathers = entry
        pos += 1
        arg, chosen = None, number == 2
        if layout > 0:
            if memo_arg:
                arg = data[pos] if layout == 1 else int.from_bytes(data[pos:pos + layout], "little")
            pos += layout
        elif layout == pickletools.UP_TO_NEWLINE:
            for _ in range(lines):
                eol = data.find(b"\n", pos)
                if eol < 0:
                    raise ValueError(f"the argument at byte {pos} has no end of line")
                if memo_arg:
                    arg = int(data[pos:eol])
                elif number == 1:
                    chosen = abs(int(data[pos:eol].rstrip(b"L"))) >= modulus
                pos = eol + 1
        elif layout:
            width, signed = _LENGTHS[layout]
            length = int.from_bytes(data[pos:pos + width], "little", signed=signed)
            if length < 0:
                raise ValueError(f"the argument at byte {pos} has a negative length")
            if number == 1 and length >= 8:
                chosen = abs(int.from_bytes(data[pos + width:pos + width + length], "little", signed=True)) >= modulus
            pos += width + length
        if pos > end:
            raise ValueError("the pickle ends inside an opcode's argument")
        if stop:
            if len(stack) <= fence:
                raise IndexError("stack underflow")
            return pos
        if kind == _GET:
            stack.append(memo[arg])
        elif kind == _MEMOIZE and len(stack) > fence:
            memo[len(memo)] = stack[-1]
        elif kind == _LEAF:
            stack.append(chosen_leaf if chosen else leaf)
        elif kind == _EMPTY:
            stack.append([1, 0, False, False, 0])
        elif kind == _MARK:
            marks.append(len(stack))
            fence = len(stack)
        elif kind == _POP and marks and fence == len(stack):
            marks.pop()
            fence = marks[-1] if marks else 0
        else:
            parts = []
            if marked:
                parts = stack[marks[-1]:]  # IndexError without a mark
                del stack[marks.pop():]
                fence = marks[-1] if marks else 0
            if len(stack) - n < fence:
                raise IndexError("stack underflow")
            if n:
                parts = stack[-n:] + parts
                del stack[-n:]
            if kind == _PUT or kind == _DUP:
                stack += parts * (2 if kind == _DUP else 1)
                if kind == _PUT:
                    memo[arg] = parts[0]
                continue
            if kind == _DROP or kind == _POP:
                continue
            if kind == _INTO:
                node = parts.pop(0)
                if node[2] or node is leaf or node is chosen_leaf or any(p is node for p in parts):
                    return "changes an object after another object took it in"
            else:
                node = [1, 0, False, builds_tuple, 0]
            size, depth, chosen, held = node[0], node[1], False, 0
            for part in parts:
                part[2] = True
                size += part[0]
                if part[1] >= depth:
                    depth = part[1] + 1
                if part[3]:
                    chosen = True
                    held += 1
                held += part[4]
            if chosen or held:  # rare: most pickles hold no value whose hash they choose
                if kind != _INTO:  # a tuple, or an object built from chosen parts, has a hash the pickle chooses
                    node[3] = node[3] or chosen
                if keys:  # a dict's keys or a set's members, hashed as they go in
                    node[4] += sum(1 for p in (parts[::2] if keys == 1 else parts) if p[3])
                    if node[4] > MAX_CHOSEN_KEYS:
                        return (f"builds a dict or set of more than {MAX_CHOSEN_KEYS} keys whose hashes it can choose "
                                "(large numbers, tuples): keys made to share one would take quadratic time to build")
                elif gathers:
                    node[4] += held
                elif kind == _NEW and held > MAX_CHOSEN_KEYS:  # a class called on them
                    return (f"hands a class (a set built from a list) more than {MAX_CHOSEN_KEYS} values whose hashes "
                            "it can choose (large numbers, tuples): ones made to share one would take quadratic time")
            if depth > MAX_DEPTH:
                return f"builds objects that nest more than {MAX_DEPTH} deep"
            if size > limit:
                return f"builds objects that unfold to more than {limit} parts (objects referenced over and over)"
            node[0], node[1] = size, depth
            stack.append(node)


# ---------------------------------------------------------------- bounded repr


class _Brief(BoundedRepr):
    """A bounded repr, without reprlib's two unbounded steps: it sorts a dict's keys or a set's
    members (comparing them all) and it calls `repr` on any object it does not know (which
    recurses into all of it)."""

    _SCALARS = (bool, float, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxtuple = self.maxlist = self.maxdict = self.maxset = self.maxfrozenset = 6
        self.maxstring = self.maxother = 160  # a tensor's whole name
        self.maxlong = 40

    def repr_bytes(self, x: bytes, level: int) -> str:
        return repr(x[: self.maxstring]) + ("..." if len(x) > self.maxstring else "")

    def repr_dict(self, x: dict, level: int) -> str:
        if not x or level <= 0:
            return "{...}" if x else "{}"
        pieces = [f"{self.repr1(k, level - 1)}: {self.repr1(v, level - 1)}" for k, v in islice(x.items(), self.maxdict)]
        return "{" + ", ".join(pieces) + (", ..." if len(x) > self.maxdict else "") + "}"

    def repr_set(self, x: set, level: int) -> str:
        return self._repr_iterable(list(islice(x, self.maxset + 1)), level, "{", "}", self.maxset)

    def repr_frozenset(self, x: frozenset, level: int) -> str:
        return self._repr_iterable(list(islice(x, self.maxset + 1)), level, "frozenset({", "})", self.maxset)

    def repr_instance(self, x: Any, level: int) -> str:
        name = type(x).__name__
        if isinstance(x, self._SCALARS):
            return super().repr_instance(x, level)
        if isinstance(x, tuple):
            return f"{name}({self.repr_tuple(x, level)})"
        if isinstance(x, list):
            return f"{name}({self.repr_list(x, level)})"
        if dataclasses.is_dataclass(x) and level > 0:
            fields = (f"{f.name}={self.repr1(getattr(x, f.name, None), level - 1)}" for f in dataclasses.fields(x))
            return f"{name}({', '.join(fields)})"
        return f"<{name}>"


brief = _Brief().repr
"""A repr of `value` of at most a few hundred characters, computed in bounded time."""


def shown(name: str) -> str:
    """A name read from a checkpoint or folder as a terminal or log may show it: as it is when
    printable, else quoted with escapes (an escape code, a newline faking a line, a lone
    surrogate no encoding takes)."""
    return name if name.isprintable() else brief(name)
