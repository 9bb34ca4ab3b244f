"""User-facing errors. The CLI prints their message as one line and exits with status 2."""


class CidersError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class ConfigError(CidersError):
    """A bad configuration value; the message names the key."""
