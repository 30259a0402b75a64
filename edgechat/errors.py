"""Errors a user can cause. Each front end renders them as one line; only bugs give tracebacks."""


class EdgechatError(Exception):
    """Base class: the message is complete, one line, and says what to do."""

    #: process exit status the CLI uses for this error
    exit_code = 1


class UsageError(EdgechatError):
    """A bad argument or value (negative max tokens, temperature < 0, empty prompt)."""

    exit_code = 2


class InvalidFieldError(UsageError):
    """A bad field of a request (a tool's schema, its name): `param` is where it is, `code` what
    is wrong, so the server answers the 400 each API's clients match on."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class ModelNotFoundError(EdgechatError):
    """A model name, path or Hub reference that does not lead to a usable file."""


class ModelFormatError(EdgechatError):
    """A file that is not a GGUF llama.cpp can load: not GGUF, truncated, unknown architecture."""


class ModelTooLargeError(EdgechatError):
    """The planner found that the model cannot fit in the memory available."""


class PromptTooLongError(EdgechatError):
    """The prompt does not fit the context minus the room reserved for the answer."""

    def __init__(self, message: str, prompt_tokens: int, limit: int):
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.limit = limit


class EngineBusyError(EdgechatError):
    """The request queue is full; try again later."""


class EngineStoppedError(EdgechatError):
    """The engine is closed, or its thread stopped or stopped answering; restart to go on."""


class StoreError(EdgechatError):
    """The conversation store cannot be opened or written."""


class ModelLoadError(EdgechatError):
    """A model the server offers could not be loaded when a request asked for it (a corrupt or
    missing file); the other models go on serving."""


class NoRoomError(EdgechatError):
    """A model cannot be loaded now: what is loaded is busy and nothing fits beside it."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after
