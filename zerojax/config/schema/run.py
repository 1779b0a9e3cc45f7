"""zerojax's job sections: the `model`, the `data`, the `run` loop and `checkpoint` saving.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from zerojax.config.fields import option
from zerojax.config.paths import show
from zerojax.errors import ConfigError


def parse_compile_cache(value: object, path: str) -> Optional[str]:
    """`run.compile_cache`: "auto", a folder, or false / null / "none" (off)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("none", "false", "off")):
        return None
    if value is True:
        return "auto"
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise ConfigError(f'{path}: expected "auto", a folder, or false to turn the compilation cache off, got {show(value)}')


@dataclass(frozen=True)
class CheckpointConfig:
    """Checkpointing: DeepSpeed's keys plus retention and async saving."""
    tag_validation: str = option("Warn", "A tag passed to save_checkpoint must be the same on every process: "
                                         "Ignore | Warn | Fail.", choices=("Ignore", "Warn", "Fail"))
    load_universal: bool = option(False, "Accepted; every checkpoint is universal.")
    use_node_local_storage: bool = option(False, "Accepted, unused.")
    async_save: bool = option(False, "Write checkpoints in the background (a save returns before it is "
                                     "durable; finished at exit).")
    max_to_keep: Optional[int] = option(None, "Keep at most this many checkpoints of this run (None: all); "
                                              "another run's tags and folders zerojax did not write are never "
                                              "deleted.", gt=0)
    keep_every_n_steps: Optional[int] = option(None, "Also keep every checkpoint at a multiple of this step.",
                                               gt=0)


@dataclass(frozen=True)
class ModelConfig:
    """The model train.py builds: the embedded byte-level GPT, or a Llama-family model."""
    name: str = option("gpt", "Model family: gpt (learned positions, LayerNorm, GELU; GPT-2's shape) or llama "
                              "(RMSNorm, rotary positions, SwiGLU, grouped-query attention).",
                       choices=("gpt", "llama"))
    vocab_size: int = option(256, "Vocabulary (256: bytes).", gt=0)
    seq_len: int = option(128, "Context length in tokens.", gt=0)
    d_model: int = option(128, "Width.", gt=0)
    n_layers: int = option(4, "Transformer blocks (stacked and scanned).", gt=0)
    n_heads: int = option(4, "Attention heads; must divide d_model.", gt=0)
    d_ff: Optional[int] = option(None, "MLP width (default: 4 * d_model for gpt; for llama 8/3 * d_model "
                                       "rounded up to a multiple of 64).", gt=0)
    remat: bool = option(True, "Rematerialize each block in the backward pass (keeping its input only); "
                                "activation_checkpointing.policy or cpu_checkpointing, when set, decide instead.")
    init_std: float = option(0.02, "Std of the normal initializer.", gt=0)
    attention: str = option("auto", "Causal attention's form. dense: the [heads, T, T] scores materialized (memory "
                                    "quadratic in T). blockwise: an online softmax over model.attention_block tiles "
                                    "of queries and keys, rematerialized in the backward pass (memory linear in T, "
                                    "the same arithmetic), for long rows and Ulysses sequence parallelism; see "
                                    "docs/sequence_parallel.md. fused: jax.nn.dot_product_attention, cuDNN's flash "
                                    "attention on a GPU (bf16/fp16, head width <= 128), XLA's dense form elsewhere. "
                                    "auto: cuDNN's flash attention where it applies, else blockwise when the attended "
                                    "sequence is longer than model.attention_block, else dense. A soft-capped or "
                                    "per-layer-windowed attention (Gemma) never takes the fused form.",
                            choices=("auto", "dense", "blockwise", "fused"))
    attention_block: int = option(512, "Tokens per query and key tile of the blockwise attention (a length it "
                                       "does not divide is padded); with model.attention: auto, the longest "
                                       "sequence attended densely.", gt=0)
    n_kv_heads: Optional[int] = option(None, "llama: key/value heads of grouped-query attention; must divide "
                                             "n_heads (default: n_heads, plain multi-head attention).", gt=0)
    rope_theta: float = option(10000.0, "llama: base of the rotary position embedding frequencies.", gt=0)
    head_dim: Optional[int] = option(None, "llama: width of each attention head (default: d_model / n_heads); "
                                           "Qwen3's is independent of d_model and n_heads.", gt=0)
    qkv_bias: bool = option(False, "llama: the query, key and value projections have biases (Qwen2's; the "
                                   "output projection has none).")
    qk_norm: bool = option(False, "llama: an RMSNorm over each head's queries and keys (one [head_dim] scale "
                                  "each), before the rotary embedding (Qwen3's).")
    sliding_window: Optional[int] = option(None, "llama: each query attends to the last sliding_window positions "
                                                 "only (itself included), in training (dense and blockwise "
                                                 "attention) and generation (Mistral's). Unset: the whole causal "
                                                 "context.", gt=0)
    rope_scaling: Optional[str] = option(None, "llama: rotary frequency scaling. linear: every frequency divided "
                                               "by model.rope_factor (position interpolation). llama3: Llama "
                                               "3.1's, low frequencies divided by rope_factor, high ones kept, "
                                               "the band between interpolated (rope_low_freq_factor, "
                                               "rope_high_freq_factor, rope_original_max_positions). Unset: none.",
                                         choices=("linear", "llama3"))
    rope_factor: float = option(1.0, "llama, with model.rope_scaling: the scaling factor.", gt=0)
    rope_low_freq_factor: float = option(1.0, "llama, rope_scaling llama3: wavelengths longer than "
                                              "rope_original_max_positions / this are scaled fully.", gt=0)
    rope_high_freq_factor: float = option(4.0, "llama, rope_scaling llama3: wavelengths shorter than "
                                               "rope_original_max_positions / this are kept.", gt=0)
    rope_original_max_positions: Optional[int] = option(None, "llama, rope_scaling llama3: the context length "
                                                              "the model was pretrained at (original_max_position_"
                                                              "embeddings).", gt=0)
    global_every: Optional[int] = option(None, "llama, with model.sliding_window: every global_every-th layer "
                                               "(counted from 1) attends to the whole causal context, the others "
                                               "to the window (Gemma 2's alternation: 2; Gemma 3's: 6). Unset: "
                                               "every layer keeps the window.", gt=0)
    query_scale: Optional[float] = option(None, "llama: attention scores are scaled by query_scale ** -0.5 "
                                                "(Gemma's query_pre_attn_scalar). Unset: the head width's.", gt=0)
    attn_softcap: Optional[float] = option(None, "llama: attention scores soft-capped to (-c, c) as c * "
                                                 "tanh(score / c) before the mask and softmax (Gemma 2's "
                                                 "attn_logit_softcapping). Unset: none.", gt=0)
    final_softcap: Optional[float] = option(None, "llama: logits soft-capped as c * tanh(logit / c) (Gemma 2's "
                                                  "final_logit_softcapping). Unset: none.", gt=0)
    norm_offset: float = option(0.0, "llama: every RMSNorm multiplies by (norm_offset + scale): Gemma's 1, its "
                                     "scales stored around 0 (and initialized to 0).", ge=0)
    embed_scale: bool = option(False, "llama: the token embeddings are multiplied by sqrt(d_model) before the "
                                      "first layer (Gemma's).")
    post_norms: bool = option(False, "llama: an RMSNorm on the attention's and the MLP's outputs before each "
                                     "residual add, besides the ones on their inputs (Gemma 2/3's).")
    mlp_activation: str = option("silu", "llama: the gated MLP's activation. silu: SwiGLU (Llama's). gelu_tanh: "
                                         "GeGLU with the tanh-approximated GELU (Gemma's gelu_pytorch_tanh).",
                                 choices=("silu", "gelu_tanh"))
    hf_family: Optional[str] = option(None, "llama: the Hugging Face model_type the model is read and written "
                                            "as (model.hf_checkpoint sets it; export --format hf writes it). Unset: "
                                            "the one its options name (docs/models.md). phi3 stores q/k/v and "
                                            "gate/up as fused tensors.",
                                      choices=("llama", "mistral", "qwen2", "qwen3", "gemma2", "phi3", "mixtral",
                                               "qwen3_moe"))
    norm_eps: Optional[float] = option(None, "Epsilon of the norms (default: 1e-6 for gpt, 1e-5 for llama; "
                                             "GPT-2 uses 1e-5).", gt=0)
    tie_embeddings: bool = option(False, "The LM head is the transposed token embedding (no head parameter), "
                                         "as GPT-2 and tied Llama checkpoints have it (model.hf_checkpoint fills "
                                         "it from config.json's tie_word_embeddings).")
    hf_checkpoint: Optional[str] = option(
        None, "A local Hugging Face transformers checkpoint folder (config.json + safetensors, sharded or "
              "not; Llama-family, Qwen2, Qwen3, Mistral, Mixtral or GPT-2: docs/models.md) to start from: its weights are read straight into the plan's "
              "shards, and model keys not given are taken from its config.json.")
    hf_config: Optional[str] = option(
        None, "A Hugging Face config.json (or the folder holding one) whose model the run builds with fresh "
              "weights - pre-training, or a test with no checkpoint: the model keys not given are taken from it "
              "as model.hf_checkpoint takes them, and no weight is read; `zerojax estimate` reads the same file. "
              "Not with model.hf_checkpoint (whose config.json is the model already).")
    n_experts: Optional[int] = option(
        None, "llama: experts per mixture-of-experts layer (DeepSpeed's MoE num_experts); unset or 0: the dense "
              "model. The MLP of every model.moe_every-th layer becomes a MoE layer; see docs/moe.md.", ge=0)
    experts_per_token: int = option(1, "llama MoE: experts each token is routed to (DeepSpeed's k), at most "
                                       "model.n_experts: 1 (top-1, Switch), 2 (top-2, GShard) or more "
                                       "(DeepSpeed's top-k gate, which keeps an over-full expert's most "
                                       "probable tokens).", ge=1)
    gating: str = option("auto", "llama MoE: the gate function. auto: DeepSpeed's TopKGate choice by "
                                 "model.experts_per_token (top1gating, top2gating, topkgating from 3). topk: "
                                 "DeepSpeed's topkgating for every k (the kept weights renormalized to one: at "
                                 "k 1 a kept token's weight is 1, not its probability; no RSample, RTS or "
                                 "second-expert sampling); model.hf_checkpoint of a Mixtral routing to one "
                                 "expert sets it.", choices=("auto", "topk"))
    moe_every: int = option(1, "llama MoE: every moe_every-th layer is a MoE layer (Megatron-DeepSpeed's "
                               "expert_interval; 2: every other layer, the first one dense); must divide "
                               "n_layers.", gt=0)
    capacity_factor: float = option(1.0, "llama MoE: token slots per expert in training, as a multiple of "
                                         "k x tokens / experts (k: model.experts_per_token); at least "
                                         "model.min_capacity.",
                                    gt=0)
    eval_capacity_factor: float = option(1.0, "llama MoE: capacity_factor in evaluation and generation.", gt=0)
    min_capacity: int = option(4, "llama MoE: the fewest token slots per expert, whatever the capacity factor.",
                               ge=0)
    drop_tokens: bool = option(True, "llama MoE: tokens routed past an expert's capacity are dropped (the "
                                     "layer passes them through the residual only); false: no token is dropped "
                                     "(every expert gets room for every token).")
    use_rts: bool = option(True, "llama MoE, top-1: Random Token Selection, an expert over capacity keeps a "
                                 "random choice of its tokens (in training), not its first ones.")
    noisy_gate_policy: Optional[str] = option(
        None, "llama MoE, in training: Jitter (the router's input times uniform(0.99, 1.01)) or RSample (top-1: "
              "the expert chosen on logits plus Gumbel noise); unset: none.", choices=("Jitter", "RSample"))
    top2_2nd_expert_sampling: bool = option(True, "llama MoE, top-2, in training: the second expert chosen on "
                                                  "logits plus Gumbel noise (DeepSpeed's default).")
    use_residual: bool = option(False, "llama MoE: PR-MoE (Residual MoE), a dense MLP beside the experts, the two "
                                       "mixed per token by a learned softmax coefficient.")
    expert_tensor_parallelism: bool = option(
        True, "llama MoE, with mesh.tensor above 1: true slices each expert's MLP over the tensor axis as the "
              "dense MLP is (DeepSpeed's MoE(enable_expert_tensor_parallelism=True)); false keeps each expert "
              "whole on every tensor device, which then sends only its 1/mesh.tensor of the dispatched "
              "capacity through the experts and gathers the results back - DeepSpeed's default "
              "(enable_expert_tensor_parallelism=False), which this mode is. No effect without a tensor axis.")
    trainable: tuple[str, ...] = option((), "Parameters trained, by name pattern (zerojax key; the patterns of "
                                            "optimizer.no_decay: a word matches a part of the dotted name, a "
                                            "pattern with * ? [ the whole name): every other parameter is frozen. "
                                            "Empty: every parameter is trained (unless model.frozen). See "
                                            "docs/lora.md.")
    frozen: tuple[str, ...] = option((), "Parameters frozen, by name pattern (zerojax key; as model.trainable): "
                                         "no gradient, no fp32 master, no optimizer state; stored in the compute "
                                         "dtype, ZeRO-3-sharded like any weight. Applied after model.trainable. "
                                         "See docs/lora.md.")
    moe_aux_loss_coef: float = option(0.01, "llama MoE: the training loss adds this times the MoE layers' summed "
                                            "load-balancing loss (l_aux); model.hf_checkpoint of a Mixtral "
                                            "fills it from router_aux_loss_coef unless given.", ge=0)
    # The resolved `lora` section when it is enabled (set by the loader, not a key): the models read
    # their adapters' rank, scale and targets from the model config they are built from.
    lora: Any = field(default=None, metadata=dict(internal=True))


# DeepSpeed's LoRAConfig.target_mods default (deepspeed/linear/config.py): Llama 3.1's projections.
LORA_DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters (LoRA) on the model's projections, the base frozen; see docs/lora.md."""
    enabled: bool = option(False, "Add a trainable low-rank adapter (A [in, r], B [r, out], B starting at zero) "
                                  "beside each projection lora.target_modules names; every other parameter is "
                                  "frozen (model.trainable adds parameters to train with the adapters).")
    r: int = option(8, "The adapters' rank (PEFT's r; DeepSpeed's LoRAConfig.lora_r).", gt=0,
                    aliases=("lora_r",))
    lora_alpha: float = option(16.0, "The adapter's output is scaled by lora_alpha / r (PEFT's and DeepSpeed's "
                                     "lora_alpha).", gt=0, aliases=("alpha",))
    lora_dropout: float = option(0.0, "Dropout on the adapter's input only, the base path untouched (PEFT's "
                                      "lora_dropout): active in training, off in evaluation and generation. Each "
                                      "step, data shard and micro-batch draws its own masks from run.seed. Built "
                                      "for the llama model; above 0 with the gpt model it is refused (its "
                                      "functional loss takes no random key).", ge=0, le=1, aliases=("dropout",))
    target_modules: tuple[str, ...] = option(
        LORA_DEFAULT_TARGETS, "The projections given adapters, by module name: the models' own (llama: q k v o "
                              "gate up down; gpt: qkv proj fc out), Hugging Face's (q_proj ... down_proj; GPT-2's "
                              "c_attn c_fc attn.c_proj mlp.c_proj) or all-linear. Default: DeepSpeed's "
                              "LoRAConfig.target_mods. A name that matches no projection is an error.",
        aliases=("target_mods",))
    adapter: Optional[str] = option(None, "A PEFT LoRA adapter folder (adapter_config.json + "
                                          "adapter_model.safetensors) to start the adapters from, onto "
                                          "model.hf_checkpoint's base; its r, lora_alpha and target_modules "
                                          "fill the keys not given.")
    base_weight_sharding: int = option(1, "DeepSpeed's LoRAConfig.base_weight_sharding; no effect: the frozen base "
                                          "is ZeRO-3-sharded with every other weight at stage 3.", gt=0)


@dataclass(frozen=True)
class DataConfig:
    """Training data: the embedded corpus (Python's standard library source), a text or JSONL file, or a token file."""
    source: str = option("stdlib", "stdlib: the embedded corpus, as bytes. file: a text file (bytes, or tokens "
                                   "with data.tokenizer). jsonl: one JSON document a line, tokenized with "
                                   "data.tokenizer. tokens: a flat array of token ids (nanoGPT/Megatron .bin), "
                                   "memory-mapped, or a 1-D integer .npy. parquet, arrow: a Parquet file, an Arrow "
                                   "IPC file or stream, a document a row (data.text_key or data.tokens_key names "
                                   "the column). datasets: a folder Hugging Face datasets' save_to_disk wrote "
                                   "(a Dataset, or a DatasetDict and data.split), read with pyarrow (the datasets "
                                   "package is not needed). Default with data.path: jsonl for *.jsonl, tokens for "
                                   "*.bin and *.npy, parquet for *.parquet, arrow for *.arrow and *.feather, "
                                   "datasets for a folder holding state.json or dataset_dict.json, else file. A "
                                   "binary file (Parquet, Arrow, zip, gzip, ...; by its first bytes or its name) or "
                                   "text that is not UTF-8 is refused as a text or JSONL file.",
                         choices=("stdlib", "file", "jsonl", "tokens", "parquet", "arrow", "datasets"))
    path: Optional[str] = option(None, "The file (or datasets folder) to train on (implies data.source, see "
                                       "there).")
    max_bytes: int = option(4_000_000, "Read at most this many bytes of a text corpus (stdlib, file, jsonl).",
                            gt=0)
    val_fraction: float = option(0.05, "Fraction held out for validation (the end of the token stream).",
                                 gt=0, le=0.5)
    seed: int = option(0, "Seed of the batch order.")
    dtype: str = option("uint16", "Element type of a data.source: tokens file (uint16 for vocabularies up to "
                                  "65536, else uint32).", choices=("uint16", "uint32"))
    tokenizer: Optional[str] = option(None, "A Hugging Face `tokenizers` tokenizer.json that tokenizes the text "
                                            "of text, JSONL, Parquet, Arrow and datasets sources (default: the "
                                            "tokenizer.json of model.hf_checkpoint, when that folder has one "
                                            "and the text needs tokenizing).")
    text_key: str = option("text", "The field of each JSONL line, or the column of a Parquet, Arrow or datasets "
                                   "source, that holds the document's text.")
    tokens_key: Optional[str] = option(None, "The field of each JSONL line, or the column of a Parquet, Arrow or "
                                             "datasets source, that holds the document's token ids (a list of "
                                             "integers), used as they are: no tokenizer (data.eos_id, when given, "
                                             "is appended to each). Unset: the text of data.text_key is "
                                             "tokenized.")
    packing: str = option("pack", "How documents become rows. pack: end to end with data.eos_id between them, "
                                  "cut into windows of model.seq_len + 1 (no loss across a boundary, "
                                  "data.mask_boundaries). pad: one document a row, cut at model.seq_len + 1 "
                                  "tokens and padded with data.pad_id, the padding left out of the loss (a "
                                  "fine-tuning set of separate examples).", choices=("pack", "pad"))
    pad_id: Optional[int] = option(None, "data.packing: pad: the id that fills a row after its document (default: "
                                         "the end-of-document id, else 0); never in the loss.", ge=0)
    split: str = option("train", "data.source: datasets: the split of a DatasetDict folder to train on.")
    val_split: Optional[str] = option(None, "data.source: datasets: the split of a DatasetDict folder to validate on "
                                            "(default: its validation split when it has one, else the last "
                                            "data.val_fraction of data.split).")
    val_path: Optional[str] = option(None, "A validation file (or datasets folder) read as data.path is (same "
                                           "data.source, keys and tokenizer); default: the last data.val_fraction "
                                           "of data.path.")
    eos_id: Optional[int] = option(None, "Token id that ends each document: appended after every tokenized "
                                         "document, and where the loss stops (default: the tokenizer's "
                                         "end-of-text token; none for a tokens file: give it to mask its "
                                         "document boundaries).", ge=0)
    mask_boundaries: bool = option(True, "Packed windows: no loss for predicting a document's first token "
                                         "from the previous document's end (needs an eos_id).")


@dataclass(frozen=True)
class RunConfig:
    """The training job run by train.py."""
    steps: int = option(200, "Optimizer steps to run.", gt=0)
    output_dir: str = option("runs/zerojax", "Where metrics.jsonl and config.json are written.")
    seed: int = option(0, "Seed of the parameter initialization.")
    eval_batches: int = option(4, "Validation batches evaluated at the end (and every run.eval_every steps): "
                                  "the first ones of the validation set, the same each time.", ge=0)
    eval_every: Optional[int] = option(None, "Steps between validations during the run (run.eval_batches batches "
                                             "each; a val_loss row in metrics.jsonl and a Train/Samples/val_loss "
                                             "event); null: only at the end.", gt=0)
    save_best: bool = option(True, "With run.eval_every: a validation loss lower than every earlier one saves a "
                                   "checkpoint of that step (if none is saved there) and points the checkpoint "
                                   "folder's .best file at it; retention (checkpoint.max_to_keep) never deletes the "
                                   "tag it names. `--tag best` exports or samples it.")
    epochs: Optional[float] = option(None, "Passes over the training data: run.steps becomes epochs x rows an epoch "
                                           "/ train_batch_size, rounded up (rows an epoch: the windows of a packed "
                                           "corpus, the documents of a padded one), and run.steps is not used. "
                                           "Batches run on across an epoch's end (each epoch reshuffled).", gt=0)
    progress: bool = option(True, "Show a progress bar.")
    log_every: Optional[int] = option(None, "Steps between metrics lines (default: steps_per_print).", gt=0)
    checkpoint_dir: Optional[str] = option(
        None, "Where checkpoints go (default: <output_dir>/checkpoints of this run).")
    save_every: Optional[int] = option(None, "Steps between checkpoints (a final one is always saved; "
                                             "null: only the final one).", gt=0)
    non_finite: str = option("skip_step", "A non-finite loss or gradient in a bf16/fp32 run (on every path: train.py, "
                                          "the engine and the library step). skip_step: the update is skipped and "
                                          "counted in skipped_steps, as fp16 skips overflows (sets "
                                          "bf16.check_grad_overflow); after run.non_finite_limit consecutive ones "
                                          "training stops, naming the step and the first non-finite leaf. stop: "
                                          "the update is applied (DeepSpeed's bf16 default) and training stops at "
                                          "the next check (train.py: when metrics are fetched; the engine: at the "
                                          "next train_batch), saving nothing past it.",
                             choices=("stop", "skip_step"))
    non_finite_limit: int = option(8, "With run.non_finite: skip_step, consecutive skipped non-finite steps after "
                                      "which training stops (train.py exits 1; engine.train_batch raises "
                                      "NonFiniteError); 0: never.", ge=0)
    signal_save_seconds: int = option(120, "On SIGINT, SIGTERM or SIGUSR1: at most this many seconds to save a "
                                           "checkpoint before the run exits (130, 143, 138).", gt=0)
    compile_cache: Optional[str] = option(
        "auto", "Where JAX's persistent compilation cache keeps the run's compiled programs, so a second run or "
                "a resume with the same shapes starts without compiling. auto: JAX_COMPILATION_CACHE_DIR when the "
                "environment sets it, else $XDG_CACHE_HOME/zerojax/jax (~/.cache/zerojax/jax); a path: there; "
                "false or null: off.", parse=parse_compile_cache)
    sample_tokens: int = option(48, "Tokens of text generated from the trained model and printed at the end of "
                                    "the run (one process; the embedded GPT or the Llama); 0: none. `zerojax sample` makes "
                                    "more.", ge=0)
