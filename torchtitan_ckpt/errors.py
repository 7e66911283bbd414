"""One exception hierarchy for everything the checkpoint manager raises on purpose."""


class CheckpointError(Exception):
    """Base class of every error this package raises deliberately."""


class ConfigError(CheckpointError, ValueError):
    """A config value is missing, of the wrong type, out of range or contradicts another."""

    def __init__(self, key: str, value: object, expected: str):
        self.key = key
        self.value = value
        self.expected = expected
        super().__init__(f"{key} = {value!r}: {expected}")


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint that the config or the caller asked for does not exist (or is incomplete)."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files exist but cannot be trusted: bad marker, bad metadata, unsafe content."""


class AdapterMismatchError(CheckpointError, KeyError):
    """The tensors of a state dict or checkpoint are not the ones a state-dict adapter maps:
    names it does not know, names it expects and does not find, or shapes other than the model
    config's. `unknown` and `missing` list both sides."""

    def __init__(self, where: str, unknown: list[str], missing: list[str]):
        self.where = where
        self.unknown = sorted(unknown)
        self.missing = sorted(missing)
        super().__init__(where, self.unknown, self.missing)

    def __str__(self) -> str:  # KeyError would print the repr of its args
        return (f"{self.where}: {len(self.unknown)} unknown name(s) {self.unknown} and "
                f"{len(self.missing)} missing name(s) {self.missing}; is the adapter (or the "
                "model config) the one this checkpoint was made for?")


class CheckpointSaveError(CheckpointError):
    """A save failed; the step it was writing is left incomplete and is never loaded."""

    def __init__(self, step: int, path: str, cause: BaseException, hint: str = ""):
        self.step = step
        self.path = path
        self.cause = cause
        super().__init__(f"saving step {step} to {path} failed: {type(cause).__name__}: {cause}{hint}")
