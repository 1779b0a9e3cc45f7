"""The exception types users catch."""


class ConfigError(ValueError):
    """A configuration, argument or input that cannot be used as given.

    The message names the offending key (dotted path) or file and says what to write instead.
    It is raised before anything is compiled.
    """


class LossScaleError(FloatingPointError):
    """fp16 gradients overflowed with the loss scale already at its minimum.

    DeepSpeed stops the run here; so do we, saying which parameters went non-finite first and for
    how many steps in a row. The engine's state is that of the last applied step.
    """


class NonFiniteError(FloatingPointError):
    """A bf16/fp32 run's loss or gradients went non-finite (`run.non_finite: stop`), or its parameters did.

    The message names the step, the first non-finite leaves and the newest checkpoint saved before
    it; nothing after that step was saved.
    """
