"""Models shipped with zerojax: the embedded byte-level GPT and a Llama (train.py's `model.name`)."""
from __future__ import annotations

from typing import Any


def abstract_params(cfg: Any) -> Any:
    """Shapes of the parameters of the model `cfg` (a ModelConfig) names, nothing allocated."""
    if cfg.name == "llama":
        from zerojax.models import llama
        return llama.build(cfg)[0].abstract
    from zerojax.models import gpt
    return gpt.abstract_params(cfg)
