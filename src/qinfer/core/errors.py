"""The errors qinfer raises on bad input.

Every error carries one readable line that names the thing at fault (the file, the
tensor, the config field, the request parameter). The CLI prints that line and exits
with status 2 instead of showing a traceback from deep inside torch.
"""


class QinferError(Exception):
    """Base class: a problem with what the user gave us, explained in one line."""


class ConfigError(QinferError):
    """A checkpoint's configuration is missing, malformed or unsupported."""


class WeightsError(QinferError):
    """A weight file or tensor is missing, corrupt or of the wrong shape."""


class AdapterError(QinferError):
    """A LoRA adapter is unreadable, does not fit the model, or is not loaded."""


class CacheError(QinferError):
    """A KV cache was asked to hold more positions than it can."""


class TokenizerError(QinferError):
    """Tokenizer files are missing or unreadable, or a chat template cannot render."""


class SamplingError(QinferError):
    """A sampling parameter is out of range or of the wrong type."""


class RequestError(QinferError):
    """A request the engine cannot serve: empty prompt, too long, bad id (HTTP 400).

    param: the request field at fault, when one is (the server's error names it).
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(QinferError):
    """The engine's waiting queue is full; try again later (HTTP 503)."""


class AdapterSlotsBusyError(AdapterError, EngineOverloadedError):
    """Every resident LoRA adapter is in use by unfinished requests, so another cannot be
    made resident; try again when one ends (HTTP 503)."""
