"""User-facing errors. The CLI prints their message as one line and exits with status 2."""


class CidersError(Exception):
    """A problem the user can fix; the message says what is wrong and what to do."""


class ConfigError(CidersError):
    """A bad configuration value; the message names the key."""


class PayloadError(CidersError):
    """A message that must be rejected (malformed, or not what the receiver expects). Defined here, without
    torch, so that code which only routes messages (a ClientApp answering `hello`) imports nothing heavy."""
