"""One exception hierarchy for everything the checkpoint manager raises on purpose."""

from __future__ import annotations

import pickle
import reprlib
from collections.abc import Callable, Sequence
from typing import NoReturn


def in_chain(error: BaseException | None, test: Callable[[BaseException], bool]) -> BaseException | None:
    """The first of `error` and the errors it was raised from or while handling (`__cause__`,
    else `__context__`) that passes `test`; None if none does."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if test(error):
            return error
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return None


def no_thread(error: BaseException | None) -> bool:
    """Whether `error`, or an error it was raised from or during, is a thread that could not
    start: CPython's `RuntimeError` where the process is at its limit of threads (`ulimit -u`, a
    container's pids limit) or of memory for their stacks (`ulimit -v`)."""
    return in_chain(error, lambda e: isinstance(e, RuntimeError) and "can't start new thread" in str(e)) is not None


def printable(text: str) -> str:
    """`text` with each character a terminal or log would act on (a newline faking a line of its
    own, an escape code, a lone surrogate no encoding takes) written as its escape: messages
    carry names and fields read from checkpoints."""
    return text if text.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def few(items: Sequence[object], shown: int = 10) -> str:
    """`items` (steps, paths, ranks) for a message: the first `shown`, then how many more (a
    crashed job's folder, or a run's copy, may hold thousands; a job, thousands of ranks)."""
    listed = ", ".join(map(str, items[:shown]))
    return f"{listed} and {len(items) - shown} more" if len(items) > shown else listed


def counted(n: int, noun: str, nouns: str = "") -> str:
    """`n` with its noun for a message: "1 rank", "2 ranks" (`nouns` where not `noun` + "s")."""
    return f"{n} {noun if n == 1 else nouns or noun + 's'}"


def different_copies(what: str, ranks: Sequence[int]) -> str:
    """What to say of `what` (a file or folder) read differently by `ranks` than by rank 0
    (`CheckpointGroup.differing`)."""
    return (f"{what} differs on rank(s) {few(ranks)} from rank 0's: the ranks would load different checkpoints. "
            "Is the folder on node-local disks (a copy per node, not alike), or was it replaced while it was read? "
            "Give every rank the same files (a file system they share) and load again")


def _rebuilt(cls: type[BaseException], args: tuple, state: dict) -> BaseException:
    """An error of class `cls` with `args` and attributes `state`, made without calling its
    `__init__` (whose parameters are not its `args`): what `_Rebuilt` unpickles."""
    error = cls.__new__(cls, *args)
    error.args = args
    error.__dict__.update(state)
    return error


class _Rebuilt:
    """Pickled (and copied) as its args and attributes: an error whose `__init__` takes other
    parameters than the message it passes on failed to unpickle, and torch.distributed passes
    one rank's failure to the others pickled (DCP's `dcp.load` and `dcp.save`), or a process
    pool to its caller."""

    def __reduce__(self) -> tuple:
        error: BaseException = self  # type: ignore[assignment]
        return _rebuilt, (type(error), error.args, dict(error.__dict__))


class CheckpointError(_Rebuilt, Exception):
    """Base class of every error this package raises to its caller deliberately; those at the end
    of this module, from `WriterProcessError` on, pass between its parts and reach a caller
    inside one of these (as a `CheckpointSaveError`'s cause, say)."""

    def __str__(self) -> str:
        """The message `printable`: it may hold names read from a checkpoint."""
        return printable(super().__str__())


class BoundedRepr(reprlib.Repr):
    """reprlib's bounded repr, without `repr`'s own failure on an int of over 4300 digits."""

    def repr_int(self, x: int, level: int) -> str:
        if x.bit_length() > 128:
            return f"<an int of {x.bit_length()} bits>"
        return super().repr_int(x, level)


class _ValueRepr(BoundedRepr):
    """A config value's repr for a message, bounded (a table a dotted key nests a thousand deep,
    a list of millions); a string is shown whole up to 1000 characters (any path one would type)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 4
        self.maxstring = self.maxother = 1000


_value_repr = _ValueRepr().repr


class ConfigError(CheckpointError, ValueError):
    """A config value is missing, of the wrong type, out of range or contradicts another."""

    def __init__(self, key: str, value: object, expected: str):
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{key} = {_value_repr(value)}: {expected}")


def restate(error: BaseException, rename: Callable[[str], str]) -> None:
    """Rewrite in place the message of `error` (and the path or place it keeps) with `rename`:
    errors raised deep in a reader name the local copy a remote store staged, which `rename`
    turns into the name the user gave. Done in place, the error keeps its type and traceback."""
    if error.args and isinstance(error.args[0], str):
        error.args = (rename(error.args[0]), *error.args[1:])
    for field in ("path", "where"):
        if isinstance(getattr(error, field, None), str):
            setattr(error, field, rename(getattr(error, field)))


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint that the config or the caller asked for does not exist (or is incomplete)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files exist but cannot be trusted: bad marker, bad metadata, unsafe content."""


class MisnamedStepError(CorruptCheckpointError):
    """A step of ours in a folder named for another step (renamed, or copied in under another
    name): a load by the folder's name would count from another step than it holds; a load of
    the newest step passes it over."""


class NewerVersionError(CheckpointError):
    """A step of a newer torchtitan_ckpt (its commit marker's version is above this one's): not
    damaged, so never passed over as a corrupt one (`verify_fallback`) for a save to replace."""


class OlderVersionError(CheckpointError):
    """A step of an older torchtitan_ckpt whose steps this one does not read (its commit marker's
    version is below this one's): not damaged either, so never passed over as a corrupt one
    (`verify_fallback`) for a save to replace; resumed with the version that wrote it."""


class PartialLoadError(CheckpointError):
    """A load failed after it had begun changing the job's state in place: the storage failed (an
    I/O error) or a file changed while it was read, or a state refused what was read. What this
    package can check of a checkpoint is checked before the first tensor byte is written, so a
    damaged or crafted checkpoint is refused before this point. The model and optimizer in
    memory are now part one step, part what they were: the manager refuses to save them until a
    load succeeds."""

    _TEXT = ("loading {path} failed{where} after it had begun writing the job's tensors in place ({cause}); the "
             "model and optimizer in memory are now part that step, part what they were: do not train or save "
             "them; {then}")
    _THEN = ("load a step again, or restart the job",
             "restart the job (a collective failed: the ranks cannot run another)")
    """What to do next: after a failed collective no later load can run."""

    def __init__(self, path: str, cause: BaseException):
        self.path = path
        self.cause = cause
        where, text = "", f"{type(cause).__name__}: {cause}"
        collective = (CollectiveError.__name__ in cause.kinds if isinstance(cause, RankFailed) else
                      in_chain(cause, lambda e: isinstance(e, CollectiveError)) is not None)
        if isinstance(cause, RankFailed):  # another rank's failure, as it described it: this text, once
            where, text = f" on {cause.who}", cause.message
            for then in self._THEN:
                head, _, tail = self._TEXT.format(path=path, where="", cause="\0", then=then).partition("\0")
                head, tail = printable(f"{PartialLoadError.__name__}: {head}"), printable(tail)  # as str() gave it
                if text.startswith(head) and text.endswith(tail):
                    text = text[len(head):len(text) - len(tail)]
                    break
        super().__init__(self._TEXT.format(path=path, where=where, cause=text, then=self._THEN[collective]))


class AdapterMismatchError(CheckpointError, KeyError):
    """The tensors of a state dict or checkpoint are not the ones a state-dict adapter maps:
    names it does not know, names it expects and does not find, or shapes other than the model
    config's. `unknown` and `missing` list both sides."""

    def __init__(self, where: str, unknown: list[str], missing: list[str],
                 hint: str = "is the adapter (or the model config) the one this checkpoint was made for?"):
        self.where = where
        self.unknown = sorted(unknown)
        self.missing = sorted(missing)
        self.hint = hint
        super().__init__(where, self.unknown, self.missing)

    def __str__(self) -> str:  # KeyError would print the repr of its args
        return printable(f"{self.where}: {len(self.unknown)} unknown name(s) {self.unknown} and "
                         f"{len(self.missing)} missing name(s) {self.missing}; {self.hint}")


class CheckpointSaveError(CheckpointError):
    """A save failed; the step it was writing is left incomplete and is never loaded."""

    def __init__(self, step: int, path: str, cause: BaseException, hint: str = ""):
        self.step = step
        self.path = path
        self.cause = cause
        self.unsaved: int | None = None
        """The step of the `save()` that raised this failure of an earlier background save: it
        saved nothing of its own."""
        where, text = "", f"{type(cause).__name__}: {cause}"
        if isinstance(cause, RankFailed):  # another rank's failure, as it described it
            where, text = f" on {cause.who}", cause.message
        super().__init__(f"saving step {step} to {path} failed{where}: {text}{hint}")

    def __str__(self) -> str:
        text = super().__str__()
        if self.unsaved is None or self.unsaved == self.step:
            return text
        return f"{text}; step {self.unsaved} is not saved either: the save({self.unsaved}) raising this saved nothing"


class CollectiveError(CheckpointError, RuntimeError):
    """A collective among the checkpoint's ranks failed: a rank did not join it in time (it
    called `save`/`load` otherwise than the others, or is stuck), or it failed or died."""


class StorageError(CheckpointError, OSError):
    """A storage backend (an object store) refused or kept failing a request after its bounded
    retries; the message names the URL and what was tried."""


class StagingMismatchError(CheckpointError):
    """With `checkpoint.verify_staging`: a tensor a background save was staging changed between
    `save()` and the optimizer's step (the message names it), so the checkpoint would hold values
    of two steps."""


class InvalidShardsError(CorruptCheckpointError):
    """The shard files cannot be consolidated: unreadable header, unknown dtype, missing or
    overlapping blocks. The message names the file or tensor."""


class ConsolidationError(CheckpointError):
    """Another rank failed while writing the final files; the export is incomplete (no index)."""


# ---------------------------------------------------------------- between the package's parts


class WriterProcessError(RuntimeError):
    """The writer process is gone (killed, crashed), answered nonsense, or could not be handed
    a save's files (they cannot be pickled)."""


class InWriterProcess(Exception):
    """The writer process's traceback of a failure it handed over, as that failure's cause: a
    pickled exception has no frames, and a bug report needs the place it was raised."""

    def __str__(self) -> str:
        return "\n\n" + self.args[0]


class UnsafePickleError(CorruptCheckpointError, pickle.UnpicklingError):
    """A pickle refused by `check_pickle`: malformed, or building objects whose use would take
    time out of proportion to its size. An `UnpicklingError` too, so that callers that refuse
    what torch's allow-list unpickler refuses refuse these alike. `problem` says what is wrong,
    for a caller that names the file its own way; `malformed`, whether it is not a whole pickle
    (as a slice cut at a wrong end is not)."""

    def __init__(self, what: str, problem: str, malformed: bool = False):
        self.problem = problem
        self.malformed = malformed
        super().__init__(f"{what}: its pickle {problem}; refusing to unpickle it (the file is damaged or crafted)")


class UnrecognisedArchive(Exception):
    """The archive is not of the one shape read here; `torch.load` reads it instead."""


class MalformedArchive(Exception):
    """The archive's framing is one `torch.save` never writes (a zip directory larger than the
    caller allows, a record of an impossible size): the item is refused, not handed to
    `torch.load`. The message says what is wrong, for the caller to name the file."""


class RankFailed(_Rebuilt, Exception):
    """A function run by `CheckpointGroup.run` failed on some rank. Every rank raises it, the
    failing ones and the others alike, so no rank waits forever on one that gave up. DCP's save
    failing on another rank is one too (`dcp.storage.root_cause`)."""

    def __init__(self, rank: int, message: str, kinds: tuple[str, ...], error: BaseException | None,
                 who: str | None = None):
        who = who or f"rank {rank}"
        super().__init__(f"{who}: {message}")
        self.rank = rank
        self.who = who
        """The failing rank as messages name it (`CheckpointGroup.name`)."""
        self.message = message
        """Its failure, without `who`."""
        self.kinds = kinds
        """Class names of every failing rank's failure and their bases, e.g. to tell corrupt input
        from I/O errors; the same on every rank."""
        self.error = error
        """This rank's own failure; None when only other ranks failed."""

    def reraise(self, what: str) -> NoReturn:
        """Raise the failure of `what` (e.g. "loading /ckpt/step-5") as a `CheckpointError`:
        this rank's own `CheckpointError` as it is, its other error wrapped, or one naming the
        rank that failed."""
        if isinstance(self.error, CheckpointError):
            raise self.error from None
        if self.error is not None:
            raise CheckpointError(f"{what} failed: {type(self.error).__name__}: {self.error}") from self.error
        raise CheckpointError(f"{what} failed on {self}") from None
