"""Errors that carry a message meant for the user (CLI prints them as one line; HTTP maps them to 4xx)."""


class TokenmillError(Exception):
    """Base class for errors whose message is shown to the user as is."""


class ModelLoadError(TokenmillError):
    """A model directory cannot be served: unsupported architecture, missing or mismatched tensor, bad file."""


class InvalidRequestError(TokenmillError):
    """A request is malformed or cannot be served (too long, bad sampling parameters)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineOverloadedError(TokenmillError):
    """The bounded waiting queue is full; retry later."""
