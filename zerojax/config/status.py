"""What each config key does here: honoured, accepted with no effect by design, or refused.

DeepSpeed gives every key a meaning; a key that loads must either have it here, have none by design
(and say why), or be refused. `docs/config.md` prints the status next to each key, and a test walks
the schema and fails on a key without one, so a new key cannot arrive unclassified.
"""
from __future__ import annotations

HONOURED = "honoured"
NO_EFFECT = "no effect by design"
REFUSED = "refused"
KINDS = (HONOURED, NO_EFFECT, REFUSED)

_BUCKETS = f"{NO_EFFECT}: XLA schedules, fuses and overlaps the collectives itself"
_AIO = f"{NO_EFFECT}: libaio's submission setting; the swap files are read and written with preadv/pwritev from aio.thread_count threads"
_SECTION = HONOURED + " (see its keys)"
_LOG = f"{HONOURED} (the run's metrics writer)"
_GPT = f"{HONOURED} (the model that train.py and the CLI train: the embedded GPT or the Llama)"
_LLAMA = f"{HONOURED} (the Llama model, `model.name: llama`; the GPT refuses a non-default value)"
_RUN = f"{HONOURED} (train.py and `zerojax train`)"
_TP_PLAN = f"{HONOURED} (the planner's tensor-parallel layouts: which parameters split over mesh.tensor, and how)"
_SPLIT = "how a parameter is split over mesh.tensor changes the collectives XLA inserts, not the values computed"

# Dotted key -> status. The first word group is one of KINDS; what follows says how or why.
KEY_STATUS: dict[str, str] = {
    "train_batch_size": HONOURED,
    "train_micro_batch_size_per_gpu": HONOURED,
    "gradient_accumulation_steps": HONOURED,
    "managed_gradient_accumulation": HONOURED + " when true (engine(batch), backward and step queue micro-batches "
                                     "and the compiled step runs at the boundary, DeepSpeed's count); refused when "
                                     "false (the client stepping at its own boundaries)",
    "optimizer": HONOURED + " (none: the optimizer passed in code)",
    "optimizer.type": HONOURED + " (Muon included); 1-bit optimizers refused",
    "optimizer.params": _SECTION,
    "optimizer.no_decay": HONOURED + " (zerojax key; not with pipelines or the fused Pallas update)",
    "optimizer.param_groups": HONOURED + " (zerojax key; not with pipelines or the fused Pallas update)",
    "scheduler": HONOURED,
    "scheduler.type": HONOURED,
    "scheduler.params": _SECTION,
    "gradient_clipping": HONOURED,
    "fp16": _SECTION,
    "bf16": _SECTION,
    "zero_optimization": _SECTION,
    "aio": _SECTION,
    "zero_allow_untested_optimizer": HONOURED,
    "zero_force_ds_cpu_optimizer": f"{NO_EFFECT}: the offloaded update is always the configured optimizer",
    "activation_checkpointing": _SECTION,
    "data_types": _SECTION,
    "communication_data_type": HONOURED,
    "prescale_gradients": HONOURED + " at stage 0 and with reduce_scatter false; refused at stages 2-3 with "
                          "reduce_scatter and at stage 3 (as DeepSpeed asserts); pipeline runs refuse it",
    "gradient_predivide_factor": HONOURED + " where prescale_gradients is (same rules)",
    "gradient_allreduce_op": HONOURED + " (mean: the 1/dp of the mean as DeepSpeed applies it; sum: no 1/dp and "
                             "no predivide factor, at ZeRO stages 0-2); sum refused at stage 3 (as DeepSpeed), with "
                             "pipeline stages and with a sequence axis",
    "steps_per_print": HONOURED,
    "wall_clock_breakdown": HONOURED + " (data wait, dispatch, device time, logging; forward/backward/optimizer "
                            "are one compiled program)",
    "memory_breakdown": HONOURED + " (per-device memory at every print step)",
    "dump_state": HONOURED,
    "log_level": HONOURED + " (the `zerojax` Python logger's level, set when an engine starts)",
    "tensorboard": _SECTION,
    "csv_monitor": _SECTION,
    "wandb": _SECTION,
    "comet": _SECTION,
    "flops_profiler": _SECTION,
    "comms_logger": _SECTION,
    "pipeline": _SECTION,
    "hybrid_engine": _SECTION,
    "tensor_parallel": _SECTION,
    "checkpoint": _SECTION,
    "sequence_parallel_size": HONOURED + " (sets mesh.sequence; 1 means none)",
    "kernels": HONOURED,
    "mesh": _SECTION,
    "model": _SECTION,
    "lora": _SECTION,
    "data": _SECTION,
    "run": _SECTION,
    "distributed": _SECTION,
    # optimizer params (every type)
    "optimizer.params.lr": HONOURED,
    "optimizer.params.betas": HONOURED,
    "optimizer.params.eps": HONOURED,
    "optimizer.params.weight_decay": HONOURED,
    "optimizer.params.adam_w_mode": HONOURED,
    "optimizer.params.torch_adam": HONOURED + " (the weight_decay default it implies)",
    "optimizer.params.fused": f"{NO_EFFECT}: an implementation selector; XLA fuses the update either way",
    "optimizer.params.bias_correction": HONOURED,
    "optimizer.params.amsgrad": f"{REFUSED} when true (DeepSpeed's fused Adam refuses it too)",
    "optimizer.params.max_coeff": HONOURED,
    "optimizer.params.min_coeff": HONOURED,
    "optimizer.params.max_grad_norm": f"{REFUSED} when not 0 (use gradient_clipping)",
    "optimizer.params.initial_accumulator_value": HONOURED,
    "optimizer.params.momentum": HONOURED,
    "optimizer.params.dampening": HONOURED,
    "optimizer.params.nesterov": HONOURED,
    **{f"optimizer.params.{k}": HONOURED + " (Muon)" for k in ("muon_lr", "adam_lr", "ns_method")},
    # scheduler params (every type)
    **{f"scheduler.params.{k}": HONOURED for k in (
        "warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "last_batch_iteration",
        "total_num_steps", "warmup_min_ratio", "cos_min_ratio", "cycle_min_lr", "cycle_max_lr",
        "decay_lr_rate", "cycle_first_step_size", "cycle_second_step_size", "cycle_first_stair_count",
        "cycle_second_stair_count", "decay_step_size", "cycle_momentum", "cycle_min_mom", "cycle_max_mom",
        "decay_mom_rate", "lr_range_test_min_lr", "lr_range_test_step_size", "lr_range_test_step_rate",
        "lr_range_test_staircase")},
    # fp16 / bf16
    "fp16.enabled": HONOURED,
    "fp16.auto_cast": f"{NO_EFFECT}: the model decides its input dtypes (it is handed fp16 parameters)",
    "fp16.loss_scale": HONOURED,
    "fp16.initial_scale_power": HONOURED,
    "fp16.loss_scale_window": HONOURED,
    "fp16.hysteresis": HONOURED,
    "fp16.consecutive_hysteresis": HONOURED,
    "fp16.min_loss_scale": HONOURED,
    "fp16.fp16_master_weights_and_grads": f"{REFUSED} when true (master weights stay fp32)",
    "bf16.enabled": HONOURED,
    "bf16.check_grad_overflow": HONOURED,
    "bf16.immediate_grad_update": f"{NO_EFFECT}: gradients are applied once, at the accumulation boundary",
    # zero_optimization
    "zero_optimization.stage": HONOURED,
    "zero_optimization.contiguous_gradients": _BUCKETS,
    "zero_optimization.reduce_scatter": HONOURED + " (where the 1/dp of the mean is applied, as DeepSpeed; "
                                        "the collective is a reduce-scatter either way)",
    "zero_optimization.reduce_bucket_size": _BUCKETS,
    "zero_optimization.allgather_partitions": _BUCKETS,
    "zero_optimization.allgather_bucket_size": _BUCKETS,
    "zero_optimization.overlap_comm": HONOURED + " (stage 3: scanned layers prefetch the next layer's gather)",
    "zero_optimization.load_from_fp32_weights": f"{NO_EFFECT}: checkpoints always hold the fp32 master copy",
    "zero_optimization.elastic_checkpoint": f"{NO_EFFECT}: every checkpoint restores onto any mesh",
    "zero_optimization.offload_optimizer": _SECTION,
    "zero_optimization.offload_param": HONOURED + " at stage 3; ignored with a warning below it, as in DeepSpeed",
    "zero_optimization.cpu_offload": HONOURED + " (offload_optimizer.device: cpu)",
    "zero_optimization.cpu_offload_param": HONOURED + " (offload_param.device: cpu)",
    "zero_optimization.cpu_offload_use_pin_memory": f"{NO_EFFECT}: pin_memory defaults to true",
    "zero_optimization.sub_group_size": HONOURED + " with offload_optimizer.device: nvme (elements per tile the "
                                                   "optimizer streams from the files); otherwise " + _BUCKETS,
    "zero_optimization.stage3_param_persistence_threshold": HONOURED,
    "zero_optimization.stage3_prefetch_bucket_size": HONOURED + " (a layer is prefetched only if it fits; 0: off)",
    "zero_optimization.stage3_max_live_parameters": HONOURED + " (prefetch only when two layers fit)",
    "zero_optimization.stage3_max_reuse_distance": _BUCKETS,
    "zero_optimization.stage3_gather_16bit_weights_on_model_save":
        f"{NO_EFFECT}: saved and exported parameters are always whole",
    "zero_optimization.round_robin_gradients": _BUCKETS,
    "zero_optimization.ignore_unused_parameters": f"{REFUSED} when false (JAX gives unused parameters zero "
                                                  f"gradients; it cannot tell them from used ones)",
    "zero_optimization.zero_hpz_partition_size": HONOURED + " (ZeRO++ hpZ, stage 3: must equal mesh.data_inner x "
                                                            "expert x sequence; sets data_inner when no "
                                                            "data_outer/data_inner is given)",
    "zero_optimization.zero_quantized_weights": HONOURED + " (ZeRO++ qwZ, stage 3: int8 parameter gathers)",
    "zero_optimization.zero_quantized_gradients": HONOURED + " (ZeRO++ qgZ, stage 3: int4 all-to-all gradient "
                                                             "reduce-scatter)",
    "zero_optimization.mics_shard_size": f"{REFUSED} above 0 (MiCS)",
    "zero_optimization.save_muon_momentum_buffer_in_memory": f"{NO_EFFECT}: Muon's momentum always stays in memory "
                                                             f"with the other optimizer state (Muon is not "
                                                             f"elementwise, so NVMe offload refuses it)",
    "zero_optimization.offload_optimizer.device": HONOURED + " (none, cpu, nvme: ZeRO-Infinity's NVMe tier, "
                                                             "elementwise optimizers)",
    "zero_optimization.offload_optimizer.nvme_path": HONOURED + " (a fresh zerojax-swap-* subfolder per run)",
    "zero_optimization.offload_optimizer.pipeline_read": HONOURED + " (read the next tile while one updates)",
    "zero_optimization.offload_optimizer.pipeline_write": HONOURED + " (write tiles back while the next update)",
    "zero_optimization.offload_optimizer.pin_memory": HONOURED,
    "zero_optimization.offload_optimizer.buffer_count": HONOURED + " with device nvme (host buffers of "
                                                                   "sub_group_size elements)",
    "zero_optimization.offload_optimizer.fast_init": f"{NO_EFFECT}: the initial state is written to the swap "
                                                     f"files once, at start",
    "zero_optimization.offload_optimizer.ratio": HONOURED + " at 1.0; below it refused (partial offload)",
    "zero_optimization.offload_optimizer.compute": HONOURED,
    "zero_optimization.offload_param.device": HONOURED + " (none, cpu, nvme: stage 3's parameter partitions in "
                                                         "swap files between steps, on the device during the "
                                                         "step; nvme below stage 3 refused)",
    "zero_optimization.offload_param.nvme_path": HONOURED + " (a fresh zerojax-swap-* subfolder per run)",
    "zero_optimization.offload_param.pin_memory": HONOURED + " with device cpu",
    "zero_optimization.offload_param.buffer_count": HONOURED + " with device nvme (host buffers the partitions "
                                                               "stream through, read ahead and written behind)",
    "zero_optimization.offload_param.buffer_size": HONOURED + " with device nvme (elements per buffer; a larger "
                                                              "partition streams in several)",
    "zero_optimization.offload_param.max_in_cpu": HONOURED + " with device nvme (elements per device kept in host "
                                                             "memory instead of files, partitions in order)",
    "aio.block_size": _AIO,
    "aio.queue_depth": _AIO,
    "aio.thread_count": HONOURED + " (threads reading and writing the NVMe swap files, both tiers)",
    "aio.single_submit": _AIO,
    "aio.overlap_events": _AIO,
    "aio.use_gds": f"{REFUSED} when true (GPUDirect Storage is not built)",
    # activation checkpointing
    "activation_checkpointing.partition_activations":
        HONOURED + " with a tensor axis (each rematerialized layer's kept input split over mesh.tensor, gathered "
        "where the layer runs, as DeepSpeed/Megatron partition activations); no effect without one (activations "
        "are already split over the data axis)",
    "activation_checkpointing.cpu_checkpointing":
        HONOURED + " (what each checkpointed layer keeps goes to pinned_host memory; the CPU backend runs the "
        "same program with host and device one RAM); refused with pipeline stages",
    "activation_checkpointing.contiguous_memory_optimization":
        f"{NO_EFFECT}: XLA assigns every buffer at compile time, so kept activations do not fragment memory",
    "activation_checkpointing.number_checkpoints":
        f"{NO_EFFECT}: it only sizes DeepSpeed's contiguous buffers (contiguous_memory_optimization)",
    "activation_checkpointing.synchronize_checkpoint_boundary":
        f"{NO_EFFECT}: the step is one compiled program with no per-checkpoint device sync to insert",
    "activation_checkpointing.profile":
        f"{NO_EFFECT}: checkpointed layers are not separate calls to time; the benchmark reports temp memory "
        "and step time per policy",
    "activation_checkpointing.policy": HONOURED + " (zerojax key: the embedded GPT's blocks and every lax.scan "
        "body of a user's loss); refused with pipeline stages (use pipeline.activation_checkpoint_interval)",
    "data_types.grad_accum_dtype": HONOURED,
    # monitors
    **{f"{m}.{k}": _LOG for m in ("tensorboard", "csv_monitor") for k in ("enabled", "output_path", "job_name")},
    **{f"wandb.{k}": _LOG for k in ("enabled", "group", "team", "project")},
    "wandb.mode": HONOURED + " (zerojax key: wandb.init's mode)",
    **{f"comet.{k}": _LOG for k in ("enabled", "project", "workspace", "api_key", "experiment_name",
                                    "experiment_key", "online", "mode")},
    "comet.samples_log_interval": HONOURED + " (per event, in samples seen, as DeepSpeed's CometMonitor)",
    "flops_profiler.enabled": HONOURED,
    "flops_profiler.profile_step": HONOURED,
    "flops_profiler.recompute_fwd_factor": f"{NO_EFFECT}: FLOPs come from the compiled step, recomputation included",
    "flops_profiler.module_depth": HONOURED,
    "flops_profiler.top_modules": HONOURED,
    "flops_profiler.detailed": HONOURED,
    "flops_profiler.output_file": HONOURED,
    "comms_logger.enabled": HONOURED + " (counts and bytes from the compiled step's HLO; no per-op latency)",
    "comms_logger.verbose": HONOURED,
    "comms_logger.prof_all": HONOURED,
    "comms_logger.debug": HONOURED + " (names the HLO computation of each collective)",
    "comms_logger.prof_ops": HONOURED,
    # pipeline
    "hybrid_engine.enabled": f"{NO_EFFECT}: engine.generate works on every engine whose model brings a decoder "
                             f"(the shipped GPT and Llama do; decode= for your own)",
    "hybrid_engine.max_out_tokens": f"{HONOURED} (a generate call's prompt plus new tokens)",
    "hybrid_engine.inference_tp_size": f"{HONOURED} as 1; larger values are refused (generation is not "
                                       f"tensor-parallel yet)",
    "hybrid_engine.release_inference_cache": f"{NO_EFFECT}: the KV cache and gathered weights live "
                                             f"inside one generate call",
    "hybrid_engine.pin_parameters": f"{NO_EFFECT}: there is no separate inference copy of the weights",
    "hybrid_engine.tp_gather_partition_size": f"{NO_EFFECT}: weights are gathered once per call",
    "hybrid_engine.enable_cuda_graph": f"{NO_EFFECT}: generation is one compiled program (prefill and a while "
                                       f"loop of decode steps), with no per-token launches from the host to capture",
    "pipeline.stages": f"{NO_EFFECT}: mesh.stage sets the stage count",
    "pipeline.partition": HONOURED,
    "pipeline.seed_layers": f"{NO_EFFECT}: each stage's layers come from one seeded initialization",
    "pipeline.activation_checkpoint_interval": HONOURED,
    "pipeline.pipe_partitioned": f"{NO_EFFECT}: activations between stages move as whole arrays",
    "pipeline.grad_partitioned": f"{NO_EFFECT}: activation gradients between stages move as whole arrays",
    "pipeline.schedule": HONOURED,
    "pipeline.chunks": HONOURED,
    # tensor_parallel (DeepSpeed's AutoTP training config)
    "tensor_parallel.autotp_size": HONOURED + " (sets mesh.tensor; 0 and 1 mean none)",
    "tensor_parallel.tp": _SECTION,
    "tensor_parallel.tp.tp_size": HONOURED + " (1, or the same as autotp_size, as DeepSpeed checks; alone it sets "
                                  "mesh.tensor, as tp_model_init's size)",
    "tensor_parallel.tp.tp_grain_size": f"{NO_EFFECT}: shards are even splits; {_SPLIT}",
    "tensor_parallel.partition_config": _SECTION,
    "tensor_parallel.partition_config.use_default_specs": _TP_PLAN,
    "tensor_parallel.partition_config.layer_specs": _TP_PLAN,
    "tensor_parallel.partition_config.layer_specs[].patterns": _TP_PLAN,
    "tensor_parallel.partition_config.layer_specs[].partition_type": _TP_PLAN,
    **{f"tensor_parallel.partition_config.layer_specs[].{k}": f"{NO_EFFECT}: {_SPLIT}"
       for k in ("shape", "partition_dim", "model_types")},
    "tensor_parallel.partition_config.layer_specs[].gather_output":
        f"{NO_EFFECT}: XLA gathers a split output wherever a later operation needs it whole",
    "tensor_parallel.partition_config.layer_specs[].grad_allreduce":
        f"{NO_EFFECT}: the step differentiates the whole program, so a whole parameter's gradient is already "
        "summed over the tensor group",
    "tensor_parallel.partition_config.tp_size": f"{NO_EFFECT}: DeepSpeed replaces it with autotp_size",
    "tensor_parallel.partition_config.embedding_partition_dim": f"{NO_EFFECT}: {_SPLIT}",
    "tensor_parallel.partition_config.lm_head_patterns": f"{NO_EFFECT}: {_SPLIT}",
    "tensor_parallel.partition_config.strict_mode": f"{REFUSED} when true (not built yet)",
    "tensor_parallel.preset_model": _TP_PLAN,
    "tensor_parallel.dtype": f"{NO_EFFECT}: the model's dtype comes from bf16 / fp16, as DeepSpeed's engine trains "
                             "in those",
    "tensor_parallel.tp_overlap_comm": _BUCKETS,
    "tensor_parallel.keep_module_on_host": f"{NO_EFFECT}: checkpoints are read slice by slice into each device's "
                                           "shards",
    "tensor_parallel.replace_with_kernel_inject": f"{REFUSED} when true (DeepSpeed's inference kernels)",
    # checkpoint
    "checkpoint.tag_validation": HONOURED + " (a tag passed to save_checkpoint is compared with process 0's)",
    "checkpoint.load_universal": f"{NO_EFFECT}: every checkpoint is universal",
    "checkpoint.use_node_local_storage": f"{NO_EFFECT}: each process writes its own shards wherever the path is",
    "checkpoint.async_save": HONOURED,
    "checkpoint.max_to_keep": HONOURED,
    "checkpoint.keep_every_n_steps": HONOURED,
    # zerojax's own sections
    "mesh.data": HONOURED,
    "mesh.stage": HONOURED,
    "mesh.expert": HONOURED + " (expert parallelism: weights annotated with the logical axis `expert`, as the MoE "
                              "Llama's experts, split over it; see docs/moe.md)",
    "mesh.data_outer": HONOURED,
    "mesh.data_inner": HONOURED,
    "mesh.tensor": HONOURED,
    "mesh.sequence": HONOURED + " (the shipped Llama, and a model that follows docs/sequence_parallel.md)",
    "mesh.logical_axis_rules": _TP_PLAN,
    "mesh.cpu_devices": HONOURED,
    **{f"model.{k}": _GPT for k in ("name", "vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "d_ff",
                                    "remat", "init_std", "norm_eps", "attention", "attention_block")},
    **{f"model.{k}": _LLAMA for k in ("n_kv_heads", "head_dim", "qkv_bias", "qk_norm", "sliding_window", "rope_scaling", "rope_factor",
                                      "rope_low_freq_factor", "rope_high_freq_factor",
                                      "rope_original_max_positions", "global_every", "query_scale",
                                      "attn_softcap", "final_softcap", "norm_offset", "embed_scale", "post_norms",
                                      "mlp_activation", "hf_family")},
    **{f"model.{k}": f"{HONOURED} (zerojax key: frozen parameters have no gradient, master or optimizer state; "
                     f"not with pipelines; see docs/lora.md)" for k in ("trainable", "frozen")},
    "model.tie_embeddings": f"{HONOURED} (gpt and llama: no head parameter, the logits use the token embedding)",
    "model.rope_theta": f"{HONOURED} (the Llama model's rotary embeddings; the GPT has learned positions)",
    "model.hf_config": f"{HONOURED} (the model keys it implies; fresh weights; `zerojax estimate` reads it too)",
    "model.hf_checkpoint": f"{HONOURED} (train.py, `zerojax train` and `zerojax.from_hf`: the run starts from the "
                           f"checkpoint's weights, read into the plan's shards)",
    **{f"model.{k}": f"{HONOURED} (the Llama's mixture-of-experts layers, zerojax.models.moe; the GPT refuses "
                     f"model.n_experts)"
       for k in ("n_experts", "experts_per_token", "gating", "moe_every", "capacity_factor",
                 "eval_capacity_factor", "min_capacity", "drop_tokens", "use_rts", "noisy_gate_policy",
                 "top2_2nd_expert_sampling", "use_residual", "moe_aux_loss_coef")},
    **{f"lora.{k}": f"{HONOURED} (zerojax key: adapters on the shipped GPT and Llama and Hugging Face imports, "
                    f"the base frozen; see docs/lora.md)" for k in ("enabled", "r", "lora_alpha", "target_modules")},
    "lora.lora_dropout": f"{HONOURED} (llama: on the adapter's input, in training only); {REFUSED} above 0 for "
                         f"the gpt model (its functional loss takes no random key)",
    "lora.adapter": f"{HONOURED} (a PEFT adapter folder read onto model.hf_checkpoint's base)",
    "lora.base_weight_sharding": f"{NO_EFFECT}: ZeRO-3 shards the frozen base with every other weight",
    "model.expert_tensor_parallelism": f"{HONOURED} (the Llama's MoE layers and the tensor plan: false keeps "
                                       f"every leaf annotated `expert` whole over mesh.tensor)",
    **{f"data.{k}": _RUN for k in ("source", "path", "max_bytes", "val_fraction", "seed", "dtype", "tokenizer",
                                   "text_key", "eos_id", "mask_boundaries", "tokens_key", "packing", "pad_id",
                                   "split", "val_split", "val_path")},
    **{f"run.{k}": _RUN for k in ("steps", "output_dir", "seed", "eval_batches", "progress", "log_every",
                                  "checkpoint_dir", "save_every", "non_finite", "non_finite_limit", "signal_save_seconds",
                                  "sample_tokens", "compile_cache", "eval_every", "save_best", "epochs")},
    **{f"distributed.{k}": HONOURED for k in ("coordinator_address", "num_processes", "process_id", "join",
                                              "initialization_timeout", "check_consistency", "hang_timeout")},
}


_ONE_BIT = f"{REFUSED}: a parameter of the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb), which are out of scope"

# DeepSpeed's documented keys that are neither schema keys (KEY_STATUS) nor DeepSpeed-only keys
# (zerojax.config.foreign.FOREIGN_KEYS, which covers everything inside a section too): the parameters of
# optimizer types zerojax refuses, refused with their type.
OTHER_KEY_STATUS: dict[str, str] = {
    **{f"optimizer.params.{k}": _ONE_BIT for k in (
        "freeze_step", "cuda_aware", "comm_backend_name", "var_freeze_step", "var_update_scaler",
        "local_step_scaler", "local_step_clipper", "coeff_beta", "factor_max", "factor_min", "factor_threshold")},
}


def status(path: str) -> str:
    """The status of a dotted key; KeyError for a key without one."""
    return KEY_STATUS[path]
