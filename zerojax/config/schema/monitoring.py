"""What a run reports: `tensorboard`, `csv_monitor`, `wandb`, `comet`, `flops_profiler`, `comms_logger`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from zerojax.config.fields import option

# The HLO names of the collectives (zerojax.measure.hlo reads them from compiled steps).
COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")
# DeepSpeed's comms logger names ops after torch.distributed calls; each maps to one HLO kind.
OP_NAMES = {
    "all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce", "inference_all_reduce": "all-reduce",
    "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
    "reduce_scatter_fn": "reduce-scatter", "reduce_scatter_coalesced": "reduce-scatter",
    "all_gather": "all-gather", "all_gather_into_tensor": "all-gather", "allgather_fn": "all-gather",
    "all_gather_coalesced": "all-gather",
    "all_to_all": "all-to-all", "all_to_all_single": "all-to-all",
    "collective_permute": "collective-permute", "send": "collective-permute", "recv": "collective-permute",
    **{kind: kind for kind in COLLECTIVE_KINDS},
}



@dataclass(frozen=True)
class MonitorConfig:
    """A metrics writer (TensorBoard or CSV)."""
    enabled: bool = option(False, "Write Train/Samples/* events.")
    output_path: str = option("", "Directory (default: the run's output_dir).")
    job_name: str = option("DeepSpeedJobName", "Sub-directory per job.")


@dataclass(frozen=True)
class WandbConfig:
    """Weights & Biases: the other monitors' Train/Samples/* events, logged to a wandb run.

    Needs `pip install 'zerojax[wandb]'`. Offline, the run folder is written for `wandb sync`."""
    enabled: bool = option(False, "Log to wandb.")
    group: Optional[str] = option(None, "wandb group.")
    team: Optional[str] = option(None, "wandb entity.")
    project: str = option("deepspeed", "wandb project.")
    mode: Optional[str] = option(None, "zerojax key: online or offline (offline: no network, the run folder "
                                       "is uploaded later with `wandb sync`); default: WANDB_MODE, else "
                                       "online.", choices=("online", "offline"))


@dataclass(frozen=True)
class CometConfig:
    """Comet: the other monitors' Train/Samples/* events, logged to a Comet experiment (DeepSpeed's
    CometMonitor, `comet_ml.start` with these keys).

    Needs `pip install 'zerojax[comet]'`. Offline, an archive is written for `comet upload`."""
    enabled: bool = option(False, "Log to Comet.")
    samples_log_interval: int = option(100, "Log an event again only once this many samples have passed since "
                                            "it was last logged (the first value of each is always logged).",
                                       ge=1)
    project: Optional[str] = option(None, "Comet project; default: COMET_PROJECT_NAME or .comet.config.")
    workspace: Optional[str] = option(None, "Comet workspace; default: COMET_WORKSPACE or .comet.config.")
    api_key: Optional[str] = option(None, "Comet API key; default: COMET_API_KEY or .comet.config (prefer "
                                          "those: the config is saved with the run).")
    experiment_name: Optional[str] = option(None, "The experiment's name.")
    experiment_key: Optional[str] = option(None, "The experiment's key (32 to 50 letters and digits): with "
                                                 "mode get or get_or_create, logging continues in it.")
    online: Optional[bool] = option(None, "false: no network, the experiment is written as an archive "
                                          "(under COMET_OFFLINE_DIRECTORY, else <output_dir>/comet) for "
                                          "`comet upload`; default: comet_ml's (online).")
    mode: Optional[str] = option(None, "get (continue experiment_key), create (always a new experiment) or "
                                       "get_or_create; default: comet_ml's (get_or_create).",
                                 choices=("get", "create", "get_or_create"))


@dataclass(frozen=True)
class FlopsProfilerConfig:
    """FLOPs profiler: the compiled step's FLOPs by module of the model (from the call stacks XLA keeps
    with each instruction), its latency and TFLOPS."""
    enabled: bool = option(False, "Print the profile once at profile_step.")
    recompute_fwd_factor: float = option(0.0, "Accepted, unused.")
    profile_step: int = option(1, "Step at which to profile.", ge=1)
    module_depth: int = option(-1, "Deepest call level shown, in the module tree and in the parameter counts "
                                   "by path (-1: all).", ge=-1)
    top_modules: int = option(1, "Modules with the most FLOPs listed at each depth.", ge=1)
    detailed: bool = option(True, "Also print the whole module tree with each module's FLOPs.")
    output_file: Optional[str] = option(None, "Write the profile here instead of stdout.")


@dataclass(frozen=True)
class CommsLoggerConfig:
    """DeepSpeed's communication logger: the train step's collectives, counted from its compiled HLO.

    Count and bytes per device per step; no per-op latency, as they run inside one program."""
    enabled: bool = option(False, "Print the step's collectives at the first print step and totals at "
                                  "the end of the run.")
    verbose: bool = option(False, "Also list every collective (kind, dtype, bytes, group, runs per step).")
    prof_all: bool = option(True, "Report every collective; false: only those named in prof_ops.")
    debug: bool = option(False, "With verbose: also name the HLO computation each collective sits in.")
    prof_ops: tuple[str, ...] = option((), "With prof_all false: the collectives to report (all_reduce, "
                                 "reduce_scatter, all_gather, all_to_all, collective_permute; DeepSpeed's "
                                 "torch names such as all_gather_into_tensor are accepted).")
