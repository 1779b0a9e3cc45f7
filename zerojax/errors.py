"""The one exception type users catch for bad input."""


class ConfigError(ValueError):
    """A configuration, argument or input that cannot be used as given.

    The message names the offending key (dotted path) or file and says what to write instead.
    It is raised before anything is compiled.
    """
