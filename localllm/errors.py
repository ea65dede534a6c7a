"""The one error type users see."""


class LocalLLMError(Exception):
    """A problem the user can act on. The CLI prints it as one `Error: ...` line and exits 1."""
