"""How the work is spread: the device `mesh`, the `pipeline` and `tensor_parallel` sections and
multi-process `distributed`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Optional

from zerojax.config.fields import option, section
from zerojax.config.paths import show
from zerojax.errors import ConfigError

# The mesh axes a logical axis may map to (`data` is the whole data axis, hierarchical or not).
RULE_AXES = ("tensor", "data", "stage")


class AxisRules(Mapping[str, Optional[str]]):
    """`mesh.logical_axis_rules`: logical axis name -> mesh axis (None: replicated), in the order given.
    Immutable and hashable, so the config stays a frozen value; `dict(rules)` is the plain mapping."""

    def __init__(self, pairs: Any = ()) -> None:
        self._pairs = tuple((str(k), v) for k, v in (pairs.items() if isinstance(pairs, Mapping) else pairs))
        self._map = dict(self._pairs)

    def __getitem__(self, key: str) -> Optional[str]:
        return self._map[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def __hash__(self) -> int:
        return hash(frozenset(self._map.items()))

    def __repr__(self) -> str:
        return f"AxisRules({self._map!r})"


def parse_axis_rules(value: Any, path: str) -> AxisRules:
    """A mapping {logical: axis or null}, or Flax's list of [logical, axis] pairs, checked."""
    if value is None:
        return AxisRules()
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in value):
        pairs = [tuple(p) for p in value]
    else:
        raise ConfigError(f"{path}: expected a mapping from logical axis names to a mesh axis, e.g. "
                          f'{{"embed": null, "mlp": "tensor"}}, got {show(value)}')
    seen: set[str] = set()
    for name, axis in pairs:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{path}: logical axis names are non-empty strings, got {show(name)}")
        if name in seen:
            raise ConfigError(f"{path}.{name}: given twice; keep one mesh axis per logical axis")
        seen.add(name)
        if axis is not None and axis not in RULE_AXES:
            raise ConfigError(f"{path}.{name}: {show(axis)} is not a mesh axis; use one of "
                              f"{', '.join(RULE_AXES)}, or null to keep it replicated")
    return AxisRules(pairs)


@dataclass(frozen=True)
class HybridEngineConfig:
    """DeepSpeed's hybrid engine (train and generate in one engine, for RLHF). zerojax's engine always
    generates on its training weights (`engine.generate`); these keys say how."""
    enabled: bool = option(False, "Accepted: engine.generate works on every engine whose model brings a decoder.")
    max_out_tokens: int = option(512, "Prompt plus new tokens one generate call may hold (the KV cache's length "
                                      "bound): a longer request is one error naming both numbers.", gt=0)
    inference_tp_size: int = option(1, "Tensor-parallel degree of generation: 1 (generation runs on the "
                                       "training layout; ZeRO-3 shards are gathered once per call).", ge=1)
    release_inference_cache: bool = option(False, "Accepted: the KV cache and the gathered weights live only "
                                                  "inside one generate call, so they are always released.")
    pin_parameters: bool = option(True, "Accepted: there is no separate inference copy of the weights to pin.")
    tp_gather_partition_size: int = option(8, "Accepted: weights are gathered once per call, whole.", ge=1)
    enable_cuda_graph: bool = option(False, "Accepted: generation is already one compiled program (prefill and a "
                                            "while loop of decode steps), with no per-token kernel launches "
                                            "from the host to capture.")


@dataclass(frozen=True)
class PipelineConfig:
    """DeepSpeed's pipeline section; the stage count comes from mesh.stage."""
    stages: str = option("auto", "Accepted; set mesh.stage instead.")
    partition: str = option("best", "How train.py cuts the embedded GPT: parameters | uniform | type:REGEX "
                                    "('best' means parameters); see PipelineModule.partition_method.")
    seed_layers: bool = option(False, "Accepted, unused.")
    activation_checkpoint_interval: int = option(
        0, "Layers per rematerialized segment inside a stage's backward (0: none); a PipelineModule's "
           "own activation_checkpoint_interval wins.", ge=0)
    pipe_partitioned: bool = option(True, "Accepted, unused.")
    grad_partitioned: bool = option(True, "Accepted, unused.")
    schedule: str = option("1f1b", "Micro-batch schedule: 1f1b (DeepSpeed's TrainSchedule: at most S "
                                   "micro-batches in flight), gpipe, 1f1b_sync (a forward and a backward per "
                                   "tick in the steady state: no lockstep idling, up to 2S-1 in flight), or "
                                   "interleaved (1F1B over `chunks` model chunks per stage).",
                           choices=("1f1b", "gpipe", "1f1b_sync", "interleaved"))
    chunks: int = option(1, "Model chunks per stage; more than 1 needs schedule: interleaved.", gt=0)


@dataclass(frozen=True)
class MeshConfig:
    """Device mesh: a `data` axis (ZeRO shards over it; optionally data_outer x data_inner), a `stage`
    axis (pipeline), a `tensor` axis (tensor parallelism), an `expert` axis (expert parallelism) and a
    `sequence` axis (Ulysses sequence parallelism)."""
    data: Optional[int] = option(None, "Data-parallel size (default: all devices / (stage x sequence x tensor)).",
                                 gt=0)
    stage: int = option(1, "Pipeline stages (more than 1 needs a PipelineModule: "
                           "initialize(config, model=...)).", gt=0)
    data_outer: Optional[int] = option(None, "Split the data axis into data_outer (across hosts or slices: slow "
                                             "links) x data_inner (within one: fast links); ZeRO shards over "
                                             "both. The expert, sequence and tensor axes sit inside data_inner, "
                                             "within a host. With several processes or slices it must equal "
                                             "their number. null: one flat data axis.", gt=0)
    data_inner: Optional[int] = option(None, "Devices per data_outer group along the data axis (default: "
                                             "data-parallel devices / expert / data_outer); setting it alone "
                                             "also splits the data axis.", gt=0)
    tensor: int = option(1, "Tensor-parallel size (Megatron-style tensor slicing): the mesh is stage x data x "
                            "expert x sequence x tensor (axes of size 1 left out), tensor innermost, so one tensor "
                            "group is consecutive devices (the fastest links). DeepSpeed's "
                            "tensor_parallel.autotp_size sets it.", gt=0)
    expert: int = option(1, "Expert-parallel size (DeepSpeed's MoE ep_size, one size for every MoE layer): the "
                            "data-parallel devices are data x expert, the batch split over both; the MoE layers' "
                            "expert weights are split over the expert axis (each device holds n_experts / expert "
                            "of them) and ZeRO-sharded over the other data-parallel axes (data, and sequence with "
                            "one), with two all-to-alls around the experts; with a tensor axis each expert's MLP is "
                            "sliced over it too. It must divide the data-parallel size and model.n_experts.", gt=0)
    sequence: int = option(1, "Sequence-parallel size (DeepSpeed-Ulysses): each row's tokens are split over a "
                              "`sequence` axis between data (and expert) and tensor; attention all-to-alls heads "
                              "for tokens (each tensor slice's own heads with a tensor axis), and ZeRO shards over "
                              "every data-parallel axis, sequence included. DeepSpeed's sequence_parallel_size sets "
                              "it.",
                           gt=0)
    logical_axis_rules: AxisRules = option(
        factory=AxisRules, doc="Logical axis name (as a model annotates its parameters, e.g. "
        "nnx.with_partitioning(init, (\"embed\", \"mlp\"))) -> mesh axis: tensor, data, stage, or null "
        "(replicated), as Flax's and MaxText's logical axis rules; a mapping or a list of [name, axis] pairs.",
        parse=parse_axis_rules)
    cpu_devices: Optional[int] = option(8, "On a CPU-only machine, this many virtual devices for the job, "
                                           "split evenly over the processes of a multi-process run (set "
                                           "before JAX starts; null leaves JAX's default).", gt=0)

    def data_parallel(self, n_devices: int) -> int:
        """The data-parallel size on `n_devices`: mesh.data, else every device stage x sequence x tensor
        leave over (the size the batch triad counts)."""
        return self.data or n_devices // (self.stage * self.sequence * self.tensor)


@dataclass(frozen=True)
class DistributedConfig:
    """Multi-process start-up through jax.distributed (see docs/distributed.md)."""
    coordinator_address: Optional[str] = option(
        None, "host:port of process 0 (default: ZEROJAX_COORDINATOR_ADDRESS, MASTER_ADDR:MASTER_PORT, "
              "or the cluster's).")
    num_processes: Optional[int] = option(None, "Number of processes (default: ZEROJAX_NUM_PROCESSES, "
                                                "WORLD_SIZE, or the cluster's).", gt=0)
    process_id: Optional[int] = option(None, "This process's id (default: ZEROJAX_PROCESS_ID, RANK, "
                                             "or the cluster's).", ge=0)
    join: str = option("auto", "auto: join when coordinates are given or a launcher is detected (zerojax "
                               "launch, SLURM srun, Open MPI mpirun, a Kubernetes indexed Job, a multi-host "
                               "Cloud TPU slice); always: call jax.distributed.initialize and let JAX detect "
                               "the rest; never: run as one process.", choices=("auto", "always", "never"))
    initialization_timeout: int = option(300, "Seconds to wait for every process to join.", gt=0)
    check_consistency: bool = option(True, "Check before anything compiles that every process holds the same "
                                           "config, model structure and plan (through jax.distributed's "
                                           "key-value store, no collective): a mismatch is refused on every "
                                           "process, naming the keys and processes; false: skip it (the step "
                                           "programs are still compared before the first step).")
    hang_timeout: Optional[float] = option(
        300.0, "Seconds without progress (a step, save or evaluation finishing) after which train.py dumps "
               "every process's Python stack and fails (the first step, which compiles, gets 3x; "
               "ZEROJAX_HANG_TIMEOUT or zerojax launch --hang-timeout override it; null or 0: off).", ge=0)


# DeepSpeed's AutoTP (deepspeed/module_inject/autotp_config.py: PartitionType, AutoTPPresets).
PARTITION_TYPES = ("row", "column", "skip")
AUTOTP_PRESETS = ("llama", "bloom", "chatglm", "mixtral", "deepseek_v2", "qwen2", "phi3")


def parse_patterns(value: Any, path: str) -> tuple[str, ...]:
    """A non-empty list of regular expressions, each compiled once here so a typo fails at load."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(p, str) and p for p in value):
        raise ConfigError(f"{path}: expected a non-empty list of regular expressions matched against parameter "
                          f'names, e.g. [".*\\\\.o_proj\\\\.weight$"], got {show(value)}')
    for i, pattern in enumerate(value):
        try:
            re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"{path}[{i}]: {show(pattern)} is not a regular expression ({e}); fix the "
                              f"pattern (Python's re syntax, as DeepSpeed matches it)") from None
    return tuple(value)


def parse_shape(value: Any, path: str) -> Optional[tuple]:
    """AutoTP's logical shape: integers (-1: inferred), with at most one nested list of sizes."""
    bad = ConfigError(f"{path}: expected a list of positive integers or -1, with at most one nested list of "
                      f"sizes (e.g. [2, -1] or [[4096, 1024, 1024], -1]), got {show(value)}")

    def size(v: Any, nested: bool) -> Any:
        if isinstance(v, (list, tuple)) and v and not nested:
            return tuple(size(x, True) for x in v)
        if isinstance(v, int) and not isinstance(v, bool) and (v > 0 or (v == -1 and not nested)):
            return v
        raise bad

    if value is None:
        return None
    if not isinstance(value, (list, tuple)) or not value:
        raise bad
    return tuple(size(v, False) for v in value)


@dataclass(frozen=True)
class LayerSpec:
    """One AutoTP layer spec (DeepSpeed's TPLayerSpec): the parameters whose names match and how they split."""
    patterns: tuple[str, ...] = option((), "Regular expressions matched (re.match) against parameter names; "
                                           "required.", parse=parse_patterns)
    partition_type: str = option("column", "column: split the output dimension; row: split the input "
                                           "dimension; skip: keep the parameter whole (replicated).",
                                 choices=PARTITION_TYPES)
    shape: Optional[tuple] = option(None, "Logical shape of a fused parameter (e.g. [2, -1] for gate_up_proj), "
                                          "so each rank holds its part of every sub-parameter.", parse=parse_shape)
    partition_dim: Optional[int] = option(None, "Dimension split after the reshape (default: 0 for column, 1 "
                                                "for row).", ge=0)
    model_types: Optional[tuple[str, ...]] = option(None, "Apply the spec only to these model types.")
    gather_output: bool = option(False, "Column split whose output every rank receives whole (an untied LM "
                                        "head).")
    grad_allreduce: bool = option(False, "Skip spec whose gradient is summed over the tensor group (Qwen3's "
                                         "q_norm/k_norm).")


@dataclass(frozen=True)
class PartitionConfig:
    """AutoTP's custom partitioning (DeepSpeed's partition_config): layer specs by parameter-name pattern."""
    use_default_specs: bool = option(True, "Merge layer_specs with the preset's (preset_model) instead of "
                                           "replacing them.")
    layer_specs: tuple[LayerSpec, ...] = option((), "Layer specs, first match wins: {patterns, partition_type, "
                                                    "shape, partition_dim, model_types, gather_output, "
                                                    "grad_allreduce}; see the table below.")
    tp_size: int = option(1, "Accepted: DeepSpeed replaces it with tensor_parallel.autotp_size.", ge=1)
    embedding_partition_dim: int = option(1, "Dimension of the embedding that is split (1: the hidden "
                                             "dimension).", ge=0)
    lm_head_patterns: tuple[str, ...] = option(("lm_head", "embed_out"), "Names of the LM head layers.")
    strict_mode: bool = option(False, "Fail when a linear layer matches no spec (not supported).")


@dataclass(frozen=True)
class TPConfig:
    """DeepSpeed's legacy `tensor_parallel.tp` block (TPConfig): the size, as tp_model_init writes it."""
    tp_size: int = option(1, "Tensor-parallel size; 1 or the same as autotp_size (DeepSpeed's check). Alone "
                             "it sets mesh.tensor.", ge=1)
    tp_grain_size: int = option(1, "Granularity of uneven MLP / LM-head shards.", ge=1)


@dataclass(frozen=True)
class TensorParallelConfig:
    """DeepSpeed's AutoTP training section: the tensor-parallel size (mesh.tensor) and which layers split how."""
    autotp_size: int = option(0, "Tensor-parallel size (0 or 1: off); sets mesh.tensor.", ge=0)
    tp: TPConfig = option(factory=TPConfig, doc="DeepSpeed's legacy tp block.", aliases=("tensor_parallel",))
    partition_config: PartitionConfig = section(PartitionConfig)
    preset_model: Optional[str] = option(None, "A built-in AutoTP preset: which layers of that architecture "
                                               "split how.", choices=AUTOTP_PRESETS)
    dtype: Optional[str] = option(None, "Accepted: the model's dtype comes from bf16 / fp16 (a JSON config "
                                        "cannot name a torch.dtype).")
    tp_overlap_comm: bool = option(False, "Accepted: XLA overlaps the tensor-parallel collectives itself.")
    keep_module_on_host: bool = option(False, "Accepted: checkpoints are read slice by slice into each "
                                              "device's shards.")
    replace_with_kernel_inject: bool = option(False, "DeepSpeed's inference kernels (not supported).",
                                              aliases=("kernel_inject",))

    @property
    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """partition_config.layer_specs, where the planner reads them."""
        return self.partition_config.layer_specs

    @property
    def use_default_specs(self) -> bool:
        return self.partition_config.use_default_specs
