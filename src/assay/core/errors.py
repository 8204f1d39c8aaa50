"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class AssayError(Exception):
    """A problem the user can fix: the message names it and says how."""


class ConfigError(AssayError):
    pass


class CheckpointError(AssayError):
    pass


class UnknownEnvironmentError(AssayError):
    pass
