"""The random number generators of a process as a state to checkpoint (`RngState`): a resumed
job then draws what an uninterrupted one would (dropout masks, sampling, shuffles made with the
global generators), as Hugging Face's Trainer and Accelerate resume."""

from __future__ import annotations

import math
import random
import struct
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from .errors import CorruptCheckpointError
from .states import CheckedState

_WORDS = 624
"""The 32-bit words of a Mersenne Twister's state (Python's `random`, NumPy's legacy generator)."""


class RngState(CheckedState):
    """Python's `random`, NumPy's global generator, torch's CPU generator and, where CUDA is
    available, the current CUDA device's, as one of the manager's states
    (`states={"rng": RngState()}`). Each rank draws streams of its own, so the state is keyed by
    rank (`rank_N`, N the rank in `process_group`: give the manager's, where it was given one):
    a resume on fewer ranks leaves the others' entries, with a warning; on more, the load is
    refused naming the state (exclude it, `checkpoint.exclude_from_loading`, to start the
    generators from the job's seeds). A step saved without CUDA leaves a CUDA generator as it
    is, and a CUDA one loads without. What a load read is checked whole before any generator
    is set (`check_loaded`)."""

    def __init__(self, process_group: dist.ProcessGroup | None = None):
        self._group = process_group

    @property
    def key(self) -> str:
        """This rank's entry in the state: `rank_N`."""
        return f"rank_{dist.get_rank(self._group) if dist.is_initialized() else 0}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's generators as they are now, under `key`."""
        version, words, gauss = random.getstate()
        _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        entry: dict[str, Any] = {  # bytes, not tensors: a load reads them, and they are checked, before any tensor
            "python": {"version": version, "state": struct.pack(f"<{_WORDS + 1}I", *words), "gauss": gauss},
            "numpy": {"keys": keys.astype("<u4").tobytes(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "torch": torch.get_rng_state().numpy().tobytes(),
        }
        # always there, None without CUDA: a load's template is this state's, and a step lacking it would be refused
        entry["cuda"] = torch.cuda.get_rng_state().numpy().tobytes() if torch.cuda.is_available() else None
        return {self.key: entry}

    def check_loaded(self, state_dict: dict[str, Any]) -> None:
        """A `CorruptCheckpointError` naming the entry unless this rank's generators take what
        the load read for them."""
        self._parts(state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Set this rank's generators to what the load read for them (checked first)."""
        python, numpy, cpu, cuda = self._parts(state_dict)
        random.setstate(python)
        np.random.set_state(numpy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda)

    def _parts(self, state_dict: dict[str, Any]) -> tuple[tuple, tuple, torch.Tensor, torch.Tensor | None]:
        """What each generator is set to, from `state_dict` as a load read it; a
        `CorruptCheckpointError` naming the entry unless every part is one its generator takes."""
        entry = _field(state_dict, self.key, dict, "")
        python = _field(entry, "python", dict, self.key)
        where = f"{self.key}.python"
        if _field(python, "version", int, where) != 3:
            raise CorruptCheckpointError(f"the RNG state's {where}.version is {python['version']!r}, not 3 (Python's "
                                         "random)")
        words = _words(_field(python, "state", bytes, where), _WORDS + 1, f"{where}.state")
        if not 0 <= words[-1] <= _WORDS:
            raise CorruptCheckpointError(f"the RNG state's {where}.state ends with the index {words[-1]}, not one of "
                                         f"0 to {_WORDS}")
        gauss = python.get("gauss")
        if gauss is not None and not _finite(gauss):
            raise CorruptCheckpointError(f"the RNG state's {where}.gauss is {gauss!r}, not None or a finite float")
        numpy = _field(entry, "numpy", dict, self.key)
        where = f"{self.key}.numpy"
        keys = _words(_field(numpy, "keys", bytes, where), _WORDS, f"{where}.keys")
        pos, has_gauss = _field(numpy, "pos", int, where), _field(numpy, "has_gauss", int, where)
        cached = _field(numpy, "cached_gaussian", float, where)
        if not 0 <= pos <= _WORDS or has_gauss not in (0, 1) or not _finite(cached):
            raise CorruptCheckpointError(f"the RNG state's {where}: pos {pos}, has_gauss {has_gauss} and "
                                         f"cached_gaussian {cached} are not a generator's (0 to {_WORDS}, 0 or 1, a "
                                         "finite float)")
        cpu = _generator_state(_field(entry, "torch", bytes, self.key), "cpu", f"{self.key}.torch")
        cuda = entry.get("cuda")  # None: saved without CUDA, that generator stays as it is
        if cuda is not None:
            cuda = _field(entry, "cuda", bytes, self.key)
        cuda = _generator_state(cuda, "cuda", f"{self.key}.cuda") if cuda and torch.cuda.is_available() else None
        return ((3, tuple(words), gauss),
                ("MT19937", np.array(keys, dtype=np.uint32), pos, has_gauss, cached), cpu, cuda)


def _field(parent: dict[str, Any], name: str, kind: type, where: str) -> Any:
    value = parent.get(name) if isinstance(parent, dict) else None
    if type(value) is not kind and not (kind is float and type(value) is int):
        named = f"{where}.{name}" if where else name
        raise CorruptCheckpointError(f"the RNG state's {named} is {type(value).__name__}, not {kind.__name__}")
    return value


def _words(data: bytes, count: int, where: str) -> tuple[int, ...]:
    """The `count` 32-bit words `data` holds."""
    if len(data) != 4 * count:
        raise CorruptCheckpointError(f"the RNG state's {where} is {len(data)} bytes, not {4 * count}")
    return struct.unpack(f"<{count}I", data)


def _generator_state(data: bytes, device: str, where: str) -> torch.Tensor:
    """`data` as the state of a torch generator of `device`: tried on one of its own first."""
    state = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    try:
        torch.Generator(device=device).set_state(state)
    except RuntimeError as e:
        raise CorruptCheckpointError(f"the RNG state's {where} is not a {device} generator's state: {e}") from None
    return state


def _finite(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)
