"""Failures that no retry can mend: the stage fails at once and says what to do."""


class PermanentError(Exception):
    """Retrying cannot help: the settings, the input or something on disk must be fixed first."""
