"""Cross-key rules: values derived from others, and combinations DeepSpeed (or zerojax) refuses.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from zerojax.config.hf import TRAINING_KEYS, adapter_keys, model_keys
from zerojax.config.schema.monitoring import OP_NAMES
from zerojax.errors import ConfigError
from zerojax.config.fields import warn, warn_ignored
from zerojax.config.schema.optimizer import AdamParams, LambParams, SGDParams, ZERO_TESTED_OPTIMIZERS, base_lr
from zerojax.config.schema.root import BATCH_KEYS
from zerojax.config.schema.scheduler import OneCycleParams, WarmupLRParams
from zerojax.config.schema.zero import OffloadParamConfig

if TYPE_CHECKING:
    from zerojax.config.schema.root import Config


def derive(config: Config, sources: dict[str, str]) -> Config:
    """Fill values DeepSpeed derives from other keys, and mark them 'derived'."""
    opt = config.optimizer
    if opt is not None and isinstance(opt.params, AdamParams) and opt.params.weight_decay is None:
        torch_adamw = opt.params.torch_adam and (opt.type == "adamw" or opt.params.adam_w_mode)
        wd = 0.01 if torch_adamw else 0.0
        why = ("torch_adam: torch.optim.AdamW default" if torch_adamw else
               "torch_adam: torch.optim.Adam default" if opt.params.torch_adam else "FusedAdam default")
        opt = dataclasses.replace(opt, params=dataclasses.replace(opt.params, weight_decay=wd))
        sources["optimizer.params.weight_decay"] = f"derived ({why})"
    if opt is not None and opt.type == "adamw" and isinstance(opt.params, AdamParams):
        if sources.get("optimizer.params.adam_w_mode") and not opt.params.adam_w_mode:
            raise ConfigError("optimizer.params.adam_w_mode: false contradicts type AdamW; "
                              "use type Adam for L2-style weight decay")
    config = dataclasses.replace(config, optimizer=opt)

    sched = config.scheduler
    if sched is not None:
        p = sched.params
        if type(p) is WarmupLRParams and p.warmup_max_lr is None and config.optimizer is not None:
            # WarmupDecayLR keeps 0.001; with the optimizer from code there is no lr to default to
            p = dataclasses.replace(p, warmup_max_lr=base_lr(config.optimizer.params))
            sources["scheduler.params.warmup_max_lr"] = "derived (optimizer.params.lr)"
        if isinstance(p, OneCycleParams):
            if p.cycle_second_step_size is None:
                p = dataclasses.replace(p, cycle_second_step_size=p.cycle_first_step_size)
                sources["scheduler.params.cycle_second_step_size"] = "derived (cycle_first_step_size)"
            if p.cycle_second_stair_count is None:
                p = dataclasses.replace(p, cycle_second_stair_count=p.cycle_first_stair_count)
                sources["scheduler.params.cycle_second_stair_count"] = "derived (cycle_first_stair_count)"
        config = dataclasses.replace(config, scheduler=dataclasses.replace(sched, params=p))

    zero = config.zero_optimization
    if zero.overlap_comm is None:
        zero = dataclasses.replace(zero, overlap_comm=zero.stage == 3)
        sources["zero_optimization.overlap_comm"] = "derived (true for stage 3)"
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                     ("cpu_offload_use_pin_memory", "offload_param or offload_optimizer")):
        if getattr(zero, old) is not None:  # DeepSpeed's words (runtime/config_utils.py), then what it did
            mapped = ("not mapped: pin_memory is true by default there" if old.endswith("pin_memory") else
                      f"mapped to {new}.device: cpu" if getattr(zero, old) else "false: nothing to map")
            warn(f"zero_optimization.{old}", f"Config parameter {old} is deprecated use {new} instead; {mapped}")
    if zero.cpu_offload:
        if zero.offload_optimizer.device not in ("none", "cpu"):
            raise ConfigError("zero_optimization.cpu_offload: true contradicts offload_optimizer.device="
                              f"{zero.offload_optimizer.device}; keep only offload_optimizer")
        zero = dataclasses.replace(zero, offload_optimizer=dataclasses.replace(zero.offload_optimizer,
                                                                               device="cpu"))
        sources["zero_optimization.offload_optimizer.device"] = "derived (cpu_offload: true)"
    if zero.cpu_offload_param:
        if zero.offload_param.device not in ("none", "cpu"):
            raise ConfigError("zero_optimization.cpu_offload_param: true contradicts offload_param.device="
                              f"{zero.offload_param.device}; keep only offload_param")
        zero = dataclasses.replace(zero, offload_param=dataclasses.replace(zero.offload_param, device="cpu"))
        sources["zero_optimization.offload_param.device"] = "derived (cpu_offload_param: true)"
    if zero.offload_param.device == "nvme" and zero.stage != 3:
        # Not ignored as device cpu is: a run that asked for its parameters in files under nvme_path would
        # silently keep them on the device.
        raise ConfigError(f"zero_optimization.offload_param.device: nvme swaps ZeRO-3's parameter partitions to "
                          f"files, but zero_optimization.stage is {zero.stage}; set zero_optimization.stage: 3, "
                          f"or remove offload_param")
    if zero.offload_param.device != "none" and zero.stage != 3:
        # DeepSpeed reads offload_param only in stage 3; stages 0-2 keep parameters on the device.
        warn_ignored(sources, "zero_optimization.offload_param",
              f"ignored at stage {zero.stage}, as DeepSpeed ignores it (parameter offload is a stage-3 "
              f"feature); effect: none, parameters stay on the device; set zero_optimization.stage=3 to "
              f"offload them", f"ignored (stage {zero.stage}; DeepSpeed reads it at stage 3 only)")
        zero = dataclasses.replace(zero, offload_param=OffloadParamConfig())
    config = dataclasses.replace(config, zero_optimization=zero)

    config = _derive_lora(_derive_model(_derive_sequence(_derive_tensor(config, sources), sources), sources), sources)
    if config.run.log_every is None:
        config = dataclasses.replace(config, run=dataclasses.replace(config.run,
                                                                     log_every=config.steps_per_print))
        sources["run.log_every"] = "derived (steps_per_print)"
    return _derive_non_finite(_derive_data_source(config, sources), sources)


def _given(sources: Mapping[str, str], path: str) -> bool:
    """Whether the user wrote the key (a file, dict or override; not a default or an "auto")."""
    return not sources.get(path, "default").startswith(("default", "derived"))


def _derive_tensor(config: Config, sources: dict[str, str]) -> Config:
    """mesh.tensor from DeepSpeed's tensor_parallel.autotp_size (or the legacy tp.tp_size); sizes that
    disagree are one error naming every key. A size of 0 or 1 is DeepSpeed's "off" and asks for nothing
    (so a written-out config.json, which holds autotp_size 0 beside mesh.tensor, loads again)."""
    tp = config.tensor_parallel
    asked = {key: size for key, size in (("tensor_parallel.autotp_size", tp.autotp_size),
                                          ("tensor_parallel.tp.tp_size", tp.tp.tp_size)) if size > 1}
    if _given(sources, "mesh.tensor"):
        asked["mesh.tensor"] = config.mesh.tensor
    if len(set(asked.values())) > 1:
        named = ", ".join(f"{k}: {v}" for k, v in asked.items())
        raise ConfigError(f"{next(iter(asked))}: the tensor-parallel sizes disagree ({named}); give one size "
                          f"(mesh.tensor, or DeepSpeed's tensor_parallel.autotp_size) or the same value in each")
    if not asked or "mesh.tensor" in asked:
        return config
    key, size = next(iter(asked.items()))
    sources["mesh.tensor"] = f"derived ({key})"
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, tensor=size))


def _derive_sequence(config: Config, sources: dict[str, str]) -> Config:
    """mesh.sequence from DeepSpeed's top-level sequence_parallel_size; the two disagreeing is an error
    naming both (1 is DeepSpeed's "off" and asks for nothing)."""
    asked = config.sequence_parallel_size
    if asked == 1:
        return config
    if _given(sources, "mesh.sequence"):
        if config.mesh.sequence != asked:
            raise ConfigError(f"sequence_parallel_size: {asked}, but mesh.sequence is {config.mesh.sequence}; give "
                              f"one size (mesh.sequence, or DeepSpeed's sequence_parallel_size) or the same in both")
        return config
    sources["mesh.sequence"] = "derived (sequence_parallel_size)"
    return dataclasses.replace(config, mesh=dataclasses.replace(config.mesh, sequence=asked))


def _derive_model(config: Config, sources: dict[str, str]) -> Config:
    """Model keys not given: from `model.hf_checkpoint`'s config.json (or `model.hf_config`'s, fresh
    weights), then each family's defaults."""
    m = config.model
    if m.hf_checkpoint is not None and m.hf_config is not None:
        raise ConfigError(f"model.hf_config: {m.hf_config} given with model.hf_checkpoint {m.hf_checkpoint}, whose "
                          f"config.json already describes the model; keep model.hf_checkpoint to start from its "
                          f"weights, or model.hf_config alone for fresh ones")
    given = "model.hf_checkpoint" if m.hf_checkpoint is not None else "model.hf_config"
    if m.hf_checkpoint is not None or m.hf_config is not None:
        found, where = model_keys(m.hf_checkpoint or m.hf_config, m.seq_len if "model.seq_len" in sources else None,
                                  given)
        changes = {}
        for key, value in found.items():
            path = f"model.{key}"
            if key == "tie_embeddings" and path in sources and value and not m.tie_embeddings:
                continue  # untying a tied checkpoint: the model's own head starts as the embedding
            if key in TRAINING_KEYS and path in sources:
                continue  # a training choice (the aux loss's weight): the config's own value wins
            if path in sources and getattr(m, key) != value:
                raise ConfigError(f"{path}: {getattr(m, key)} given, but the checkpoint {given} "
                                  f"names has {value} ({where}); remove {path} from the config to take the "
                                  f"checkpoint's value, or choose a checkpoint of that size")
            if path not in sources:
                changes[key] = value
                sources[path] = f"derived ({given} {where})"
        if m.n_experts and "n_experts" not in found:
            raise ConfigError(f"model.n_experts: {m.n_experts} given, but {given}'s {where} describes a "
                              f"dense model (no num_local_experts); remove model.n_experts, or name a Mixtral "
                              f"checkpoint")
        m = dataclasses.replace(m, **changes)
    if m.d_ff is None:
        if m.name == "llama":
            d_ff, why = -(-8 * m.d_model // 3 // 64) * 64, "8/3 * d_model rounded up to a multiple of 64"
        else:
            d_ff, why = 4 * m.d_model, "4 * d_model"
        m = dataclasses.replace(m, d_ff=d_ff)
        sources["model.d_ff"] = f"derived ({why})"
    if m.n_kv_heads is None:
        m = dataclasses.replace(m, n_kv_heads=m.n_heads)
        sources["model.n_kv_heads"] = "derived (n_heads)"
    if m.norm_eps is None:
        m = dataclasses.replace(m, norm_eps=1e-5 if m.name == "llama" else 1e-6)
        sources["model.norm_eps"] = f"derived ({m.name}'s default)"
    return dataclasses.replace(config, model=m)


def _derive_lora(config: Config, sources: dict[str, str]) -> Config:
    """The `lora` section: keys not given from `lora.adapter`'s adapter_config.json (which also enables
    it), refusals that need no model, and the resolved section handed to the model config."""
    lora = config.lora
    if lora.adapter is not None:
        if config.model.hf_checkpoint is None:
            raise ConfigError("lora.adapter: a PEFT adapter goes onto its base model; name the base with "
                              "model.hf_checkpoint (the Hugging Face folder the adapter was trained on)")
        found, where = adapter_keys(lora.adapter)
        changes = {}
        for key, value in found.items():
            path = f"lora.{key}"
            if _given(sources, path) and getattr(lora, key) != value:
                raise ConfigError(f"{path}: {getattr(lora, key)} given, but lora.adapter's {where} has {value}; "
                                  f"remove {path} to take the adapter's value")
            changes[key] = value
            sources.setdefault(path, f"derived (lora.adapter {where})")
        if not lora.enabled:
            changes["enabled"] = True
            sources["lora.enabled"] = "derived (lora.adapter)"
        lora = dataclasses.replace(lora, **changes)
    if not lora.enabled:
        defaults = type(lora)()
        changed = [f.name for f in dataclasses.fields(lora) if f.name != "enabled"
                   and getattr(lora, f.name) != getattr(defaults, f.name) and _given(sources, f"lora.{f.name}")]
        if changed:  # a lora section without enabled would otherwise train the whole model, silently
            raise ConfigError(f"lora.{changed[0]}: given while lora.enabled is false, so no adapter would be added "
                              f"and every parameter trained; set lora.enabled: true, or remove the lora keys")
        return dataclasses.replace(config, lora=lora)
    if lora.lora_dropout and config.model.name != "llama":
        raise ConfigError(f"lora.lora_dropout: {lora.lora_dropout} is built for the llama model only; the "
                          f"{config.model.name} model's loss is functional and takes no random key to draw a "
                          f"dropout mask from; set lora.lora_dropout: 0 (or model.name: llama)")
    if config.mesh.stage > 1:
        raise ConfigError(f"lora.enabled: a pipeline (mesh.stage: {config.mesh.stage}) keeps its parameters as flat "
                          f"stage rows and freezes none; set mesh.stage: 1 (ZeRO-3 shards the frozen base instead)")
    if not lora.target_modules:
        raise ConfigError("lora.target_modules: empty, so no projection gets an adapter; name some (e.g. "
                          "[q_proj, v_proj]) or set lora.enabled: false")
    return dataclasses.replace(config, lora=lora, model=dataclasses.replace(config.model, lora=lora))


def _derive_non_finite(config: Config, sources: dict[str, str]) -> Config:
    """`run.non_finite: skip_step` (the default) is bf16's skip-on-overflow, for bf16 and fp32 alike. A
    config that turns DeepSpeed's `bf16.check_grad_overflow` off itself asks for DeepSpeed's behaviour
    (non-finite steps applied): `run.non_finite` then defaults to stop."""
    given_check = "bf16.check_grad_overflow" in sources
    if config.run.non_finite == "skip_step" and given_check and not config.bf16.check_grad_overflow:
        if "run.non_finite" in sources:
            raise ConfigError("run.non_finite: skip_step skips non-finite steps, but bf16.check_grad_overflow: "
                              "false asks to apply them; remove one of the two")
        sources["run.non_finite"] = "derived (bf16.check_grad_overflow: false)"
        return dataclasses.replace(config, run=dataclasses.replace(config.run, non_finite="stop"))
    if config.run.non_finite != "skip_step" or config.bf16.check_grad_overflow:
        return config
    sources["bf16.check_grad_overflow"] = "derived (run.non_finite: skip_step)"
    return dataclasses.replace(config, bf16=dataclasses.replace(config.bf16, check_grad_overflow=True))


#: data.source implied by a data.path's suffix (a folder datasets wrote: datasets; anything else: file)
_SOURCE_BY_SUFFIX = {".jsonl": "jsonl", ".bin": "tokens", ".npy": "tokens", ".parquet": "parquet", ".pq": "parquet",
                     ".arrow": "arrow", ".feather": "arrow"}


def _derive_data_source(config: Config, sources: dict[str, str]) -> Config:
    """A `data.path` means "train on this file": it implies `data.source` (by its suffix, or a folder
    `datasets` wrote) unless the source is written; a written `stdlib` next to a path would silently
    ignore the file, so that is an error. Text that needs tokenizing takes `model.hf_checkpoint`'s own
    tokenizer.json when `data.tokenizer` is not given."""
    data = config.data
    if data.path is None:
        return config
    if "data.source" not in sources:
        path = Path(data.path)
        folder = path.is_dir() and ((path / "state.json").is_file() or (path / "dataset_dict.json").is_file())
        source = "datasets" if folder else _SOURCE_BY_SUFFIX.get(path.suffix.lower(), "file")
        why = "a datasets folder" if folder else path.suffix.lower()
        sources["data.source"] = f"derived (data.path is given{f', {why}' if source != 'file' else ''})"
        data = dataclasses.replace(data, source=source)
    if data.source == "stdlib":
        raise ConfigError(f"data.path: {data.path} is given but data.source is '{data.source}', which "
                          f"ignores it; set data.source: file (or jsonl, tokens, parquet, arrow, datasets) to train "
                          f"on the file, or remove data.path")
    hf = config.model.hf_checkpoint
    needs_tokenizer = data.source in ("jsonl", "parquet", "arrow", "datasets") and data.tokens_key is None
    if data.tokenizer is None and needs_tokenizer and hf and (Path(hf) / "tokenizer.json").is_file():
        data = dataclasses.replace(data, tokenizer=str(Path(hf) / "tokenizer.json"))
        sources["data.tokenizer"] = "derived (model.hf_checkpoint's tokenizer.json)"
    return dataclasses.replace(config, data=data)


def check_rules(config: Config, sources: Mapping[str, str] | None = None) -> None:
    """Cross-key rules that need no devices."""
    if config.fp16.enabled and config.bf16.enabled:
        raise ConfigError("fp16.enabled and bf16.enabled: both true; choose one precision")
    _check_batch_keys(config, sources or {})
    if config.optimizer is not None:
        _check_optimizer(config)
    _check_sections(config)
    _check_data(config, sources or {})
    _check_engine_modes(config)


def _check_optimizer(config: Config) -> None:
    opt = config.optimizer
    if config.zero_optimization.stage > 0 and opt.type not in ZERO_TESTED_OPTIMIZERS \
            and not config.zero_allow_untested_optimizer:
        raise ConfigError(f"optimizer.type: {opt.type} is not among DeepSpeed's ZeRO-tested optimizers "
                          f"({', '.join(sorted(ZERO_TESTED_OPTIMIZERS))}); set "
                          f"zero_allow_untested_optimizer: true to use it with ZeRO stage "
                          f"{config.zero_optimization.stage}")
    if isinstance(opt.params, AdamParams) and opt.params.amsgrad:
        raise ConfigError("optimizer.params.amsgrad: not supported (DeepSpeed's fused Adam rejects it "
                          "too); remove it")
    for i, b in enumerate(getattr(opt.params, "betas", ())):
        if not 0.0 <= b < 1.0:
            raise ConfigError(f"optimizer.params.betas[{i}]: {b} must be in [0, 1)")
    if isinstance(opt.params, LambParams) and opt.params.max_grad_norm:
        raise ConfigError("optimizer.params.max_grad_norm: not supported in the optimizer (DeepSpeed "
                          "rejects it too); use the top-level gradient_clipping")
    if isinstance(opt.params, SGDParams) and opt.params.nesterov and (
            opt.params.momentum <= 0 or opt.params.dampening != 0):
        raise ConfigError("optimizer.params.nesterov: needs momentum > 0 and dampening 0 (as in torch)")
    if isinstance(opt.params, LambParams) and opt.params.min_coeff > opt.params.max_coeff:
        raise ConfigError("optimizer.params.min_coeff: larger than max_coeff; swap them")


def _check_averaging(config: Config) -> None:
    """DeepSpeed's rules for prescale_gradients / gradient_predivide_factor (see step.grad_average)."""
    zero = config.zero_optimization
    keys = [k for k, on in (("prescale_gradients", config.prescale_gradients),
                            ("gradient_predivide_factor", config.gradient_predivide_factor != 1.0)) if on]
    if not keys:
        return
    key = keys[0]
    if config.mesh.stage > 1:
        raise ConfigError(f"{key}: not built for pipeline runs (mesh.stage {config.mesh.stage}), whose "
                          f"gradients are averaged in the loss; remove it")
    if zero.stage >= 2 and zero.reduce_scatter:
        # DeepSpeed's stage_1_and_2.py / stage3.py assert the same with reduce-scatter enabled.
        raise ConfigError(f"{key}: not supported with ZeRO stage {zero.stage} and reduce_scatter (DeepSpeed "
                          f"asserts the same: its reduce-scatter divides by the data-parallel size before "
                          f"the sum); remove it, or set zero_optimization.reduce_scatter: false"
                          + (" at stage 2" if zero.stage == 3 else ""))
    if zero.stage == 3:
        raise ConfigError(f"{key}: not supported at ZeRO stage 3: the gradient reduce-scatter is the "
                          f"transpose of the parameter gather inside the backward pass, so nothing can "
                          f"run between a gradient and its sum; remove it, or use stage 2 with "
                          f"reduce_scatter: false")
    if zero.stage == 1 and zero.reduce_scatter:
        warn(key, "ignored at ZeRO stage 1 with reduce_scatter (DeepSpeed's reduce-scatter path divides by the "
                  "data-parallel size before the sum and ignores it too); set zero_optimization.reduce_scatter: "
                  "false to use it")


def _check_engine_modes(config: Config) -> None:
    """DeepSpeed's managed_gradient_accumulation and gradient_allreduce_op, where zerojax does not build
    the mode asked for (see step.grad_average for `sum`)."""
    if not config.managed_gradient_accumulation:
        raise ConfigError("managed_gradient_accumulation: false is not supported (the client calling step() at its "
                          "own accumulation boundaries): zerojax compiles gradient_accumulation_steps micro-batches "
                          "and the update into one step; remove the key, or set gradient_accumulation_steps to "
                          "the micro-batches per optimizer step")
    if config.gradient_allreduce_op != "sum":
        return
    zero = config.zero_optimization
    if zero.stage == 3:
        raise ConfigError("gradient_allreduce_op: 'sum' is not supported with ZeRO stage 3 (DeepSpeed refuses it "
                          "too: the gradient reduce-scatter runs inside the backward pass); use 'mean', or stage 2")
    if config.mesh.stage > 1:
        raise ConfigError(f"gradient_allreduce_op: 'sum' is not built for pipeline runs (mesh.stage "
                          f"{config.mesh.stage}), whose gradients are averaged in the loss; use 'mean'")
    if config.mesh.sequence > 1:
        raise ConfigError(f"gradient_allreduce_op: 'sum' is not built with a sequence axis (mesh.sequence "
                          f"{config.mesh.sequence}): DeepSpeed's sum there also runs over the sequence ranks, a "
                          f"scale zerojax does not reproduce yet; use 'mean'")


def _check_sections(config: Config) -> None:
    _check_averaging(config)
    for i, name in enumerate(config.comms_logger.prof_ops):
        if name not in OP_NAMES:
            raise ConfigError(f"comms_logger.prof_ops[{i}]: '{name}' is not a collective; use one of "
                              f"all_reduce, reduce_scatter, all_gather, all_to_all, collective_permute")
    zero = config.zero_optimization
    ac = config.activation_checkpointing
    if ac.cpu_checkpointing and ac.policy == "everything":
        raise ConfigError("activation_checkpointing.cpu_checkpointing: policy 'everything' keeps every "
                          "intermediate on the device and recomputes nothing, so there is nothing to offload; "
                          "choose policy nothing, dots_no_batch or dots, or set cpu_checkpointing: false")
    if config.mesh.stage > 1 and (ac.policy is not None or ac.cpu_checkpointing):
        key = "policy" if ac.policy is not None else "cpu_checkpointing"
        raise ConfigError(f"activation_checkpointing.{key}: not applied to pipeline stages (mesh.stage is "
                          f"{config.mesh.stage}); remove it and use pipeline.activation_checkpoint_interval, "
                          "which rematerializes runs of layers inside each stage")
    if zero.offload_optimizer.device != "none" and zero.stage == 0:
        raise ConfigError("zero_optimization.offload_optimizer.device: offload needs ZeRO stage 1, 2 or 3 "
                          "(stage is 0); set zero_optimization.stage or remove offload_optimizer")
    if zero.offload_param.device == "nvme" and config.mesh.stage > 1:
        raise ConfigError(f"zero_optimization.offload_param.device: nvme is not built for pipeline runs (mesh.stage "
                          f"{config.mesh.stage}): their step keeps each stage's parameter row on the device; use "
                          f"device cpu or none, or mesh.stage: 1")
    if zero.offload_param.device == "nvme" and not zero.offload_param.nvme_path:
        raise ConfigError("zero_optimization.offload_param.nvme_path: device nvme keeps the parameter partitions "
                          "in files; give a folder on a local disk (e.g. nvme_path: /local_nvme)")
    if zero.offload_optimizer.device == "nvme" and not zero.offload_optimizer.nvme_path:
        raise ConfigError("zero_optimization.offload_optimizer.nvme_path: device nvme keeps the optimizer state "
                          "in files; give a folder on a local disk (e.g. nvme_path: /local_nvme)")
    if config.aio.use_gds:
        raise ConfigError("aio.use_gds: GPUDirect Storage is not built (the swap files are read through host "
                          "buffers); remove it or set it to false")
    pipe = config.pipeline
    if pipe.chunks > 1 and pipe.schedule != "interleaved":
        raise ConfigError(f"pipeline.chunks: {pipe.chunks} chunks per stage need pipeline.schedule: "
                          f"interleaved (got {pipe.schedule}); set the schedule or chunks: 1")
    if pipe.schedule == "interleaved" and pipe.chunks < 2:
        raise ConfigError("pipeline.chunks: the interleaved schedule needs at least 2 chunks per stage; "
                          "set pipeline.chunks: 2 (or more)")
    sched = config.scheduler
    if sched is not None and sched.type == "OneCycle":
        p = sched.params
        if p.cycle_min_lr > p.cycle_max_lr:
            raise ConfigError("scheduler.params.cycle_min_lr: larger than cycle_max_lr; swap them")
    m = config.model
    if m.name == "gpt":
        for key, default in (("head_dim", None), ("qkv_bias", False), ("qk_norm", False), ("rope_scaling", None),
                             ("sliding_window", None), ("global_every", None), ("query_scale", None),
                             ("attn_softcap", None), ("final_softcap", None), ("norm_offset", 0.0),
                             ("embed_scale", False), ("post_norms", False), ("mlp_activation", "silu"),
                             ("hf_family", None)):
            if getattr(m, key) != default:
                raise ConfigError(f"model.{key}: {getattr(m, key)}, but the gpt model has learned positions and "
                                  f"GPT-2's fused attention; remove it, or set model.name: llama")
    if m.rope_scaling == "llama3" and m.rope_original_max_positions is None:
        raise ConfigError("model.rope_scaling: llama3 needs model.rope_original_max_positions (the pretraining "
                          "context, config.json's original_max_position_embeddings)")
    if m.rope_scaling == "llama3" and m.rope_high_freq_factor <= m.rope_low_freq_factor:
        raise ConfigError(f"model.rope_high_freq_factor: {m.rope_high_freq_factor} must exceed "
                          f"model.rope_low_freq_factor {m.rope_low_freq_factor} (llama3 interpolates between them)")
    if m.head_dim is None and m.d_model % m.n_heads:
        raise ConfigError(f"model.n_heads: {m.n_heads} does not divide model.d_model {m.d_model}; "
                          f"choose a divisor such as {next(h for h in (8, 4, 2, 1) if m.d_model % h == 0)}")
    if m.n_kv_heads is not None and m.n_heads % m.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} does not divide model.n_heads {m.n_heads}; "
                          f"each key/value head serves a whole group of query heads, so choose a divisor")
    if m.name == "gpt" and m.n_kv_heads not in (None, m.n_heads):
        raise ConfigError(f"model.n_kv_heads: {m.n_kv_heads} differs from n_heads, but the gpt model has "
                          f"plain multi-head attention; remove it, or set model.name: llama")
    if m.global_every is not None and m.n_experts:
        raise ConfigError(f"model.global_every: {m.global_every}, but the MoE llama's layers all keep "
                          f"model.sliding_window; remove model.global_every (Gemma 2's alternation is dense)")
    if m.n_experts:
        if m.name != "llama":
            raise ConfigError(f"model.n_experts: {m.n_experts} experts, but the {m.name} model has no "
                              f"mixture-of-experts layers; set model.name: llama, or remove model.n_experts")
        if m.n_layers % m.moe_every:
            raise ConfigError(f"model.moe_every: {m.moe_every} does not divide model.n_layers {m.n_layers}; the "
                              f"layers are scanned in groups of moe_every (its last one MoE), so choose a divisor")
        if m.experts_per_token > m.n_experts:
            raise ConfigError(f"model.experts_per_token: {m.experts_per_token}, but a layer has model.n_experts "
                              f"{m.n_experts} experts and each token goes to distinct ones; choose at most "
                              f"{m.n_experts}")
    if m.name == "gpt" and m.tie_embeddings and config.mesh.stage > 1:
        raise ConfigError(f"model.tie_embeddings: the pipelined gpt model (mesh.stage {config.mesh.stage}) keeps "
                          f"its own LM head on the last stage; set model.tie_embeddings: false, or mesh.stage: 1")
    if config.hybrid_engine.inference_tp_size > 1:
        raise ConfigError(f"hybrid_engine.inference_tp_size: {config.hybrid_engine.inference_tp_size}, but zerojax "
                          f"generates on the training layout (not tensor-parallel yet; ZeRO-3 shards are gathered once per "
                          f"generate call); set it to 1")
    for i, spec in enumerate(config.tensor_parallel.layer_specs):
        if not spec.patterns:
            raise ConfigError(f"tensor_parallel.partition_config.layer_specs[{i}].patterns: required (a spec without "
                              f"patterns matches no parameter); give a list of regular expressions such as "
                              f'[".*\\.o_proj\\.weight$"]')


def _check_data(config: Config, sources: Mapping[str, str]) -> None:
    """The data and loop keys that only make sense together."""
    data, run = config.data, config.run
    if data.source != "stdlib" and not data.path:
        kind = {"file": "a text file", "jsonl": "a JSONL file", "tokens": "a token file", "parquet": "a Parquet file",
                "arrow": "an Arrow file", "datasets": "a folder datasets' save_to_disk wrote"}[data.source]
        raise ConfigError(f"data.path: required when data.source is '{data.source}'; give {kind}")
    if data.source in ("jsonl", "parquet", "arrow", "datasets") and not data.tokenizer and data.tokens_key is None:
        raise ConfigError(f"data.tokenizer: data.source: {data.source} needs a tokenizer for its text (data.text_key: "
                          f"{data.text_key}); give data.tokenizer (a tokenizer.json, Hugging Face `tokenizers` "
                          f"format), a model.hf_checkpoint folder holding its tokenizer.json, or data.tokens_key "
                          f"naming a field of token ids")
    if data.source == "tokens" and data.tokenizer:
        raise ConfigError("data.tokenizer: a data.source: tokens file is already tokenized; remove "
                          "data.tokenizer (the model's vocab_size must cover its ids)")
    if data.tokens_key is not None and data.source not in ("jsonl", "parquet", "arrow", "datasets"):
        raise ConfigError(f"data.tokens_key: names a JSONL field or a table column of token ids, but data.source is "
                          f"{data.source}; set data.source to jsonl, parquet, arrow or datasets, or remove "
                          f"data.tokens_key")
    if data.packing == "pad" and (data.source == "stdlib" or (data.source == "file" and not data.tokenizer)):
        raise ConfigError(f"data.packing: pad gives each document its own row, but data.source {data.source} without "
                          f"a tokenizer is one stream of bytes; give documents (jsonl, parquet, arrow, datasets) or "
                          f"use data.packing: pack")
    if run.eval_every is not None and run.eval_batches == 0:
        raise ConfigError(f"run.eval_every: {run.eval_every}, but run.eval_batches is 0, so there is nothing to "
                          f"validate on; set run.eval_batches to 1 or more, or remove run.eval_every")


def _check_batch_keys(config: Config, sources: Mapping[str, str]) -> None:
    """The triad rules that hold for any data-parallel size: one of the two batch sizes is needed."""
    if config.train_batch_size is not None or config.train_micro_batch_size_per_gpu is not None:
        return
    auto = [k for k in BATCH_KEYS if sources.get(k) == "derived ('auto')"]
    if auto:
        raise ConfigError(f"{auto[0]}: 'auto' has nothing to be derived from; write "
                          f"train_micro_batch_size_per_gpu (rows per device per micro-step) or "
                          f"train_batch_size as a number ('auto' may stay on the others)")
    if config.gradient_accumulation_steps is not None:
        raise ConfigError("train_batch_size: gradient_accumulation_steps alone cannot fix the batch; "
                          "also give train_batch_size or train_micro_batch_size_per_gpu")
    raise ConfigError("train_batch_size: give train_batch_size or train_micro_batch_size_per_gpu")


def unsupported_features(config: Config) -> list[str]:
    """Keys that parse and validate but whose feature is not built yet: using them is an error."""
    out = []
    zero = config.zero_optimization
    if config.fp16.fp16_master_weights_and_grads:
        out.append("fp16.fp16_master_weights_and_grads: not supported; master weights stay fp32")
    if zero.offload_optimizer.device == "cpu" and zero.offload_optimizer.ratio < 1.0:
        out.append(f"zero_optimization.offload_optimizer.ratio: {zero.offload_optimizer.ratio} (partial "
                   f"offload) is not supported; use 1.0")
    if not zero.ignore_unused_parameters:
        out.append("zero_optimization.ignore_unused_parameters: false is not supported (DeepSpeed raises for a "
                   "parameter that received no gradient; JAX differentiates every parameter, giving unused ones "
                   "zero gradients, so none can be told apart); remove the key, or drop the unused parameters "
                   "from the model")
    if zero.mics_shard_size > 0:
        out.append("zero_optimization.mics_shard_size: MiCS is not supported; use -1")
    tp = config.tensor_parallel
    if tp.replace_with_kernel_inject:
        out.append("tensor_parallel.replace_with_kernel_inject: DeepSpeed's inference kernels are not built in "
                   "zerojax (XLA compiles the model's own layers); remove it or set it to false")
    if tp.partition_config.strict_mode:
        out.append("tensor_parallel.partition_config.strict_mode: not supported yet (parameters no layer spec "
                   "matches are kept whole, not reported); remove it or set it to false")
    return out


def check_supported(config: Config) -> None:
    problems = unsupported_features(config)
    if problems:
        raise ConfigError(problems[0] + (f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""))
