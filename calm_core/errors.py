"""User-facing errors: each carries a one-line message that names the problem (file, line, field)."""


class CalmError(Exception):
    """An error caused by the user's input or environment; the CLI prints it as one line, no traceback."""


class DataError(CalmError):
    """A dataset is unknown, missing, or has a malformed line."""


class ArtifactError(CalmError):
    """An alpha-head artifact is missing, corrupt, or does not match the model it is applied to."""


class ModelError(CalmError):
    """A model cannot be found or prepared."""


class ConfigError(CalmError):
    """A configuration file is missing or invalid."""
