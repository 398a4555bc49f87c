"""Errors a user can cause and fix. The CLI prints them as one line, without a traceback."""


class KvflowError(Exception):
    """Base of every user-facing error."""


class ModelLoadError(KvflowError):
    """The model could not be found, read or understood."""


class UnsupportedModelError(ModelLoadError):
    """The model is readable but kvflow cannot run it (architecture, tensor type, rope type...)."""
