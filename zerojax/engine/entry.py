"""DeepSpeed's `initialize`: the one entry that picks the engine for what it is given.

It sits above both engines (`Engine` for a loss over a parameter pytree, `PipelineEngine` for a
`PipelineModule`), so the pipeline builds on the engine and the engine knows nothing of pipelines.
"""
from __future__ import annotations

from typing import Any, Mapping

from jax.sharding import Mesh

from zerojax.config import Config, load_config
from zerojax.engine.engine import Engine
from zerojax.errors import ConfigError
from zerojax.planner.mesh import make_mesh
from zerojax.optim.deepspeed import ClientOptimizer, ScheduleFn
from zerojax.engine.pipeline import PipelineEngine
from zerojax.core.step import LossFn


def initialize(config: Config | Mapping[str, Any] | str, params: Any = None, loss_fn: LossFn | None = None,
               mesh: Mesh | None = None, *, model: Any = None, optimizer: ClientOptimizer | None = None,
               lr_scheduler: ScheduleFn | None = None, hidden_size: int | None = None,
               layer_axes: Any = None, decode: Any = None, tensor_dims: Any = None, trainable: Any = None) -> Engine:
    """DeepSpeed's `initialize`, returning the engine alone.

    `config` is a Config, a dict or a JSON/hjson/YAML path (DeepSpeed keys mean what they mean in
    DeepSpeed). `mesh` defaults to the config's `mesh` section (all devices on one `data` axis, or
    `stage` x `data`). For a Flax NNX model use `zerojax.from_nnx(model, loss)` to get `params` and
    `loss_fn`; `params` may be unbuilt (`zerojax.init_params(fn, ...)`, or `from_nnx` given a
    constructor such as `lambda: Model(...)`), and are then built straight into the plan's shards. For pipeline parallelism pass `model=zerojax.PipelineModule(...)` (the loss is the
    module's; `params`, if given, are initial logical parameters shaped like `model.init()`).

    `optimizer` / `lr_scheduler` are DeepSpeed's: with no optimizer section in the config, the
    optimizer passed here trains (an optax transformation, or a factory such as `optax.adamw` driven by
    `lr_scheduler`, an optax schedule, or by the config's scheduler section). `hidden_size` is the
    model's width, for the Hugging Face "auto" values derived from it. `layer_axes` is `plan`'s: the
    leading axes of each leaf that stack layers (`zerojax.find_layer_axes(loss_fn, params, batch)`
    reads them off the loss), so ZeRO-3 keeps them whole and compares the persistence threshold
    with one layer. `tensor_dims` is `plan`'s too: per leaf, the dimension a tensor axis splits where
    nothing else decides (`zerojax.find_tensor_splits(loss_fn, params, batch)` derives Megatron's pairs
    from the loss). `decode` is the model's KV-cache forward (`zerojax.models.generate.Decoder`) that
    `engine.generate` runs; `zerojax.models.decode.decoder(model_config)` is the shipped GPT's or Llama's.
    `trainable` is `plan`'s: which leaves are trained (a tree of bools, or an NNX Variable class such as
    `nnx.LoRAParam` for a model from `zerojax.from_nnx`); the others are frozen (docs/lora.md).
    """
    if model is not None:
        if loss_fn is not None:
            raise TypeError("initialize: with model= the loss is the PipelineModule's loss_fn; drop loss_fn=")
        config = load_config(config, hidden_size=hidden_size)
        if optimizer is not None or lr_scheduler is not None:
            raise TypeError("initialize: with model= (pipelines) the optimizer comes from the config's "
                            "optimizer section; drop optimizer= / lr_scheduler=")
        if layer_axes is not None or tensor_dims is not None or trainable is not None:
            raise TypeError("initialize: with model= (pipelines) each stage's row is laid out by the "
                            "PipelineModule, and none is frozen; drop layer_axes= / tensor_dims= / trainable=")
        mesh = mesh if mesh is not None else make_mesh(config)
        if config.optimizer is None:
            raise ConfigError("optimizer: the pipeline engine needs the config's optimizer section; add one "
                              'such as "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}}')
        return PipelineEngine(config, model, mesh, params)
    if params is None or loss_fn is None:
        raise TypeError("initialize: pass params= and loss_fn= (for a Flax NNX model: "
                        "params, loss_fn = zerojax.from_nnx(model, loss)), or model=PipelineModule(...)")
    config = load_config(config, hidden_size=hidden_size)
    return Engine(config, params, loss_fn, mesh if mesh is not None else make_mesh(config), optimizer=optimizer,
                  lr_scheduler=lr_scheduler, layer_axes=layer_axes, decode=decode, tensor_dims=tensor_dims,
                  trainable=trainable)
