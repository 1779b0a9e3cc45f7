"""The config loader: DeepSpeed's batch triad and optimizer semantics, file formats, sources, and
one clear error (key path + fix) for every bad config. No JAX devices are touched."""
from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any

import pytest

from zerojax import config as cfg
from zerojax.config import BatchSize, Config, ConfigError, check_supported, load_config, resolve_batch
from zerojax.config import ConfigWarning, unsupported_features

ROOT = Path(__file__).resolve().parents[1]
DP_SIZES = (1, 2, 8)


def with_batch(**keys: Any) -> dict[str, Any]:
    """A minimal valid config (one batch key) plus `keys`."""
    return {"train_micro_batch_size_per_gpu": 2, **keys}


def triad(tb: int | None = None, mb: int | None = None, gas: int | None = None) -> Config:
    raw = {k: v for k, v in zip(cfg.BATCH_KEYS, (tb, mb, gas)) if v is not None}
    return Config(**raw)


def explain_row(config: Config, key: str, dp: int | None = None) -> tuple[str, str]:
    """(value, source) of one row of `explain`."""
    for line in config.explain(dp).splitlines()[1:]:
        name, value, source = re.match(r"(\S+)\s+(\S+)\s+(.*)$", line).groups()
        if name == key:
            return value, source
    raise AssertionError(f"{key} not in explain()")


# ---------------------------------------------------------------------------------------------
# Batch triad (DeepSpeed's runtime/config.py, _batch_assertion and _set_batch_related_parameters).

@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_all_three_consistent(dp: int) -> None:
    assert triad(4 * 2 * dp, 4, 2).batch(dp) == BatchSize(4 * 2 * dp, 4, 2)
    assert resolve_batch(load_config({"train_batch_size": 24 * dp, "train_micro_batch_size_per_gpu": 3,
                                      "gradient_accumulation_steps": 8}), dp) == (24 * dp, 3, 8)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_all_three_inconsistent_prints_the_arithmetic(dp: int) -> None:
    tb = 4 * 2 * dp + 2
    with pytest.raises(ConfigError, match=(
            rf"^train_batch_size: {tb} != train_micro_batch_size_per_gpu \* gradient_accumulation_steps "
            rf"\* data-parallel size = 4 \* 2 \* {dp} = {8 * dp}; fix one of the three or leave one out")):
        triad(tb, 4, 2).batch(dp)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_batch_and_micro_derive_accumulation(dp: int) -> None:
    assert triad(tb=4 * 3 * dp, mb=4).batch(dp) == BatchSize(12 * dp, 4, 3)
    tb = 4 * 3 * dp + 2
    with pytest.raises(ConfigError, match=(
            rf"^gradient_accumulation_steps: train_batch_size / \(micro 4 \* dp {dp}\) = {tb} / {4 * dp} "
            rf"is not a whole number; choose train_batch_size as a multiple of {4 * dp}$")):
        triad(tb=tb, mb=4).batch(dp)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_batch_and_accumulation_derive_micro(dp: int) -> None:
    assert triad(tb=2 * 5 * dp, gas=2).batch(dp) == BatchSize(10 * dp, 5, 2)
    tb = 2 * 5 * dp + 1
    with pytest.raises(ConfigError, match=(
            rf"^train_micro_batch_size_per_gpu: train_batch_size / \(accumulation 2 \* dp {dp}\) = "
            rf"{tb} / {2 * dp} is not a whole number; choose train_batch_size as a multiple of {2 * dp}$")):
        triad(tb=tb, gas=2).batch(dp)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_micro_and_accumulation_derive_batch(dp: int) -> None:
    assert triad(mb=3, gas=4).batch(dp) == BatchSize(12 * dp, 3, 4)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_only_train_batch_size_means_no_accumulation(dp: int) -> None:
    assert triad(tb=16 * dp).batch(dp) == BatchSize(16 * dp, 16, 1)


@pytest.mark.parametrize("dp", [2, 8])
def test_triad_only_train_batch_size_must_divide_by_dp(dp: int) -> None:
    tb = 4 * dp + 1
    with pytest.raises(ConfigError, match=(rf"^train_micro_batch_size_per_gpu: train_batch_size / dp {dp} = "
                                           rf"{tb} / {dp} is not a whole number; choose train_batch_size "
                                           rf"as a multiple of {dp}$")):
        triad(tb=tb).batch(dp)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_only_micro_means_no_accumulation(dp: int) -> None:
    assert triad(mb=5).batch(dp) == BatchSize(5 * dp, 5, 1)
    assert load_config({"train_micro_batch_size_per_gpu": 5}).batch(dp) == BatchSize(5 * dp, 5, 1)


@pytest.mark.parametrize("dp", DP_SIZES)
def test_triad_only_accumulation_or_nothing_is_an_error(dp: int) -> None:
    fix = "give train_batch_size or train_micro_batch_size_per_gpu"
    with pytest.raises(ConfigError, match=f"^train_batch_size: {fix}"):
        triad(gas=4).batch(dp)
    with pytest.raises(ConfigError, match=f"^train_batch_size: {fix}"):
        triad().batch(dp)
    with pytest.raises(ConfigError, match=("^train_batch_size: gradient_accumulation_steps alone cannot fix "
                                           "the batch; also give train_batch_size or "
                                           "train_micro_batch_size_per_gpu$")):
        load_config({"gradient_accumulation_steps": 4})
    with pytest.raises(ConfigError, match=f"^train_batch_size: {fix}$"):
        load_config({"steps_per_print": 5})


@pytest.mark.parametrize("dp", [0, -2, 2.0, True, "8", None])
def test_triad_rejects_a_bad_data_parallel_size(dp: Any) -> None:
    with pytest.raises(ConfigError, match=r"^data-parallel size: got .*; it must be a positive integer"):
        triad(mb=4).batch(dp)


def test_triad_auto_means_derive() -> None:
    config = load_config({"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 4,
                          "gradient_accumulation_steps": "auto"})
    assert config.train_batch_size is None and config.gradient_accumulation_steps is None
    assert config.sources["train_batch_size"] == "derived ('auto')"
    assert config.batch(8) == BatchSize(32, 4, 1)
    assert explain_row(config, "train_batch_size", 8) == ("32", "derived ('auto', data-parallel size 8)")
    assert explain_row(config, "train_micro_batch_size_per_gpu", 8) == ("4", "file")
    with pytest.raises(ConfigError, match=(r"can only be filled from the Trainer's arguments.*\n"
                                           r"  train_micro_batch_size_per_gpu=8   \(the Trainer's "
                                           r"per_device_train_batch_size\)\ncommand line: --set "
                                           r"train_micro_batch_size_per_gpu=8; Python: ")):
        load_config(dict.fromkeys(cfg.BATCH_KEYS, "auto"))


# ---------------------------------------------------------------------------------------------
# Optimizer semantics: Adam means AdamW, implementation selectors, weight-decay defaults.

def optimizer(type_: str, **params: Any) -> cfg.OptimizerConfig:
    return load_config(with_batch(optimizer={"type": type_, "params": params})).optimizer


def test_adam_means_adamw() -> None:
    opt = optimizer("Adam", lr=1e-3)
    assert opt.type == "adam" and opt.params.adam_w_mode is True
    opt = load_config(with_batch(optimizer={"type": "Adam"})).optimizer
    assert opt.type == "adam" and opt.params.adam_w_mode is True and opt.params.lr == 1e-3


def test_no_optimizer_section_means_the_optimizer_from_code() -> None:
    """DeepSpeed has no default optimizer: without a section it uses the one passed to initialize."""
    config = load_config(with_batch())
    assert config.optimizer is None
    assert explain_row(config, "optimizer") == ("null", "default")


@pytest.mark.parametrize("given, expected", [(0, False), (1, True), (False, False), (True, True)])
def test_adam_w_mode_accepts_0_and_1(given: Any, expected: bool) -> None:
    assert optimizer("Adam", adam_w_mode=given).params.adam_w_mode is expected


@pytest.mark.parametrize("type_, params, weight_decay, source", [
    ("Adam", {}, 0.0, "derived (FusedAdam default)"),
    ("AdamW", {}, 0.0, "derived (FusedAdam default)"),
    ("Adam", {"torch_adam": True}, 0.01, "derived (torch_adam: torch.optim.AdamW default)"),
    ("AdamW", {"torch_adam": 1}, 0.01, "derived (torch_adam: torch.optim.AdamW default)"),
    ("Adam", {"torch_adam": True, "adam_w_mode": 0}, 0.0, "derived (torch_adam: torch.optim.Adam default)"),
    ("Adam", {"torch_adam": True, "weight_decay": 0.1}, 0.1, "file"),
    ("AdamW", {"weight_decay": 0.05}, 0.05, "file"),
])
def test_weight_decay_default_follows_the_implementation(type_: str, params: dict, weight_decay: float,
                                                         source: str) -> None:
    config = load_config(with_batch(optimizer={"type": type_, "params": params}))
    assert config.optimizer.params.weight_decay == weight_decay
    assert config.sources["optimizer.params.weight_decay"] == source


@pytest.mark.parametrize("fused", [True, False, 0, 1])
def test_fused_selector_is_accepted(fused: Any) -> None:
    assert optimizer("Adam", fused=fused).params.fused is bool(fused)


@pytest.mark.parametrize("given, canonical, params_cls", [
    ("ADAM", "adam", cfg.AdamParams), ("adamW", "adamw", cfg.AdamParams), ("LAMB", "lamb", cfg.LambParams),
    ("AdaGrad", "adagrad", cfg.AdagradParams), ("lion", "lion", cfg.LionParams), ("Sgd", "sgd", cfg.SGDParams),
])
def test_optimizer_type_is_case_insensitive(given: str, canonical: str, params_cls: type) -> None:
    config = load_config(with_batch(optimizer={"type": given}, zero_allow_untested_optimizer=True))
    assert config.optimizer.type == canonical and type(config.optimizer.params) is params_cls


def test_scheduler_type_is_case_insensitive_and_derives_from_the_optimizer() -> None:
    config = load_config(with_batch(optimizer={"type": "Adam", "params": {"lr": 3e-4}},
                                    scheduler={"type": "warmuplr", "params": {"warmup_num_steps": 10}}))
    assert config.scheduler.type == "WarmupLR"
    assert config.scheduler.params.warmup_max_lr == 3e-4
    assert config.sources["scheduler.params.warmup_max_lr"] == "derived (optimizer.params.lr)"
    one_cycle = load_config(with_batch(scheduler={"type": "ONECYCLE", "params": {
        "cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "cycle_first_step_size": 7}})).scheduler
    assert one_cycle.type == "OneCycle" and one_cycle.params.cycle_second_step_size == 7


def test_untested_optimizer_is_fine_without_zero_or_when_allowed() -> None:
    assert load_config(with_batch(optimizer={"type": "SGD"})).optimizer.type == "sgd"
    allowed = with_batch(optimizer={"type": "SGD"}, zero_optimization={"stage": 2},
                         zero_allow_untested_optimizer=True)
    assert load_config(allowed).zero_optimization.stage == 2


# ---------------------------------------------------------------------------------------------
# Bad configs: one error, naming the key path and the fix.

def _adam(**params: Any) -> dict[str, Any]:
    return {"type": "Adam", "params": params}


BAD_CONFIGS = [
    ("unknown-top", {"train_batch_sise": 8},
     r"^unknown key 'train_batch_sise'; did you mean 'train_batch_size'\?$"),
    ("unknown-nested", with_batch(zero_optimization={"stgae": 2}),
     r"^unknown key 'zero_optimization\.stgae'; did you mean 'stage'\?$"),
    ("unknown-deep", with_batch(zero_optimization={"offload_optimizer": {"devcie": "cpu"}}),
     r"^unknown key 'zero_optimization\.offload_optimizer\.devcie'; did you mean 'device'\?$"),
    ("unknown-optimizer-param", with_batch(optimizer=_adam(weight_decy=0.1)),
     r"^unknown key 'optimizer\.params\.weight_decy'; did you mean 'weight_decay'\?"),
    ("unknown-scheduler-param", with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_steps": 5}}),
     r"^unknown key 'scheduler\.params\.warmup_steps'; did you mean 'warmup_num_steps'\?"),
    ("key-in-wrong-section", with_batch(lr=1e-3),
     r"^unknown key 'lr'; it belongs elsewhere: did you mean 'optimizer\.params\.lr'\?$"),
    ("unknown-optimizer-key", with_batch(optimizer={"type": "Adam", "param": {}}),
     r"^unknown key 'optimizer\.param'; did you mean 'params'\?$"),
    ("wrong-type-int", {"train_batch_size": "8"},
     r"^train_batch_size: expected an integer, got \"8\"$"),
    ("wrong-type-fraction", {"train_batch_size": 8.5},
     r"^train_batch_size: expected an integer, got 8\.5$"),
    ("wrong-type-bool", with_batch(bf16={"enabled": "yes"}),
     r"^bf16\.enabled: expected true/false, got \"yes\"$"),
    ("int-bool-out-of-range", with_batch(optimizer=_adam(adam_w_mode=2)),
     r"^optimizer\.params\.adam_w_mode: expected true/false \(or 0/1\), got 2$"),
    ("betas-length", with_batch(optimizer=_adam(betas=[0.9])),
     r"^optimizer\.params\.betas: expected a list of 2 numbers, got \[0\.9\]$"),
    ("betas-range", with_batch(optimizer=_adam(betas=[0.9, 1.0])),
     r"^optimizer\.params\.betas\[1\]: 1\.0 must be in \[0, 1\)$"),
    ("negative-clipping", with_batch(gradient_clipping=-1),
     r"^gradient_clipping: -1\.0 must be >= 0$"),
    ("zero-micro-batch", {"train_micro_batch_size_per_gpu": 0},
     r"^train_micro_batch_size_per_gpu: 0 must be > 0$"),
    ("fraction-too-large", with_batch(data={"val_fraction": 0.9}),
     r"^data\.val_fraction: 0\.9 must be <= 0\.5$"),
    ("nan", with_batch(optimizer=_adam(lr=float("nan"))),
     r"^optimizer\.params\.lr: NaN is not a usable value; write a number$"),
    ("bad-stage", with_batch(zero_optimization={"stage": 4}),
     r"^zero_optimization\.stage: 4 is not one of 0, 1, 2, 3$"),
    ("bad-offload-device", with_batch(zero_optimization={"offload_optimizer": {"device": "gpu"}}),
     r"^zero_optimization\.offload_optimizer\.device: 'gpu' is not one of none, cpu, nvme$"),
    ("bad-warmup-type", with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_type": "cosine"}}),
     r"^scheduler\.params\.warmup_type: 'cosine' is not one of log, linear$"),
    ("fp16-and-bf16", with_batch(fp16={"enabled": True}, bf16={"enabled": True}),
     r"^fp16\.enabled and bf16\.enabled: both true; choose one precision$"),
    ("untested-optimizer-under-zero", with_batch(optimizer={"type": "SGD"}, zero_optimization={"stage": 1}),
     r"^optimizer\.type: sgd is not among DeepSpeed's ZeRO-tested optimizers \(.*\); set "
     r"zero_allow_untested_optimizer: true to use it with ZeRO stage 1$"),
    ("one-bit-optimizer", with_batch(optimizer={"type": "OneBitAdam"}),
     r"^optimizer\.type: OneBitAdam \(1-bit communication compression\) is out of scope for zerojax; "
     r"use Adam or Lamb$"),
    ("unknown-optimizer", with_batch(optimizer={"type": "Adamm"}),
     r"^optimizer\.type: unknown optimizer 'Adamm'; did you mean 'adam'\?$"),
    ("unknown-scheduler", with_batch(scheduler={"type": "CosineAnnealing"}),
     r"^scheduler\.type: unknown scheduler 'CosineAnnealing'; valid types: LRRangeTest, OneCycle, "
     r"WarmupCosineLR, WarmupDecayLR, WarmupLR$"),
    ("optimizer-without-type", with_batch(optimizer={"params": {"lr": 1e-3}}),
     r'^optimizer\.type: required, a string such as "AdamW"$'),
    ("optimizer-not-a-section", with_batch(optimizer="adam"),
     r'^optimizer: expected \{"type": "AdamW", "params": \{\.\.\.\}\}, got "adam"$'),
    ("section-given-a-value", with_batch(zero_optimization=2),
     r"^zero_optimization: expected a section \(mapping of keys\), got 2$"),
    ("adam-max-grad-norm", with_batch(optimizer=_adam(max_grad_norm=1.0)),
     r"^optimizer\.params\.max_grad_norm: not a parameter of DeepSpeed's Adam .*top-level gradient_clipping"),
    ("param-nvme-below-stage-3",
     with_batch(zero_optimization={"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/nvme"}}),
     r"^zero_optimization\.offload_param\.device: nvme swaps ZeRO-3's parameter partitions to files, but "
     r"zero_optimization\.stage is 2; set zero_optimization\.stage: 3, or remove offload_param$"),
    ("param-nvme-without-path", with_batch(zero_optimization={"stage": 3, "offload_param": {"device": "nvme"}}),
     r"^zero_optimization\.offload_param\.nvme_path: device nvme keeps the parameter partitions in files; "
     r"give a folder"),
    ("offload-without-zero", with_batch(zero_optimization={"offload_optimizer": {"device": "cpu"}}),
     r"^zero_optimization\.offload_optimizer\.device: offload needs ZeRO stage 1, 2 or 3 \(stage is 0\); "
     r"set zero_optimization\.stage or remove offload_optimizer$"),
    ("cpu-offload-contradiction",
     with_batch(zero_optimization={"cpu_offload": True, "offload_optimizer": {"device": "nvme"}}),
     r"^zero_optimization\.cpu_offload: true contradicts offload_optimizer\.device=nvme; keep only "
     r"offload_optimizer$"),
    ("warmup-decay-without-total", with_batch(scheduler={"type": "WarmupDecayLR", "params": {}}),
     r"^scheduler\.params\.total_num_steps: required by WarmupDecayLR; add it$"),
    ("cosine-without-total", with_batch(scheduler={"type": "WarmupCosineLR"}),
     r"^scheduler\.params\.total_num_steps: required by WarmupCosineLR; add it$"),
    ("one-cycle-without-max", with_batch(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1}}),
     r"^scheduler\.params\.cycle_max_lr: required by OneCycle; add it$"),
    ("one-cycle-min-above-max",
     with_batch(scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 0.01}}),
     r"^scheduler\.params\.cycle_min_lr: larger than cycle_max_lr; swap them$"),
    ("auto-in-optimizer-params", with_batch(optimizer=_adam(lr="auto")),
     r"^\"auto\" is a Hugging Face Trainer placeholder.*\n  optimizer\.params\.lr=5e-5   \(the "
     r"Trainer's learning_rate\)\n"),
    ("auto-in-scheduler-params",
     with_batch(scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}),
     r"^\"auto\" is a Hugging Face Trainer placeholder.*\n  scheduler\.params\.warmup_max_lr=5e-5"),
    ("adamw-without-w-mode", with_batch(optimizer={"type": "AdamW", "params": {"adam_w_mode": False}}),
     r"^optimizer\.params\.adam_w_mode: false contradicts type AdamW; use type Adam"),
    ("amsgrad", with_batch(optimizer=_adam(amsgrad=True)),
     r"^optimizer\.params\.amsgrad: not supported .*; remove it$"),
    ("lamb-max-grad-norm", with_batch(optimizer={"type": "Lamb", "params": {"max_grad_norm": 1.0}}),
     r"^optimizer\.params\.max_grad_norm: not supported in the optimizer .*; use the top-level "
     r"gradient_clipping$"),
    ("lamb-coeffs", with_batch(optimizer={"type": "Lamb", "params": {"min_coeff": 20.0}}),
     r"^optimizer\.params\.min_coeff: larger than max_coeff; swap them$"),
    ("nesterov-without-momentum", with_batch(optimizer={"type": "SGD", "params": {"nesterov": True}}),
     r"^optimizer\.params\.nesterov: needs momentum > 0 and dampening 0"),
    ("heads-do-not-divide", with_batch(model={"d_model": 128, "n_heads": 3}),
     r"^model\.n_heads: 3 does not divide model\.d_model 128; choose a divisor such as 8$"),
    ("file-source-without-path", with_batch(data={"source": "file"}),
     r"^data\.path: required when data\.source is 'file'; give a text file$"),
    ("save-every-zero", with_batch(run={"save_every": 0}),
     r"^run\.save_every: 0 must be > 0$"),
    ("alias-and-name", with_batch(bf16={"enabled": True}, bfloat16={"enabled": True}),
     r"^bfloat16: given twice \(also as an alias\); keep one$"),
    ("non-string-key", {1: 2},
     r"^config: key 1 must be a string$"),
]


@pytest.mark.parametrize("raw, pattern", [c[1:] for c in BAD_CONFIGS], ids=[c[0] for c in BAD_CONFIGS])
def test_bad_config_names_the_key_and_the_fix(raw: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(raw)


def test_there_are_plenty_of_bad_configs() -> None:
    assert len(BAD_CONFIGS) >= 25


def test_not_a_config_at_all() -> None:
    with pytest.raises(ConfigError, match=r"^config: expected a dict, a file path or a Config, got int$"):
        load_config(42)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# Files.

def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


SAME_CONFIG = {
    "json": ('{"train_batch_size": 16, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, '
             '"betas": [0.9, 0.95]}}, "zero_optimization": {"stage": 2}}'),
    "commented.json": """{
        // DeepSpeed configs in the wild carry comments and trailing commas
        "train_batch_size": 16,
        /* block comment */
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95],},},
        "zero_optimization": {"stage": 2,},
    }""",
    "hjson": """{
        # hjson: unquoted keys, no commas
        train_batch_size: 16
        optimizer: {
          type: AdamW
          params: {lr: 1e-3, betas: [0.9, 0.95]}
        }
        zero_optimization: {stage: 2}
    }""",
    "yaml": """
train_batch_size: 16
optimizer:
  type: AdamW
  params: {lr: 1e-3, betas: [0.9, 0.95]}   # 1e-3 is a number here too
zero_optimization:
  stage: 2
""",
    "yml": "{train_batch_size: 16, optimizer: {type: AdamW, params: {lr: 0.001, betas: [0.9, 0.95]}},"
           " zero_optimization: {stage: 2}}",
}


def test_every_format_gives_the_same_config(tmp_path: Path) -> None:
    configs = {name: load_config(write(tmp_path, f"c.{name}", text)) for name, text in SAME_CONFIG.items()}
    first = configs["json"]
    assert first.optimizer.params.lr == 1e-3 and first.optimizer.params.betas == (0.9, 0.95)
    assert first.zero_optimization.stage == 2 and first.batch(8) == BatchSize(16, 2, 1)
    for name, config in configs.items():
        assert config == first, name
        assert config.sources["optimizer.params.lr"] == "file"


def test_yaml_scientific_notation_is_a_number(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "train_batch_size: 8\noptimizer: {type: Adam, params: {lr: 3e-4, eps: 1E-8}}\n"
                                     "zero_optimization: {reduce_bucket_size: 5e8}\n")
    config = load_config(path, ["optimizer.params.weight_decay=1e-2"])
    assert config.optimizer.params.lr == 3e-4 and config.optimizer.params.eps == 1e-8
    assert config.zero_optimization.reduce_bucket_size == 500_000_000
    assert config.optimizer.params.weight_decay == 0.01


def test_yaml_merge_keys_are_not_duplicates(tmp_path: Path) -> None:
    text = ("train_batch_size: 8\nfp16: &scaler {enabled: false, loss_scale_window: 100}\n"
            "checkpoint: {tag_validation: Fail}\nbf16: {enabled: true}\n"
            "tensorboard: &tb {enabled: false, job_name: a}\ncsv_monitor:\n  <<: *tb\n  job_name: b\n")
    config = load_config(write(tmp_path, "c.yaml", text))
    assert config.csv_monitor.job_name == "b" and config.tensorboard.job_name == "a"


@pytest.mark.parametrize("name, text", [
    ("c.json", '{"train_batch_size": 8, "zero_optimization": {"stage": 1, "stage": 2}}'),
    ("c.hjson", "{train_batch_size: 8\nzero_optimization: {stage: 1\nstage: 2}}"),
    ("c.yaml", "train_batch_size: 8\nzero_optimization:\n  stage: 1\n  stage: 2\n"),
    ("commented.json", '{"train_batch_size": 8, // note\n "zero_optimization": {"stage": 1, "stage": 2,},}'),
])
def test_duplicate_keys_are_an_error_with_their_path(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=(rf"^config file {re.escape(str(path))}: zero_optimization\.stage: "
                                           rf"key written twice; keep one of them$")):
        load_config(path)


def test_duplicate_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "train_batch_size: 8\ntrain_batch_size: 16\n")
    with pytest.raises(ConfigError, match=r": train_batch_size: key written twice; keep one of them$"):
        load_config(path)


@pytest.mark.parametrize("name, text", [
    ("c.json", '{"train_batch_size": 8,, }'),
    ("c.hjson", '{"train_batch_size": [}'),
    ("c.yaml", "train_batch_size: [8\n"),
])
def test_unparsable_file_names_the_file_and_the_place(tmp_path: Path, name: str, text: str) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ConfigError, match=rf"(?s)^config file {re.escape(str(path))}: cannot parse: .*line"):
        load_config(path)


def test_missing_empty_and_directory_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^config file .*nope\.json: not found; give the path of a \.json, "
                                          r"\.hjson or \.yaml file$"):
        load_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r"^config file .*: is a directory; give the path of a"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"^config file .*empty\.yaml: the file is empty; write a mapping"):
        load_config(write(tmp_path, "empty.yaml", "  \n"))
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{")
    with pytest.raises(ConfigError, match=r"^config file .*binary\.json: cannot read it"):
        load_config(binary)


@pytest.mark.parametrize("name, text, got", [
    ("c.json", "[1, 2]", "list"), ("c.yaml", "- train_batch_size: 8\n", "list"), ("c.yaml", "8\n", "int"),
])
def test_top_level_must_be_a_mapping(tmp_path: Path, name: str, text: str, got: str) -> None:
    with pytest.raises(ConfigError, match=rf"^config file .*: the top level must be a mapping of keys, got {got}$"):
        load_config(write(tmp_path, name, text))


def test_unknown_key_in_a_file_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "train_batch_size: 8\nzero_optimization:\n  offload_optimiser: {}\n")
    with pytest.raises(ConfigError, match=(r"^unknown key 'zero_optimization\.offload_optimiser'; did you mean "
                                           r"'offload_optimizer'\?$")):
        load_config(path)


def test_shipped_configs_load() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")) + sorted((ROOT / "examples").glob("*.json")):
        config = load_config(path)  # the batch triad counts the rows' data-parallel ranks of 8 devices
        assert config.batch(config.mesh.data_parallel(8)).train_batch_size > 0, path


# ---------------------------------------------------------------------------------------------
# Overrides, sources, explain, round trip.

def test_overrides_apply_and_are_marked(tmp_path: Path) -> None:
    path = write(tmp_path, "c.json", SAME_CONFIG["json"])
    config = load_config(path, ["zero_optimization.stage=3", "run.steps=50"])
    assert config.zero_optimization.stage == 3 and config.run.steps == 50
    assert config.sources["zero_optimization.stage"] == "override"
    assert config.sources["run.steps"] == "override"
    assert explain_row(config, "zero_optimization.stage") == ("3", "override")
    assert explain_row(config, "run.steps") == ("50", "override")
    assert explain_row(config, "train_batch_size") == ("16", "file")
    # overlap_comm follows the overridden stage, not the file's.
    assert config.zero_optimization.overlap_comm is True


@pytest.mark.parametrize("override, check", [
    ("optimizer.params.betas=[0.8, 0.9]", lambda c: c.optimizer.params.betas == (0.8, 0.9)),
    ("scheduler=null", lambda c: c.scheduler is None),
    ("mesh.data=null", lambda c: c.mesh.data is None),
    ("run.output_dir=runs/x=1", lambda c: c.run.output_dir == "runs/x=1"),
    ("fp16={enabled: false, loss_scale: 128}", lambda c: c.fp16.loss_scale == 128.0),
    ("bfloat16.enabled=true", lambda c: c.bf16.enabled and c.sources["bf16.enabled"] == "override"),
    ("optimizer.type=ADAM", lambda c: c.optimizer.type == "adam"),
    ("kernels=xla", lambda c: c.kernels == "xla"),
])
def test_override_values(override: str, check: Any) -> None:
    base = with_batch(scheduler={"type": "WarmupLR"}, mesh={"data": 2}, bf16={"enabled": False},
                      optimizer={"type": "AdamW"})
    config = load_config(base, [override])
    assert check(config)


def test_override_of_an_aliased_section_merges_into_it() -> None:
    config = load_config(with_batch(bfloat16={"enabled": True, "check_grad_overflow": True}),
                         ["bf16.enabled=false"])
    assert config.bf16.enabled is False and config.bf16.check_grad_overflow is True
    assert config.sources["bf16.enabled"] == "override" and config.sources["bf16.check_grad_overflow"] == "file"


def test_override_of_a_whole_section_marks_its_keys() -> None:
    config = load_config(with_batch(), ["zero_optimization={stage: 2, reduce_bucket_size: 1000}"])
    assert config.sources["zero_optimization.reduce_bucket_size"] == "override"


@pytest.mark.parametrize("override, pattern", [
    ("zero_optimization.stage", r"^override 'zero_optimization\.stage': write it as key\.path=value, "
                                r"e\.g\. zero_optimization\.stage=2$"),
    ("=3", r"^override '=3': the key path before '=' has an empty part; write it as key\.path=value"),
    ("zero_optimization..stage=2", r"^override 'zero_optimization\.\.stage=2': the key path before '=' has an "
                                   r"empty part"),
    ("train_micro_batch_size_per_gpu.x=1", r"^override train_micro_batch_size_per_gpu\.x: "
                                           r"'train_micro_batch_size_per_gpu' is a value, not a section$"),
    ("zero_optimizaton.stage=2", r"^unknown key 'zero_optimizaton'; did you mean 'zero_optimization'\?$"),
    ("run.steps=abc", r"^run\.steps: expected an integer, got \"abc\"$"),
    ("run.steps=", r"^run\.steps: expected an integer, got null$"),
    ("fp16={enabled: true, enabled: false}", r"^fp16\.enabled: key written twice; keep one of them$"),
])
def test_bad_overrides(override: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(with_batch(), [override])


def test_explain_shows_file_default_and_derived_sources(tmp_path: Path) -> None:
    path = write(tmp_path, "c.yaml", "train_batch_size: 64\ntrain_micro_batch_size_per_gpu: 2\n"
                                     "zero_optimization: {stage: 3}\noptimizer: {type: Adam, params: {lr: 0.01}}\n")
    config = load_config(path)
    assert explain_row(config, "train_batch_size", 8) == ("64", "file")
    assert explain_row(config, "gradient_accumulation_steps", 8) == ("4", "derived (data-parallel size 8)")
    assert explain_row(config, "gradient_accumulation_steps") == ("null", "default")
    assert explain_row(config, "optimizer.params.lr") == ("0.01", "file")
    assert explain_row(config, "optimizer.params.eps") == ("1e-08", "default")
    assert explain_row(config, "optimizer.params.weight_decay") == ("0.0", "derived (FusedAdam default)")
    assert explain_row(config, "zero_optimization.overlap_comm") == ("true", "derived (true for stage 3)")
    assert explain_row(config, "model.d_ff") == ("512", "derived (4 * d_model)")
    assert explain_row(config, "gradient_clipping") == ("1.0", "default")
    keys = [line.split()[0] for line in config.explain().splitlines()[1:]]
    assert len(keys) == len(set(keys)) and "zero_optimization.offload_optimizer.device" in keys


def test_auto_means_the_default_outside_the_keys_the_trainer_fills() -> None:
    config = load_config(with_batch(gradient_clipping="auto",
                                    zero_optimization={"overlap_comm": "auto", "stage": 3},
                                    data_types={"grad_accum_dtype": "auto"}))
    assert config.gradient_clipping == 1.0
    assert config.data_types.grad_accum_dtype is None
    assert config.sources["gradient_clipping"] == "derived ('auto': the Trainer's max_grad_norm default, 1.0)"
    assert config.sources["data_types.grad_accum_dtype"] == "default ('auto')"
    assert config.zero_optimization.overlap_comm is True  # default: derived from the stage
    assert config.sources["zero_optimization.overlap_comm"] == "derived (true for stage 3)"


def test_auto_is_a_plain_value_where_the_key_takes_it() -> None:
    config = load_config(with_batch(kernels="AUTO", pipeline={"stages": "auto"}, run={"output_dir": "auto"}))
    assert config.kernels == "auto" and config.sources["kernels"] == "file"
    assert config.pipeline.stages == "auto" and config.run.output_dir == "auto"


ROUND_TRIP = [
    {"train_batch_size": 16, "gradient_accumulation_steps": 2},
    with_batch(optimizer={"type": "Adam", "params": {"torch_adam": True, "adam_w_mode": 0, "betas": [0.8, 0.9]}},
               scheduler={"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}},
               zero_optimization={"stage": 3, "cpu_offload": True}, bfloat16={"enabled": True},
               model={"d_model": 64, "n_heads": 8}, run={"log_every": 3}),
    with_batch(optimizer={"type": "Lamb"}, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": 9}},
               fp16={"enabled": True, "loss_scale": 0}, kernels="pallas", mesh={"stage": 2, "data": 4}),
    with_batch(optimizer={"type": "sgd", "params": {"momentum": 0.9, "nesterov": 1}}, steps_per_print=7),
]


@pytest.mark.parametrize("raw", ROUND_TRIP)
def test_to_dict_round_trips(raw: dict[str, Any], tmp_path: Path) -> None:
    config = load_config(raw)
    plain = config.to_dict()
    assert load_config(plain) == config
    path = write(tmp_path, "config.json", json.dumps(plain))  # what the trainer writes next to a run
    assert load_config(path) == config


def test_shipped_configs_round_trip() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = load_config(path)
        assert load_config(config.to_dict()) == config, path


def test_overriding_a_loaded_config_re_derives() -> None:
    config = load_config(with_batch(optimizer={"type": "Adam", "params": {"lr": 0.1}}, model={"d_model": 64}))
    assert config.optimizer.params.weight_decay == 0.0 and config.model.d_ff == 256
    again = load_config(config, ["optimizer.params.torch_adam=true", "model.d_model=32", "steps_per_print=4"])
    assert again.optimizer.params.weight_decay == 0.01 and again.model.d_ff == 128 and again.run.log_every == 4
    assert again.sources["optimizer.params.lr"] == "file"
    assert again.sources["optimizer.params.torch_adam"] == "override"
    assert "optimizer.params.eps" not in again.sources
    assert load_config(config) is config


def test_overriding_a_config_built_in_python_keeps_its_values() -> None:
    config = dataclasses.replace(load_config(with_batch()), gradient_clipping=0.5)
    again = load_config(config, ["run.steps=3"])
    assert again.gradient_clipping == 0.5 and again.run.steps == 3
    assert again.sources["gradient_clipping"] == "given"


def test_overriding_a_section_of_a_loaded_config_marks_its_keys() -> None:
    config = load_config(with_batch(fp16={"enabled": False, "loss_scale": 64}))
    again = load_config(config, ["fp16={enabled: false, hysteresis: 3}"])
    assert again.fp16.loss_scale == 0.0 and again.fp16.hysteresis == 3
    assert again.sources["fp16.enabled"] == "override" and "fp16.loss_scale" not in again.sources


def test_every_schema_field_has_a_default_and_a_doc() -> None:
    """So that "auto" and a missing key always mean something, and the reference documents every key."""
    classes = [Config, *cfg.OPTIMIZER_PARAMS.values(), *cfg.SCHEDULER_PARAMS.values()]
    seen: set[type] = set()
    while classes:
        cls = classes.pop()
        if cls in seen:
            continue
        seen.add(cls)
        for f in cfg.schema_fields(cls):
            assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING, f.name
            assert f.metadata.get("doc"), f"{cls.__name__}.{f.name} has no doc"
            if dataclasses.is_dataclass(f.default_factory):
                classes.append(f.default_factory)
    assert cfg.ZeroConfig in seen and cfg.OffloadParamConfig in seen


# ---------------------------------------------------------------------------------------------
# Features that parse but are not built yet.

def test_nvme_offload_loads_at_stage_3() -> None:
    """Both NVMe tiers load (the parameters' at stage 3 only: refused below it, see the bad-config cases)."""
    cfg = load_config(with_batch(zero_optimization={"stage": 3, "offload_param": {
        "device": "nvme", "nvme_path": "/nvme", "buffer_count": 3, "buffer_size": 1000, "max_in_cpu": 0}}))
    assert cfg.zero_optimization.offload_param.device == "nvme" and cfg.zero_optimization.offload_param.max_in_cpu == 0
    cfg = load_config(with_batch(zero_optimization={"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/nvme", "pipeline_read": True, "pipeline_write": True}},
        aio={"thread_count": 2, "block_size": 262144}))
    assert cfg.zero_optimization.offload_optimizer.pipeline_read and cfg.aio.thread_count == 2
    with pytest.raises(ConfigError, match=r"^zero_optimization\.offload_optimizer\.nvme_path: device nvme keeps"):
        load_config(with_batch(zero_optimization={"stage": 2, "offload_optimizer": {"device": "nvme"}}))


@pytest.mark.parametrize("overrides, pattern", [
    (["zero_optimization.stage=2", "zero_optimization.offload_optimizer.device=cpu",
      "zero_optimization.offload_optimizer.ratio=0.5"],
     r"^zero_optimization\.offload_optimizer\.ratio: 0\.5 \(partial offload\) is not supported; use 1\.0$"),
    (["zero_optimization.mics_shard_size=4"], r"^zero_optimization\.mics_shard_size: MiCS is not supported; "
                                              r"use -1$"),
])
def test_unsupported_features_fail_clearly(overrides: list[str], pattern: str) -> None:
    config = load_config(with_batch(), overrides)  # it parses and validates...
    assert len(unsupported_features(config)) == 1
    with pytest.raises(ConfigError, match=pattern):  # ...but using it is a clear error
        check_supported(config)


def test_several_unsupported_features_are_counted() -> None:
    config = load_config(with_batch(), ["fp16.enabled=true", "fp16.fp16_master_weights_and_grads=true",
                                        "zero_optimization.mics_shard_size=4",
                                        "zero_optimization.ignore_unused_parameters=false"])
    assert len(unsupported_features(config)) == 3
    with pytest.raises(ConfigError, match=r"^fp16\.fp16_master_weights_and_grads.* \(and 2 more\)$"):
        check_supported(config)


def test_supported_configs_pass() -> None:
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        config = load_config(path)
        assert unsupported_features(config) == []
        check_supported(config)



# ---------------------------------------------------------------------------------------------
# Real DeepSpeed configs, as projects write them (tests/fixtures/ds_configs).

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "ds_configs"


def load_warned(src: Any, overrides: list[str] | None = None, **kw: Any) -> tuple[Config, list[str]]:
    """The config and the warning lines loading it printed."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = load_config(src, overrides or (), **kw)
    return config, [str(w.message) for w in caught if issubclass(w.category, cfg.ConfigWarning)]


def test_deepspeed_field_names_load_like_their_aliases() -> None:
    """DeepSpeed's ZeRO model accepts `prefetch_bucket_size` as well as `stage3_prefetch_bucket_size`."""
    config, _ = load_warned(FIXTURES / "deepspeed_examples_zero3.json")
    zero = config.zero_optimization
    assert zero.stage3_prefetch_bucket_size == 50_000_000
    assert zero.stage3_param_persistence_threshold == 100_000
    assert zero.stage3_max_live_parameters == zero.stage3_max_reuse_distance == 1_000_000_000
    assert zero.stage3_gather_16bit_weights_on_model_save is True
    assert zero.sub_group_size == 0  # valid in DeepSpeed (ge=0)
    assert config.sources["zero_optimization.stage3_prefetch_bucket_size"] == "file"
    via_alias = load_config(with_batch(zero_optimization={"stage": 3, "stage3_max_live_parameters": 7}))
    via_name = load_config(with_batch(zero_optimization={"stage": 3, "max_live_parameters": 7}))
    assert via_alias.zero_optimization == via_name.zero_optimization
    with pytest.raises(ConfigError, match=r"^zero_optimization\.max_reuse_distance: given twice"):
        load_config(with_batch(zero_optimization={"stage3_max_reuse_distance": 1, "max_reuse_distance": 1}))
    # an override by either name lands on the same key
    assert load_config(with_batch(), ["zero_optimization.param_persistence_threshold=0"]) \
        .zero_optimization.stage3_param_persistence_threshold == 0


def test_every_refused_key_of_a_config_is_named_in_one_error() -> None:
    """DeepSpeedExamples' cifar config gives bf16 five loss-scaling keys: one error names all five (one
    per run took five runs to find them), and removing exactly those makes the file load."""
    path = FIXTURES / "deepspeed_examples_cifar.json"
    refused = ["bf16.loss_scale", "bf16.loss_scale_window", "bf16.hysteresis", "bf16.min_loss_scale",
               "bf16.initial_scale_power"]
    with pytest.raises(ConfigError) as e:
        load_warned(path)
    lines = str(e.value).splitlines()
    assert lines[0] == "5 problems in the config; fix each:"
    assert [re.match(r"  - unknown key '([\w.]+)'; bf16 trains without loss scaling", l)[1] for l in lines[1:]] \
        == refused
    raw = json.loads(path.read_text())
    for key in refused:
        del raw["bf16"][key.split(".")[1]]
    config, _ = load_warned(raw)
    assert config.bf16.enabled and not config.fp16.enabled and config.optimizer.params.betas == (0.8, 0.999)
    # unknown keys and a refused value in different sections, and an unknown optimizer key: all in one error
    with pytest.raises(ConfigError) as e:
        load_config(with_batch(optimizer={**_adam(), "paramz": {}}, zero_optimization={"stagee": 1},
                               bf16={"enabled": True, "bf16_optimizer_states": True}))
    assert str(e.value).startswith("3 problems in the config; fix each:\n  - unknown key 'optimizer.paramz'")
    assert "zero_optimization.stagee" in str(e.value) and "bf16.bf16_optimizer_states" in str(e.value)
    # one problem reads as before
    with pytest.raises(ConfigError, match=r"^unknown key 'zero_optimization.stagee'; did you mean 'stage'\?$"):
        load_config(with_batch(zero_optimization={"stagee": 1}))


def test_deepspeed_only_sections_load_with_one_warning_each() -> None:
    config, warned = load_warned(FIXTURES / "deepspeed_examples_zero3.json")
    foreign = ["compile", "seq_parallel_communication_data_type",
               "zero_optimization.model_persistence_threshold",
               "zero_optimization.use_multi_rank_bucket_allreduce", "zero_optimization.memory_efficient_linear"]
    assert sorted(w.split(":")[0] for w in warned) == sorted(foreign)
    for line in warned:
        assert re.match(r"^[\w.]+: DeepSpeed's .+: not built in zerojax; effect: .+; alternative: .+$", line), line
        assert "\n" not in line
    assert explain_row(config, "compile") == ("-", "ignored (DeepSpeed-only key, not built)")
    assert "_comment" not in config.explain()
    assert config.mesh.tensor == 1  # tensor_parallel.autotp_size: 1 is DeepSpeed's "no tensor parallelism"


@pytest.mark.parametrize("raw, pattern", [
    ({"tensor_parallel": {"autotp_size": 2, "tp": {"tp_group": "group"}}},
     r"^tensor_parallel\.tp\.tp_group: DeepSpeed's tensor-parallel process group is not built in zerojax, and it "
     r"is a torch process group; alternative: mesh\.tensor"),
    ({"amp": {"enabled": True, "opt_level": "O1"}}, r"^amp: DeepSpeed's NVIDIA Apex AMP .*enabled: it would "
                                                    r"train in Apex's mixed precision; alternative: bf16"),
    ({"data_efficiency": {"enabled": True, "data_sampling": {"enabled": True}}},
     r"^data_efficiency: .*changes which tokens each step trains on"),
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}},
     r"^bf16\.bf16_master_weights_and_grads: .*zerojax keeps fp32 master weights"),
    ({"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.05}}},
     r"^zero_optimization\.zenflow: DeepSpeed's ZenFlow"),
])
def test_deepspeed_only_keys_that_would_change_the_result_are_refused(raw: dict, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        load_config(with_batch(**raw))


def test_deepspeed_only_keys_turned_off_load() -> None:
    config, warned = load_warned(with_batch(amp={"enabled": False}, tensor_parallel={"tp": {"mpu": None}},
                                            data_efficiency={"enabled": False}, sequence_parallel_size=1,
                                            autotuning={"enabled": False}))
    assert len(warned) == 4


def test_comment_keys_are_ignored_at_every_level() -> None:
    config, warned = load_warned(with_batch(
        _comment="ZeRO-2 for 8 GPUs", _read_the_docs="https://www.deepspeed.ai/docs/config-json/",
        zero_optimization={"stage": 2, "_comment": "buckets tuned for A100"},
        optimizer={"_comment": "from the paper", "type": "AdamW", "params": {"lr": 1e-4, "_note": "peak"}}))
    assert warned == [] and config.zero_optimization.stage == 2 and config.optimizer.params.lr == 1e-4


@pytest.mark.parametrize("key, pattern", [
    ("tensor_paralel", r"did you mean 'tensor_parallel'\?$"),
    ("tensorbord", r"did you mean 'tensorboard'\?$"),
    ("compiled", r"did you mean 'compile'\?$"),
    ("tensor_sharding", r"^unknown key 'tensor_sharding'; valid keys: "),
])
def test_suggestions_point_at_the_key_meant(key: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern) as e:
        load_config(with_batch(**{key: {}}))
    if key.startswith("tensor_") and key != "tensor_paralel":
        assert "did you mean 'tensorboard'" not in str(e.value)
    with pytest.raises(ConfigError, match=r"did you mean 'max_live_parameters'\?$"):
        load_config(with_batch(zero_optimization={"max_live_parameter": 1}))


def test_offload_param_below_stage_3_warns_and_is_ignored_as_deepspeed_does() -> None:
    config, warned = load_warned(FIXTURES / "accelerate_zero2_offload.json")
    assert warned == ["zero_optimization.offload_param: ignored at stage 2, as DeepSpeed ignores it (parameter "
                      "offload is a stage-3 feature); effect: none, parameters stay on the device; set "
                      "zero_optimization.stage=3 to offload them"]
    assert config.zero_optimization.offload_param.device == "none"
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    assert explain_row(config, "zero_optimization.offload_param")[1].startswith("ignored (stage 2")
    # cpu_offload_param, DeepSpeed's deprecated spelling, means offload_param.device=cpu
    old = load_config(with_batch(zero_optimization={"stage": 3, "cpu_offload_param": True}))
    assert old.zero_optimization.offload_param.device == "cpu"


def test_deepspeeds_ulysses_tutorial_config_means_what_it_means_there() -> None:
    """DeepSpeed's ALST tutorial config (tests/fixtures/ds_configs/README.md): sequence_parallel_size 2 on
    8 devices is 4 data-parallel ranks of 2 (DeepSpeed's batch world size is world / sequence_parallel_size,
    so a micro-batch of 1 makes a batch of 4), ZeRO-3 over all 8 (tests/test_sequence_parallel.py trains
    such a mesh to the losses of data alone)."""
    import jax
    import zerojax
    from zerojax.core.mesh import data_size
    from zerojax.models import llama
    from zerojax.planner.mesh import make_mesh
    model = ["model.name=llama", "model.vocab_size=64", "model.seq_len=8", "model.d_model=32", "model.n_heads=4",
             "model.n_kv_heads=2", "model.d_ff=32", "model.n_layers=1"]
    config, warned = load_warned(FIXTURES / "deepspeed_ulysses_alst_tutorial.json", model)
    assert warned == [] and config.sequence_parallel_size == 2 and config.mesh.sequence == 2
    assert explain_row(config, "mesh.sequence") == ("2", "derived (sequence_parallel_size)")
    assert config.zero_optimization.stage == 3 and config.optimizer.type == "adam"
    mesh = make_mesh(config)
    assert dict(mesh.shape) == {"data": 4, "sequence": 2} and data_size(mesh) == 8
    assert config.batch(config.mesh.data_parallel(8)) == BatchSize(4, 1, 1)
    params, loss_fn = llama.build(config.model, seed=0)
    plan = zerojax.plan(config, mesh, params, logical_axes=loss_fn.logical_axes)
    assert plan.batch == BatchSize(4, 1, 1)  # rows over the 4 data ranks; tokens over sequence in the step
    assert all(s.spec[1] == ("data", "sequence") for s in jax.tree.leaves(plan.update_shardings["layers"]))


# ---------------------------------------------------------------------------------------------
# Hugging Face "auto": filled as the Trainer fills it, or named in one error.

def test_trainer_auto_values_are_filled_from_the_hidden_size() -> None:
    """LLaMA-Factory's ds_z3_config.json: the Trainer derives the buckets from the model's hidden size."""
    path = FIXTURES / "llama_factory_ds_z3_config.json"
    config = load_config(path, ["fp16.enabled=false", "bf16.enabled=true", "train_micro_batch_size_per_gpu=4"],
                         hidden_size=4096)
    zero = config.zero_optimization
    assert zero.reduce_bucket_size == 4096 * 4096
    assert zero.stage3_prefetch_bucket_size == int(0.9 * 4096 * 4096)
    assert zero.stage3_param_persistence_threshold == 40960
    assert config.gradient_clipping == 1.0 and config.bf16.enabled and not config.fp16.enabled
    assert config.batch(8) == BatchSize(32, 4, 1)
    assert explain_row(config, "zero_optimization.stage3_prefetch_bucket_size") == (
        "15099494", "derived ('auto': 0.9 * hidden^2, hidden size 4096 given as hidden_size)")
    assert explain_row(config, "zero_optimization.stage3_param_persistence_threshold")[1].startswith(
        "derived ('auto': 10 * hidden")
    assert explain_row(config, "gradient_clipping")[1] == ("derived ('auto': the Trainer's max_grad_norm "
                                                           "default, 1.0)")
    assert explain_row(config, "bf16.enabled") == ("true", "override")
    # without hidden_size, the embedded GPT's width (model.d_model) is the model's hidden size
    gpt = load_config(path, ["fp16.enabled=false", "bf16.enabled=false", "train_micro_batch_size_per_gpu=4",
                             "model.d_model=256"])
    assert gpt.zero_optimization.reduce_bucket_size == 256 * 256
    assert explain_row(gpt, "zero_optimization.reduce_bucket_size")[1] == (
        "derived ('auto': hidden^2, hidden size 256 from model.d_model)")
    # overrides on a loaded Config re-derive the filled values
    again = load_config(gpt, ["model.d_model=64"])
    assert again.zero_optimization.reduce_bucket_size == 64 * 64


def test_every_auto_only_the_trainer_can_fill_is_named_in_one_error() -> None:
    """transformers' ds_config_zero2.json as the docs write it: fp16, the optimizer and the schedule
    come from TrainingArguments; fp16 "auto" must not quietly become fp32."""
    with pytest.raises(ConfigError) as e:
        load_config(FIXTURES / "transformers_zero2_auto.json")
    lines = str(e.value).splitlines()
    assert lines[0].startswith('"auto" is a Hugging Face Trainer placeholder, and 8 of them can only be filled')
    assert lines[-1].startswith("command line: --set train_micro_batch_size_per_gpu=8 fp16.enabled=true ")
    assert [line.split()[0].split("=")[0] for line in lines[1:-1]] == [
        "train_micro_batch_size_per_gpu", "fp16.enabled", "optimizer.params.lr", "optimizer.params.betas",
        "optimizer.params.eps", "optimizer.params.weight_decay", "scheduler.params.warmup_max_lr",
        "scheduler.params.warmup_num_steps"]
    # set them as the error says, and the file loads; left "auto", the schedule's peak follows the
    # optimizer's lr, as the Trainer writes learning_rate into both
    sets = [line.split()[0] for line in lines[1:-1] if "warmup_max_lr" not in line]
    config = load_config(FIXTURES / "transformers_zero2_auto.json", sets, hidden_size=1024)
    assert config.fp16.enabled is True and config.optimizer.params.lr == 5e-5
    assert config.optimizer.params.betas == (0.9, 0.999)
    assert config.scheduler.params.warmup_max_lr == 5e-5 and config.scheduler.params.warmup_min_lr == 0.0
    assert explain_row(config, "scheduler.params.warmup_max_lr")[1] == (
        "derived ('auto': optimizer.params.lr, the Trainer's learning_rate)")
    assert config.zero_optimization.reduce_bucket_size == 1024 * 1024


def test_llama_factory_autotp_config_asks_for_two_way_tensor_parallelism() -> None:
    """LLaMA-Factory's examples/deepspeed/ds_z2_autotp_config.json, as the project ships it: ZeRO-2 with
    DeepSpeed's AutoTP over 2 devices, the rest Hugging Face "auto"s."""
    path = FIXTURES / "llama_factory_ds_z2_autotp_config.json"
    config, warned = load_warned(path, ["fp16.enabled=false", "bf16.enabled=true",
                                        "train_micro_batch_size_per_gpu=2"], hidden_size=4096)
    assert warned == []
    assert config.mesh.tensor == 2 and config.tensor_parallel.autotp_size == 2
    assert explain_row(config, "mesh.tensor") == ("2", "derived (tensor_parallel.autotp_size)")
    assert config.tensor_parallel.layer_specs == () and config.tensor_parallel.use_default_specs
    assert config.mesh.data_parallel(8) == 4  # 8 devices: 4 data-parallel replicas of 2 tensor shards
    assert config.batch(config.mesh.data_parallel(8)) == BatchSize(8, 2, 1)
    zero = config.zero_optimization
    assert (zero.stage, zero.overlap_comm, zero.reduce_scatter, zero.contiguous_gradients) == (2, False, True, True)
    assert zero.reduce_bucket_size == zero.allgather_bucket_size == 500_000_000
    assert config.zero_allow_untested_optimizer and config.gradient_clipping == 1.0
    assert config.bf16.enabled and not config.fp16.enabled
    assert (config.fp16.loss_scale_window, config.fp16.initial_scale_power, config.fp16.hysteresis) == (1000, 16, 2)
    check_supported(config)


@pytest.mark.parametrize("section", ["fp16", "bf16", "bfloat16"])
def test_precision_auto_is_never_fp32_in_silence(section: str) -> None:
    key = "bf16" if section == "bfloat16" else section
    with pytest.raises(ConfigError, match=rf"\n  {key}\.enabled=true   \(the Trainer's --{key}\)\n"):
        load_config(with_batch(**{section: {"enabled": "auto"}}))


@pytest.mark.parametrize("src", ["transformers_zero2_auto.json", "llama_factory_ds_z2_autotp_config.json",
                                 "llama_factory_ds_z3_config.json", {"train_batch_size": 8, "fp16": {"enabled": "auto"},
                                                                     "bf16": {"enabled": True}}])
def test_the_auto_fix_it_line_loads_as_printed(src: Any, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """The error's `--set` line and its `load_config(path, [...])` list, applied verbatim, load: with fp16
    and bf16 both "auto" (LLaMA-Factory's files) the line used to turn both on, which is refused."""
    if isinstance(src, dict):
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(src))
    else:
        path = FIXTURES / src
    with pytest.raises(ConfigError) as e:
        load_config(path)
    last = str(e.value).splitlines()[-1]
    shell, python = re.fullmatch(r"command line: --set (.+); Python: load_config\(path, (\[.+\])\)", last).groups()
    config = load_config(path, json.loads(python))
    assert not (config.fp16.enabled and config.bf16.enabled)
    assert config.bf16.enabled or config.fp16.enabled  # "auto" precision is never fp32 in silence
    from zerojax.app.cli import main
    import shlex
    assert main(["config", "explain", str(path), "--set", *shlex.split(shell)]) == 0
    capsys.readouterr()


def test_config_explain_command_shows_the_auto_fills(capsys: pytest.CaptureFixture) -> None:
    """`zerojax config explain` on LLaMA-Factory's file, with the Trainer-only values set on the line."""
    from zerojax.app.cli import main
    path = FIXTURES / "llama_factory_ds_z3_config.json"
    assert main(["config", "explain", str(path), "--set", "fp16.enabled=false", "bf16.enabled=true",
                 "train_micro_batch_size_per_gpu=2", "model.d_model=512"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert rows["zero_optimization.reduce_bucket_size"].split()[1] == str(512 * 512)
    assert "derived ('auto': hidden^2, hidden size 512 from model.d_model)" in rows[
        "zero_optimization.reduce_bucket_size"]
    assert "derived ('auto': 10 * hidden" in rows["zero_optimization.stage3_param_persistence_threshold"]
    assert "derived ('auto': the Trainer's max_grad_norm default, 1.0)" in rows["gradient_clipping"]
    assert rows["bf16.enabled"].split()[1:] == ["true", "override"]


def test_deprecated_offload_keys_warn_with_deepspeeds_words_at_the_users_line(tmp_path) -> None:
    path = tmp_path / "ds.yaml"
    path.write_text("train_batch_size: 8\nzero_optimization:\n  stage: 2\n  cpu_offload: true\n"
                    "  cpu_offload_use_pin_memory: true\n")
    with pytest.warns(ConfigWarning) as caught:
        config = load_config(path)
    assert config.zero_optimization.offload_optimizer.device == "cpu"
    found = {str(w.message).split(":")[0]: w for w in caught}
    w = found["zero_optimization.cpu_offload"]
    assert "Config parameter cpu_offload is deprecated use offload_optimizer instead; mapped to " \
           "offload_optimizer.device: cpu" in str(w.message)
    assert (w.filename, w.lineno) == (str(path), 4)
    assert found["zero_optimization.cpu_offload_use_pin_memory"].lineno == 5
    with pytest.warns(ConfigWarning) as caught:  # a dict in code: the warning points at this line
        load_config({"train_batch_size": 8, "zero_optimization": {"stage": 3, "cpu_offload_param": True}})
    assert caught[0].filename == __file__


def test_a_loss_scaling_key_under_bf16_is_not_sent_to_fp16() -> None:
    with pytest.raises(ConfigError, match=r"^unknown key 'bf16.loss_scale'; bf16 trains without loss scaling .*"
                                          r"remove it \(fp16.loss_scale applies to fp16 runs only\)$"):
        load_config({"train_batch_size": 8, "bf16": {"enabled": True, "loss_scale": 0}})
