"""The error a user fixes: raised by config resolution, loaders, checkpoints and the run directory alike, and
printed by the entry points as a message (exit 2) instead of a traceback."""


class ConfigError(ValueError):
    """A configuration the user must fix; the message names the key, file or item, the value and what is
    allowed."""
