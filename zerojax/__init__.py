"""zerojax: DeepSpeed's training engine as JAX shardings.

Three ways in: `python train.py --config ...`; the pure functions `plan` / `init_state` /
`make_train_step` inside your own loop; or the DeepSpeed-shaped `initialize(...)` engine.
The package is layered (docs/architecture.md): `config` -> `core` (mesh, layouts, the step) ->
`planner` (the config read once into a Plan) -> checkpoints, runtime, models -> `engine` -> tools, app.
"""
from zerojax.config import Config, load_config
from zerojax.core.collectives import gather, gathers_params
from zerojax.rewrite.gather_at_use import find_layer_axes
from zerojax.rewrite.tensor_pairs import find_tensor_splits
from zerojax.rewrite.tensor_slices import split_hint, whole_hint
from zerojax.core.layout import Plan
from zerojax.core.mesh import request_cpu_devices
from zerojax.core.sharded_init import ParamsInit, init_params
from zerojax.core.state import TrainState
from zerojax.core.step import apply_update
from zerojax.engine import Engine, initialize
from zerojax.errors import ConfigError, LossScaleError
from zerojax.models.nnx import from_nnx, to_nnx
from zerojax.pipeline import LayerSpec, PipelineModule, TiedLayerSpec
from zerojax.planner.api import init_state, make_eval_step, make_grad_fn, make_train_step
from zerojax.planner.mesh import make_mesh
from zerojax.planner.plan import make_plan, plan

__all__ = [
    "Config", "ConfigError", "Engine", "LayerSpec", "LossScaleError", "ParamsInit", "PipelineModule", "Plan",
    "TiedLayerSpec", "TrainState", "apply_update", "find_layer_axes", "find_tensor_splits", "from_nnx", "gather", "gathers_params",
    "from_hf", "init_params", "init_state", "initialize", "load_config", "load_exported", "make_eval_step", "make_grad_fn",
    "make_mesh", "make_plan", "make_train_step", "plan", "request_cpu_devices", "split_hint", "to_nnx", "whole_hint",
]
__version__ = "0.1.0"


def load_exported(path: str) -> dict:
    """Parameters from a `zerojax export` safetensors file, as a nested dict of numpy arrays."""
    from zerojax.checkpoint import load_exported as load  # orbax and safetensors load lazily
    return load(path)


def from_hf(path: str, config: Config | dict | str, *, mesh: "object | None" = None, loss_fn: "object | None" = None) -> Engine:
    """An engine that trains and generates from a local transformers checkpoint folder: what
    `initialize` returns, with the weights read into their shards and the model's decoder attached
    (`zerojax.app.trainer.from_hf`; the route train.py takes for `model.hf_checkpoint`)."""
    from zerojax.app.trainer import from_hf as build  # the app layer loads lazily
    return build(path, config, mesh=mesh, loss_fn=loss_fn)
