"""The DeepSpeed-shaped engines: a thin stateful shell around the pure plan, state and step.

`Engine` trains a loss over a parameter pytree, `PipelineEngine` a `PipelineModule`, and
`initialize` (DeepSpeed's entry point) picks between them.
"""
from zerojax.engine.engine import Engine, validate_tag
from zerojax.engine.entry import initialize
from zerojax.engine.pipeline import PipelineEngine

__all__ = ["Engine", "PipelineEngine", "initialize", "validate_tag"]
