"""A model as a list of layers that a pipeline can cut into stages (DeepSpeed's PipelineModule).

    PipelineModule(layers=[LayerSpec(Embed, cfg), *[LayerSpec(Block, cfg)] * 8, LayerSpec(Head, cfg)],
                   loss_fn=cross_entropy, partition_method="parameters")

* `LayerSpec(typename, *args, **kwargs)` describes a Flax NNX module without building it: it is
  built with `rngs=nnx.Rngs(params=key)` only where its parameters are created (inside the stage
  that owns it, see buffers.py), and abstractly (`nnx.eval_shape`) to count parameters.
* `TiedLayerSpec(key, typename, ..., forward_fn=None)`: every spec with the same key uses ONE set
  of parameters (e.g. the token embedding and the LM head). `forward_fn(module, x)` lets a later
  use call it differently (`lambda emb, x: emb.attend(x)`). The parameters are stored once, on the
  first stage that uses them; the gradients of every use are summed into that copy.
* A plain function in the list is a layer without parameters (`lambda x: x.reshape(...)`).
* A layer whose `__call__` takes a parameter named `rng` receives a PRNG key in training (a new one for
  every step, data shard, micro-batch and layer; None in evaluation), for gates that draw noise such
  as a mixture of experts'. Evaluation runs every layer in eval mode (`module.eval()`), as DeepSpeed's
  `eval_batch` calls `module.eval()`.

Data flow: the first layer receives the micro-batch (the whole batch pytree, sliced to the
micro-batch's rows), each layer the previous layer's output (an array, or a tuple of arrays as
DeepSpeed's stages may pass: a MoE model carries its load-balancing loss beside the hidden states),
and `loss_fn(output, micro_batch)`
returns the mean loss over the micro-batch's rows. The same description runs unpipelined with
`module.loss(params, batch)`: that is the reference the pipeline must reproduce.

Logical parameters (what `init`, checkpoints' `engine.params` and the reference use) are a dict:
`"layer_07"` for layer 7's own parameters, `"tied_<key>"` for a tied group.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from zerojax.core.annotations import logical_axes
from zerojax.errors import ConfigError
from zerojax.pipeline import partition as partitioning

Forward = Callable[[Any, Any], Any]


class LayerSpec:
    """A lazily built Flax NNX layer: `typename(*module_args, rngs=..., **module_kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any):
        from flax import nnx
        if not (isinstance(typename, type) and issubclass(typename, nnx.Module)):
            raise ConfigError(f"LayerSpec: typename must be a flax.nnx.Module subclass, got {typename!r}; "
                              f"put a parameterless function directly in the layers list")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    @property
    def name(self) -> str:
        return self.typename.__name__

    def build(self, key: Any) -> Any:
        """The real module, parameters initialized from `key` (annotated ones unplaced: zerojax places
        every array itself)."""
        from flax import nnx
        with nnx.use_eager_sharding(False):
            return self.typename(*self.module_args, rngs=nnx.Rngs(params=key), **self.module_kwargs)

    @property
    def takes_rng(self) -> bool:
        """The module's `__call__` has a parameter named `rng` (it draws noise in training)."""
        try:
            return "rng" in inspect.signature(self.typename.__call__).parameters
        except (TypeError, ValueError):
            return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters are shared by every spec with the same `key`.

    `tied_weight_attr` is accepted for DeepSpeed compatibility: here every parameter of the tied
    module is shared (DeepSpeed shares only the named attributes).
    """

    def __init__(self, key: str, typename: type, *module_args: Any, forward_fn: Forward | None = None,
                 tied_weight_attr: Any = None, **module_kwargs: Any):
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise ConfigError(f"TiedLayerSpec: key must be a non-empty string, got {key!r}")
        del tied_weight_attr
        self.key, self.forward_fn = key, forward_fn


@dataclasses.dataclass(frozen=True, eq=False)
class Layer:
    """One entry of the layer list, described abstractly (nothing allocated)."""
    index: int
    name: str                        # type name: what `type:REGEX` matches and reports show
    param_key: str | None            # key of its parameters in the logical dict; None: no parameters
    spec: LayerSpec | None
    fn: Callable[..., Any] | None    # a parameterless function layer
    abstract: Any                    # ShapeDtypeStructs of its parameters ({} for functions)
    graphdef: Any = None
    axes: Any = None                 # the logical axis names its parameters were annotated with, or None

    @property
    def count(self) -> int:
        return sum(math.prod(x.shape) for x in jax.tree.leaves(self.abstract))

    @property
    def tied(self) -> bool:
        return isinstance(self.spec, TiedLayerSpec)

    def init(self, key: Any) -> Any:
        from flax import nnx
        return nnx.to_pure_dict(nnx.state(self.spec.build(key), nnx.Param))

    def __call__(self, params: Any, x: Any, rng: Any = None, deterministic: bool = False) -> Any:
        """The layer on `x`; `rng` reaches a module that takes one, `deterministic` puts it in eval mode."""
        if self.spec is None:
            return self.fn(x)
        from flax import nnx
        module = nnx.merge(self.graphdef, params)
        if deterministic:
            module.eval()
        forward = getattr(self.spec, "forward_fn", None)
        if forward is not None:
            return forward(module, x)
        return module(x, rng=rng) if self.spec.takes_rng else module(x)


def _describe(index: int, entry: Any) -> Layer:
    if isinstance(entry, LayerSpec):
        from flax import nnx
        with nnx.use_eager_sharding(False):
            model = nnx.eval_shape(lambda: entry.build(jax.random.key(0)))
        _, _, rest = nnx.split(model, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise ConfigError(f"layers[{index}] ({entry.name}): holds state other than nnx.Param "
                              f"({', '.join(sorted(str(k) for k in rest.keys()))}); pipeline layers may "
                              f"only hold parameters")
        graphdef, params = nnx.split(model)
        abstract = nnx.to_pure_dict(params)
        key = f"tied_{entry.key}" if isinstance(entry, TiedLayerSpec) else None
        return Layer(index, entry.name, key, entry, None, abstract, graphdef, logical_axes(params))
    from flax import nnx
    if callable(entry) and not isinstance(entry, (type, nnx.Module)):
        return Layer(index, getattr(entry, "__name__", type(entry).__name__), None, None, entry, {})
    raise ConfigError(f"layers[{index}]: expected a LayerSpec, TiedLayerSpec or a function, got {entry!r}; "
                      f"wrap modules as LayerSpec(ModuleClass, *args, **kwargs)")


@dataclasses.dataclass(frozen=True)
class Partition:
    """Which layers each stage runs: stage s runs layers[bounds[s]:bounds[s+1]]."""
    method: str
    bounds: tuple[int, ...]
    names: tuple[str, ...]
    counts: tuple[int, ...]       # parameters per layer (a tied layer counts at every use)
    stored: tuple[int, ...]       # parameters each stage stores (tied groups once, on the first user)

    @property
    def num_stages(self) -> int:
        return len(self.bounds) - 1

    def layers(self, stage: int) -> range:
        return range(self.bounds[stage], self.bounds[stage + 1])

    def stage_of(self, layer: int) -> int:
        return next(s for s in range(self.num_stages) if layer in self.layers(s))

    @property
    def params_per_stage(self) -> tuple[int, ...]:
        """Parameters each stage runs (what `parameters` balances)."""
        return tuple(sum(self.counts[i] for i in self.layers(s)) for s in range(self.num_stages))

    @property
    def layers_per_stage(self) -> tuple[int, ...]:
        return tuple(len(self.layers(s)) for s in range(self.num_stages))

    def table(self) -> str:
        lines = [f"pipeline partition ({self.method}, {self.num_stages} stages):",
                 f"{'stage':>5} {'layers':>9} {'count':>5} {'params run':>12} {'stored':>12}  types"]
        for s in range(self.num_stages):
            r = self.layers(s)
            kinds: dict[str, int] = {}
            for i in r:
                kinds[self.names[i]] = kinds.get(self.names[i], 0) + 1
            types = ", ".join(f"{k} x{v}" if v > 1 else k for k, v in kinds.items())
            lines.append(f"{s:>5} {f'{r.start}-{r.stop - 1}':>9} {len(r):>5} {self.params_per_stage[s]:>12,} "
                         f"{self.stored[s]:>12,}  {types}")
        return "\n".join(lines)


class PipelineModule:
    """A list of layers, a loss, and how to cut them into stages.

    num_stages: None takes `mesh.stage` from the config at `zerojax.initialize`.
    partition_method: "parameters" (default) | "uniform" | "type:REGEX" (see partition.py).
    activation_checkpoint_interval: None takes `pipeline.activation_checkpoint_interval` from the
    config; k > 0 rematerializes every k consecutive layers of a stage as one segment.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None,
                 loss_fn: Callable[[Any, Any], jax.Array] | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int | None = None):
        if not layers:
            raise ConfigError("PipelineModule: layers is empty")
        if loss_fn is None:
            raise ConfigError("PipelineModule: pass loss_fn(outputs, batch) -> mean loss of the rows")
        if num_stages is not None and (not isinstance(num_stages, int) or num_stages < 1):
            raise ConfigError(f"PipelineModule: num_stages must be a positive integer, got {num_stages!r}")
        if activation_checkpoint_interval is not None and activation_checkpoint_interval < 0:
            raise ConfigError("PipelineModule: activation_checkpoint_interval must be >= 0")
        self.specs = tuple(layers)
        self.layers = tuple(_describe(i, entry) for i, entry in enumerate(self.specs))
        self.num_stages, self.loss_fn = num_stages, loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._check_tied()
        width = max(2, len(str(len(self.layers) - 1)))
        self.layers = tuple(
            dataclasses.replace(l, param_key=l.param_key or (f"layer_{l.index:0{width}d}" if l.count else None))
            for l in self.layers)

    def _check_tied(self) -> None:
        first: dict[str, Layer] = {}
        for layer in self.layers:
            if layer.tied:
                seen = first.setdefault(layer.param_key, layer)
                if jax.tree.structure(seen.abstract) != jax.tree.structure(layer.abstract) or any(
                        a.shape != b.shape for a, b in zip(jax.tree.leaves(seen.abstract),
                                                           jax.tree.leaves(layer.abstract))):
                    raise ConfigError(f"layers[{layer.index}]: TiedLayerSpec key {layer.spec.key!r} builds "
                                      f"parameters shaped differently from layers[{seen.index}]; tied "
                                      f"layers must build the same module")

    # -- the logical (unpipelined) model ----------------------------------------------------------
    @property
    def tied_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(l.param_key for l in self.layers if l.tied))

    def first_use(self, param_key: str) -> Layer:
        return next(l for l in self.layers if l.param_key == param_key)

    def abstract_params(self) -> dict[str, Any]:
        """ShapeDtypeStructs of the logical parameters."""
        out: dict[str, Any] = {}
        for layer in self.layers:
            if layer.param_key is not None and layer.param_key not in out:
                out[layer.param_key] = layer.abstract
        return out

    def logical_axes(self) -> dict[str, Any]:
        """Per logical entry, the logical axis names its layer annotated its parameters with (a tuple per
        leaf, None for a leaf without; None for an entry without any)."""
        return {k: self.first_use(k).axes for k in self.abstract_params()}

    def init_layer(self, param_key: str, key: jax.Array) -> Any:
        """Parameters of one logical entry; the key depends on the layer index only, so the model
        is the same whatever the partition."""
        layer = self.first_use(param_key)
        return layer.init(jax.random.fold_in(key, layer.index))

    def init(self, key: jax.Array | int = 0) -> dict[str, Any]:
        """All logical parameters on one device (for references and small models)."""
        key = jax.random.key(key) if isinstance(key, int) else key
        return {k: self.init_layer(k, key) for k in self.abstract_params()}

    def run_layers(self, params: dict[str, Any], x: Any, layers: Sequence[Layer], interval: int = 0,
                   rng: Any = None, deterministic: bool = False) -> Any:
        """Apply `layers` in order; interval k > 0 rematerializes each run of k layers. A layer that takes
        an `rng` gets `rng` folded with its index (so every partition draws the same keys)."""
        def segment(chunk: Sequence[Layer]) -> Callable[[Any, Any], Any]:
            def run(p: dict[str, Any], h: Any) -> Any:
                for layer in chunk:
                    key = None if rng is None else jax.random.fold_in(rng, layer.index)
                    h = layer(p.get(layer.param_key), h, key, deterministic)
                return h
            return run

        layers = list(layers)
        step = interval if interval > 0 else len(layers) or 1
        for start in range(0, len(layers), step):
            chunk = layers[start:start + step]
            run = segment(chunk)
            if interval > 0:
                needed = {l.param_key for l in chunk if l.param_key is not None}
                x = jax.checkpoint(run)({k: params[k] for k in needed}, x)
            else:
                x = run(params, x)
        return x

    def apply(self, params: dict[str, Any], batch: Any, rng: Any = None, deterministic: bool = False) -> Any:
        """The last layer's output for `batch`, all layers in sequence (no pipeline)."""
        return self.run_layers(params, batch, self.layers, rng=rng, deterministic=deterministic)

    def loss(self, params: dict[str, Any], batch: Any, rng: Any = None, deterministic: bool = False) -> jax.Array:
        """The unpipelined loss: what every pipelined schedule reproduces."""
        return jnp.asarray(self.loss_fn(self.apply(params, batch, rng, deterministic), batch), jnp.float32)

    # -- stages -----------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def partition(self, num_stages: int | None = None) -> Partition:
        """The layers and parameters of each stage, by `partition_method`."""
        num_stages = num_stages or self.num_stages
        if num_stages is None:
            raise ConfigError("PipelineModule: num_stages is unknown; pass num_stages= or set mesh.stage")
        names = tuple(l.name for l in self.layers)
        counts = tuple(l.count for l in self.layers)
        bounds = tuple(partitioning.partition(self.partition_method, names, counts, num_stages))
        stored = [0] * num_stages
        seen: set[str] = set()
        for s in range(num_stages):
            for i in range(bounds[s], bounds[s + 1]):
                key = self.layers[i].param_key
                if key is not None and key not in seen:
                    seen.add(key)
                    stored[s] += counts[i]
        return Partition(self.partition_method, bounds, names, counts, tuple(stored))

    def __repr__(self) -> str:
        return f"PipelineModule({len(self.layers)} layers, num_stages={self.num_stages}, " \
               f"partition_method={self.partition_method!r})"
