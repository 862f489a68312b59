"""Typed errors. Each carries a one-line message fit for a CLI or an HTTP 400."""


class UnmaskError(Exception):
    """Base class for every error unmask raises on purpose."""


class ModelLoadError(UnmaskError):
    """A model directory is missing, incomplete, corrupt or does not match its config."""


class UnsupportedModelError(ModelLoadError):
    """The config names an architecture or feature unmask does not implement."""


class InvalidRequestError(UnmaskError, ValueError):
    """A request parameter is out of range or parameters contradict each other."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """Prompt plus requested tokens exceed the model's context."""


class MemoryLimitError(ContextLengthError):
    """Prompt plus requested tokens need more KV cache than the memory free now holds (unmask.engine.memory)."""
