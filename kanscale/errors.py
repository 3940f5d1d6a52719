"""The one error kind users see without a traceback."""


class ConfigError(ValueError):
    """Input the suite refuses (a config, a flag, a file), with a message meant for the user
    that names the field and the fix."""
