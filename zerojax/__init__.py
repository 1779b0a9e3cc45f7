"""zerojax: DeepSpeed's training engine as JAX shardings.

Three ways in: `python train.py --config ...`; the pure functions `plan` / `init_state` /
`make_train_step` inside your own loop; or the DeepSpeed-shaped `initialize(...)` engine.
"""
from zerojax.collectives import gather, gathers_params
from zerojax.config import Config, load_config
from zerojax.engine import Engine
from zerojax.entry import initialize
from zerojax.errors import ConfigError, LossScaleError
from zerojax.gather_at_use import find_layer_axes
from zerojax.interop import from_nnx, to_nnx
from zerojax.layout import Plan, plan
from zerojax.mesh import make_mesh, request_cpu_devices
from zerojax.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from zerojax.sharded_init import ParamsInit, init_params
from zerojax.state import TrainState, init_state
from zerojax.step import apply_update, make_eval_step, make_grad_fn, make_train_step

__all__ = [
    "Config", "ConfigError", "Engine", "LayerSpec", "LossScaleError", "ParamsInit", "PipelineModule", "Plan",
    "TiedLayerSpec",
    "TrainState", "from_nnx", "gather", "gathers_params",
    "apply_update", "find_layer_axes", "init_params", "init_state", "initialize", "load_config", "load_exported", "make_eval_step", "make_grad_fn", "make_mesh", "make_train_step", "plan",
    "request_cpu_devices", "to_nnx",
]
__version__ = "0.1.0"


def load_exported(path: str) -> dict:
    """Parameters from a `zerojax export` safetensors file, as a nested dict of numpy arrays."""
    from zerojax.checkpoint import load_exported as load  # orbax and safetensors load lazily
    return load(path)

