"""A Hugging Face checkpoint's config.json read as `model.*` keys.

Part of loading a config: `model.hf_checkpoint` fills the model keys it implies (the weights are read
later, by `zerojax.models.hf`). Only config.json is opened here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Mapping

from zerojax.errors import ConfigError

__all__ = ["HFError", "TRAINING_KEYS", "model_keys", "read_config_json"]


class HFError(ConfigError):
    """A Hugging Face checkpoint folder that cannot be read as the config's model."""


def read_config_json(directory: str | os.PathLike[str], key: str = "model.hf_checkpoint") -> tuple[Path, dict[str, Any]]:
    """The folder and the parsed config.json of a checkpoint folder; for `model.hf_config` the file itself
    may be given."""
    root = Path(directory).expanduser()
    if key != "model.hf_checkpoint" and root.is_file():
        try:
            return root.parent, json.loads(root.read_text())
        except json.JSONDecodeError as e:
            raise HFError(f"{key}: {root} is not valid JSON ({e})") from None
    if key != "model.hf_checkpoint" and not root.is_dir():
        raise HFError(f"{key}: {root} not found; give a transformers config.json (or the folder holding one)")
    if not root.is_dir():
        raise HFError(f"model.hf_checkpoint: {root} is not a folder; give a local transformers checkpoint "
                      f"folder (config.json and model.safetensors, as save_pretrained writes)")
    path = root / "config.json"
    if not path.is_file():
        raise HFError(f"model.hf_checkpoint: {path} not found; a transformers checkpoint folder has a "
                      f"config.json next to its safetensors (save_pretrained writes both)")
    try:
        return root, json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"model.hf_checkpoint: {path} is not valid JSON ({e})") from None


# Rotary scalings that change the frequencies by position or per sequence length, and where zerojax stands.
_ROPE_REFUSED = {
    "dynamic": "dynamic NTK scaling recomputes the frequencies from each sequence's length past "
               "max_position_embeddings",
    "yarn": "YaRN rescales the frequencies and the attention temperature",
    "longrope": "LongRoPE keeps per-frequency factor tables and switches them by sequence length",
}


def _rope_keys(hf: Mapping[str, Any], where: str, default: float) -> dict[str, Any]:
    """rope_theta and the rotary scaling keys of a config.json: `rope_scaling` (config.json as published,
    e.g. Llama 3.2's {"rope_type": "llama3", "factor": 32.0, ...}) or transformers 5's `rope_parameters`
    (which also carries rope_theta). default, linear and llama3 are the model's; others are refused."""
    params, scaling = hf.get("rope_parameters") or {}, hf.get("rope_scaling") or {}
    rope = {**params, **scaling}
    kinds = [k for k in (scaling.get("rope_type"), scaling.get("type"), params.get("rope_type")) if k]
    kind = next((k for k in kinds if k != "default"), "default")
    keys: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", default))),
                            "rope_scaling": None}
    if kind in _ROPE_REFUSED or kind not in ("default", "linear", "llama3"):
        why = _ROPE_REFUSED.get(kind, "it is not a scaling the llama model implements")
        raise HFError(f"model.hf_checkpoint: {where} asks for rope scaling {kind!r} ({why}); the llama model "
                      f"computes rope_type default, linear and llama3 (Llama 3.1/3.2's) exactly - use such a "
                      f"checkpoint")
    partial = rope.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    if float(rope.get("attention_factor") or 1.0) != 1.0 or float(partial) != 1.0:
        raise HFError(f"model.hf_checkpoint: {where} scales the attention (attention_factor) or rotates part of each "
                      f"head (partial_rotary_factor), which the llama model does not; use a checkpoint without them")
    if kind == "default":
        return keys

    def need(name: str) -> Any:
        if rope.get(name) is None:
            raise HFError(f"model.hf_checkpoint: {where} asks for rope scaling {kind} without its {name}")
        return rope[name]

    keys.update(rope_scaling=kind, rope_factor=float(need("factor")))
    if kind == "llama3":
        keys.update(rope_low_freq_factor=float(need("low_freq_factor")),
                    rope_high_freq_factor=float(need("high_freq_factor")),
                    rope_original_max_positions=int(need("original_max_position_embeddings")))
    return keys


# The llama-family model types: each one's options on the llama model, and its config class's
# defaults (transformers' LlamaConfig, Qwen2Config, ...) where config.json leaves a key out.
_GEMMA2 = {"norm_offset": 1.0, "embed_scale": True, "post_norms": True, "mlp_activation": "gelu_tanh"}
FAMILIES: dict[str, dict[str, Any]] = {
    "llama": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": False, "qk_norm": False},
    "qwen2": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": True, "qk_norm": False},
    "qwen3": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": False, "qk_norm": True},
    "mistral": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": False, "qk_norm": False},
    "phi3": {"rope_theta": 1e4, "rms_norm_eps": 1e-5, "qkv_bias": False, "qk_norm": False},
    "gemma2": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": False, "qk_norm": False, "tie": True,
               "options": _GEMMA2},
    "mixtral": {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "qkv_bias": False, "qk_norm": False},
    "qwen3_moe": {"rope_theta": 1e4, "rms_norm_eps": 1e-6, "qkv_bias": False, "qk_norm": True},
}
# The model types whose config.json's sliding_window every layer honours (MistralConfig's default 4096
# where the key is missing; null in Mistral v0.3 and Mixtral: the whole causal context; Phi3Config's
# None, Phi-3-mini-4k's config.json 2047). Gemma 2's window is its local layers' (Gemma2Config: 4096).
_SLIDING = {"mistral": 4096, "mixtral": None, "phi3": None, "gemma2": 4096}

# Model types people ask for that are not computed here, and the nearest that is.
_NEAREST = {"gemma": "gemma2", "gemma3": "gemma2", "gemma3_text": "gemma2", "olmo2": "qwen3",
            "qwen2_moe": "qwen3_moe", "deepseek_v3": "qwen3_moe", "gpt_neox": "llama", "phi": "phi3",
            "phimoe": "mixtral", "cohere": "llama", "granite": "llama", "starcoder2": "mistral"}


# The model keys a checkpoint's config.json only suggests: training choices that leave the forward as
# transformers computes it, so a config that gives its own value keeps it.
TRAINING_KEYS = frozenset({"moe_aux_loss_coef"})


def _mixtral_keys(hf: Mapping[str, Any], where: str, need: Callable[..., Any],
                  refuse: Callable[..., None], experts: tuple[str, ...] = ("num_local_experts",)) -> dict[str, Any]:
    """The MoE keys of a Mixtral config.json: every layer a mixture of `num_local_experts` SwiGLU experts.

    transformers' Mixtral routes each token to the top `num_experts_per_tok` of softmax(router logits)
    and renormalizes those weights to sum to one, dropping no token. With no token dropped and no
    noise, DeepSpeed's gates compute exactly that: its top-2 gate for k = 2, its top-k gate for k >= 3.
    Its top-1 gate keeps the raw softmax weight where Mixtral's is 1, so k = 1 takes the top-k gate
    (`gating: topk`, DeepSpeed's `topkgating` with k = 1), which renormalizes the one weight to 1.
    Qwen3-MoE routes as Mixtral does where norm_topk_prob is true (its published checkpoints); `experts`:
    the config.json key of the expert count (Qwen3-MoE's num_experts)."""
    refuse("router_jitter_noise", (0, 0.0), "transformers jitters the experts' input as well as the router's "
                                            "in training, which DeepSpeed's Jitter policy does not; use 0")
    n_experts = int(need(*experts))
    k = hf.get("num_experts_per_tok")
    k = 2 if k is None else int(k)  # MixtralConfig's default
    if not 1 <= k <= n_experts:
        raise HFError(f"model.hf_checkpoint: {where} has num_experts_per_tok: {k}; a token is routed to between "
                      f"1 and {experts[0]} ({n_experts}) experts")
    keys = {"n_experts": n_experts, "experts_per_token": k, "moe_every": 1, "use_residual": False,
            "drop_tokens": False, "noisy_gate_policy": None, "top2_2nd_expert_sampling": False,
            "moe_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001))}
    if k == 1:  # the one gate whose choice changes the forward (k >= 2: both choices compute Mixtral's)
        keys["gating"] = "topk"
    return keys


def _gemma2_keys(hf: Mapping[str, Any], where: str, keys: Mapping[str, Any],
                 refuse: Callable[..., None]) -> dict[str, Any]:
    """Gemma 2's switches on the llama model: scores scaled by query_pre_attn_scalar ** -0.5 and
    soft-capped, logits soft-capped (Gemma2Config's defaults 256, 50 and 30 where config.json leaves them
    out), and layer i (from 0) local (sliding_window) when i is even, global when odd: transformers'
    layer_types default, the one alternation `model.global_every: 2` computes."""
    refuse("use_bidirectional_attention", (False,), "the llama model is a causal decoder")
    n = int(keys["n_layers"])
    pattern = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    types = hf.get("layer_types") or pattern
    if keys.get("sliding_window") is not None and list(types) != pattern:
        raise HFError(f"model.hf_checkpoint: {where} has layer_types {json.dumps(types)}; the llama model alternates "
                      f"Gemma 2's way (model.global_every: 2: {json.dumps(pattern)}) and computes no other order")
    soft = {key: hf.get(key, default) for key, default in (("attn_logit_softcapping", 50.0),
                                                           ("final_logit_softcapping", 30.0))}
    return {"query_scale": float(hf.get("query_pre_attn_scalar", 256)), "global_every": 2,
            "attn_softcap": None if soft["attn_logit_softcapping"] is None else float(soft["attn_logit_softcapping"]),
            "final_softcap": None if soft["final_logit_softcapping"] is None else float(soft["final_logit_softcapping"])}


def _qwen3_moe_keys(hf: Mapping[str, Any], where: str, need: Callable[..., Any],
                    refuse: Callable[..., None]) -> dict[str, Any]:
    """Qwen3-MoE: Qwen3's attention and every layer's MLP `num_experts` experts of moe_intermediate_size,
    routed as Mixtral routes (`_mixtral_keys`) - which needs norm_topk_prob true (the published
    checkpoints'), every layer sparse (decoder_sparse_step 1, no mlp_only_layers)."""
    refuse("norm_topk_prob", (True,), "the llama model's gates renormalize a token's top-k weights to sum to one "
                                      "(Qwen3-MoE's norm_topk_prob: true, as Qwen3-30B-A3B has it)")
    refuse("decoder_sparse_step", (1,), "every layer of the MoE llama imported from Qwen3-MoE is sparse; use 1")
    if hf.get("mlp_only_layers"):
        raise HFError(f"model.hf_checkpoint: {where} has mlp_only_layers {json.dumps(hf['mlp_only_layers'])}; every "
                      f"layer of the MoE llama imported from Qwen3-MoE is sparse (the nearest: mixtral's layout)")
    return {**_mixtral_keys(hf, where, need, refuse, ("num_experts", "num_local_experts")),
            "d_ff": int(need("moe_intermediate_size"))}


def model_keys(directory: str | os.PathLike[str], seq_len: int | None = None,
               key: str = "model.hf_checkpoint") -> tuple[dict[str, Any], str]:
    """The `model.*` values a checkpoint's config.json implies, and where they came from.

    `seq_len` is the config's own `model.seq_len` when given (GPT-2's position table must cover it).
    Architectures the models here do not compute exactly are refused, naming the config.json key.
    `key`: the config key that named the file (`model.hf_config` reads a config.json alone).
    """
    try:
        return _model_keys(directory, seq_len, key)
    except HFError as e:
        if key == "model.hf_checkpoint":
            raise
        raise HFError(str(e).replace("model.hf_checkpoint", key)) from None


def _model_keys(directory: str | os.PathLike[str], seq_len: int | None, key: str) -> tuple[dict[str, Any], str]:
    root, hf = read_config_json(directory, key)
    where = str(Path(directory).expanduser()) if Path(directory).expanduser().is_file() else f"{root / 'config.json'}"
    kind = hf.get("model_type")

    def need(*names: str) -> Any:
        for name in names:
            if hf.get(name) is not None:
                return hf[name]
        raise HFError(f"model.hf_checkpoint: {where} has no {names[0]}; is it a complete transformers config?")

    def refuse(key: str, ok: Any, why: str) -> None:
        if key in hf and hf[key] is not None and hf[key] not in (ok if isinstance(ok, tuple) else (ok,)):
            raise HFError(f"model.hf_checkpoint: {where} has {key}: {json.dumps(hf[key])}; {why}")

    if kind in FAMILIES:
        family = FAMILIES[kind]
        d, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        if kind == "gemma2":  # Gemma2Config reads hidden_activation (its hidden_act is a leftover)
            refuse("hidden_activation", "gelu_pytorch_tanh", "Gemma 2's MLP is GeGLU with the tanh-approximated "
                                                             "GELU (gelu_pytorch_tanh), the one the llama model has")
        else:
            refuse("hidden_act", "silu", "the llama model's MLP is SwiGLU (silu), or Gemma 2's GeGLU")
        bias_why = ("Qwen2's query, key and value projections always have biases, its output projection none"
                    if kind == "qwen2" else "the llama model has no attention biases (only Qwen2's q/k/v ones)")
        refuse("attention_bias", False, bias_why)
        refuse("mlp_bias", False, "the llama model has no MLP biases")
        refuse("pretraining_tp", (1,), "tensor-parallel pretraining slices are not supported; use 1")
        if kind != "gemma2":
            for soft in ("attn_logit_softcapping", "final_logit_softcapping"):
                refuse(soft, (), f"soft-capping is Gemma 2's; a {kind} model has none (a gemma2 checkpoint has it)")
        refuse("use_mrope", False, "multimodal rotary sections (Qwen2-VL's) are not part of the llama model")
        if kind in ("qwen2", "qwen3", "qwen3_moe"):
            refuse("use_sliding_window", False, "Qwen's window applies only from layer max_window_layers on, and "
                                                "the llama model's model.sliding_window is every layer's; use "
                                                "use_sliding_window: false (the published Qwen2.5 and Qwen3 have it)")
        keys = {"name": "llama", "vocab_size": int(need("vocab_size")), "d_model": d,
                "n_layers": int(need("num_hidden_layers")), "n_heads": heads,
                "n_kv_heads": int(hf.get("num_key_value_heads") or heads),
                "d_ff": int(need("intermediate_size")),
                # head_dim only where it is not hidden_size / num_attention_heads (Qwen3's)
                "head_dim": None if int(hf.get("head_dim") or d // heads) == d // heads else int(hf["head_dim"]),
                "qkv_bias": family["qkv_bias"], "qk_norm": family["qk_norm"],
                **_rope_keys(hf, where, family["rope_theta"]),
                "norm_eps": float(hf.get("rms_norm_eps", family["rms_norm_eps"])),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", family.get("tie", False))),
                "hf_family": kind, **family.get("options", {})}
        if kind in _SLIDING:
            window = hf.get("sliding_window", _SLIDING[kind])
            keys["sliding_window"] = None if window is None else int(window)
        if kind == "gemma2":
            keys.update(_gemma2_keys(hf, where, keys, refuse))
        if kind == "mixtral":
            keys.update(_mixtral_keys(hf, where, need, refuse))
        if kind == "qwen3_moe":
            keys.update(_qwen3_moe_keys(hf, where, need, refuse))
    elif kind == "gpt2":
        d = int(need("n_embd", "hidden_size"))
        refuse("activation_function", ("gelu_new", "gelu_pytorch_tanh"),
               "the gpt model's MLP uses the tanh-approximated GELU (gelu_new)")
        refuse("scale_attn_by_inverse_layer_idx", False, "the gpt model does not scale attention by layer index")
        refuse("scale_attn_weights", True, "the gpt model scales attention scores by 1/sqrt(head width)")
        refuse("add_cross_attention", False, "cross-attention is not part of a causal LM")
        positions = int(need("n_positions", "max_position_embeddings"))
        if seq_len is not None and seq_len > positions:
            raise HFError(f"model.seq_len: {seq_len} is longer than the {positions} learned positions of the "
                          f"GPT-2 checkpoint ({where}: n_positions); set model.seq_len <= {positions}")
        keys = {"name": "gpt", "vocab_size": int(need("vocab_size")), "d_model": d,
                "n_layers": int(need("n_layer", "num_hidden_layers")),
                "n_heads": int(need("n_head", "num_attention_heads")),
                "d_ff": int(hf.get("n_inner") or 4 * d), "norm_eps": float(hf.get("layer_norm_epsilon", 1e-5)),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}  # transformers' GPT-2 default
        if seq_len is None:
            keys["seq_len"] = positions
    else:
        nearest = f" (the nearest it reads: {_NEAREST[kind]})" if kind in _NEAREST else ""
        raise HFError(f"model.hf_checkpoint: {where} has model_type {kind!r}, which zerojax does not read{nearest}; "
                      f"it reads model_type {', '.join(map(repr, FAMILIES))} and 'gpt2' checkpoints")
    return keys, "config.json"


ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"

# adapter_config.json values PEFT may write that change the adapter's maths, and the only value built here.
_ADAPTER_PLAIN = {"bias": "none", "use_rslora": False, "use_dora": False, "lora_bias": False}


def adapter_keys(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], Path]:
    """`lora.*` keys of a PEFT LoRA adapter folder (its adapter_config.json: r, lora_alpha,
    target_modules), refusing the variants whose maths differ (DoRA, rsLoRA, trained biases, per-layer
    ranks), each with the key that asks for it."""
    root = Path(directory).expanduser()
    path = root / ADAPTER_CONFIG
    if not path.is_file() or not (root / ADAPTER_WEIGHTS).is_file():
        raise HFError(f"lora.adapter: {root} needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (what PEFT's "
                      f"save_pretrained writes); give the adapter's folder")
    try:
        hf = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise HFError(f"lora.adapter: {path} is not valid JSON ({e})") from None
    if not isinstance(hf, dict):
        raise HFError(f"lora.adapter: {path} holds a JSON {type(hf).__name__}, not PEFT's adapter config (an "
                      f"object with r, lora_alpha and target_modules); re-save the adapter with save_pretrained")
    if hf.get("peft_type", "LORA") != "LORA":
        raise HFError(f"lora.adapter: {path} is a {hf.get('peft_type')} adapter; only LoRA adapters are read")
    for key, plain in _ADAPTER_PLAIN.items():
        if hf.get(key, plain) not in (plain, None):
            raise HFError(f"lora.adapter: {path} has {key}: {json.dumps(hf[key])}; only plain LoRA is built "
                          f"({key}: {json.dumps(plain)})")
    for key in ("rank_pattern", "alpha_pattern", "layers_to_transform", "modules_to_save", "exclude_modules",
                "target_parameters", "trainable_token_indices", "layer_replication"):
        if hf.get(key):
            raise HFError(f"lora.adapter: {path} has {key}: {json.dumps(hf[key])}; one rank, alpha and set of "
                          f"projections for every layer is what is read (train with PEFT's defaults for it)")
    r, alpha, targets = hf.get("r"), hf.get("lora_alpha", hf.get("r")), hf.get("target_modules")
    if isinstance(targets, str):
        targets = [targets]
    bad = ("r", r, "a positive integer") if type(r) is not int or r < 1 else \
        ("lora_alpha", alpha, "a number") if type(alpha) not in (int, float) else \
        ("target_modules", targets, "a list of module names") if targets is not None and not (
            isinstance(targets, list) and all(isinstance(t, str) for t in targets)) else None
    if bad is not None:
        has = f"has {bad[0]}: {json.dumps(bad[1])}" if bad[0] in hf else f"has no {bad[0]}"
        raise HFError(f"lora.adapter: {path} {has}, where PEFT writes {bad[2]}; fix that entry or re-save "
                      f"the adapter with save_pretrained")
    keys = {"r": r, "lora_alpha": float(alpha)}
    if targets:
        keys["target_modules"] = tuple(sorted(targets))
    return keys, path
