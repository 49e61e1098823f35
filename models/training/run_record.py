"""What a training run records about itself: the model's description and the exact command for
``TRAINING.md``, and the tensors of the shipped file (bf16, the decay gates fp32). Shared by
``leapquant train`` on a corpus (``models.training.cli``) and on task rows (``models.training.task_cli``).
"""

from __future__ import annotations

import shlex

import ml_dtypes
import numpy as np

from models.export import to_hf_tensors

# Training-loss steps averaged for the report's final training loss.
TRAIN_LOSS_STEPS = 50
# Leaves exported in fp32, as the released checkpoints store them: the decay gates.
FP32_TENSOR_SUFFIXES = ("A_log", "dt_bias")


def describe_model(config, config_json: dict) -> dict:
    """Words and numbers for TRAINING.md's model table."""
    types = config.layer_types
    lin = [i for i, t in enumerate(types) if t == "linear_attention"]
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    if config.model_type.startswith("qwen"):
        return dict(
            description="Qwen3.5-style hybrid of Gated DeltaNet and gated full attention (3:1)",
            layout=f"{len(types)} layers; Gated DeltaNet at {lin}, gated full attention at {full}",
            linear=(f"Gated DeltaNet, {config.linear_num_key_heads} key heads and {config.linear_num_value_heads} "
                    f"value heads per layer (GVA), dk = {config.linear_key_head_dim}, dv = "
                    f"{config.linear_value_head_dim}, short convolution {config.linear_conv_kernel_dim}"),
            attention=(f"{config.num_attention_heads} query heads, {config.num_key_value_heads} KV heads, head dim "
                       f"{config.head_dim}, output gate, RoPE on {config.partial_rotary_factor:g} of each head"),
            mlp=f"dense SwiGLU, intermediate size {config.intermediate_size}",
        )
    return dict(
        description="Kimi-Linear-style hybrid of Kimi Delta Attention and multi-head latent attention (3:1)",
        layout=f"{len(types)} layers; KDA at {lin}, MLA at {full}",
        linear=(f"KDA, {config.kda_num_heads} heads per layer, dk = dv = {config.kda_head_dim}, per-channel decay, "
                f"short convolutions {config.kda_conv_kernel}"),
        attention=(f"MLA, {config.num_attention_heads} heads, kv_lora_rank {config.kv_lora_rank}, qk "
                   f"{config.qk_nope_head_dim} + {config.qk_rope_head_dim}, v {config.v_head_dim}, no RoPE "
                   f"(mla_use_nope)"),
        mlp=f"dense SwiGLU, intermediate size {config.intermediate_size}",
    )


def command_line(args) -> str:
    """The ``leapquant train`` command line that reproduces ``args`` (every flag given)."""
    parts = ["leapquant", "train", "--arch", args.arch] + (["--data", str(args.data)] if args.data is not None else [])
    parts += ["--out", str(args.out)]
    for flag in ("task", "task_vocab", "task_keys", "task_values", "task_needle_rows", "task_gap", "name", "size",
                 "state_dir", "minutes", "steps", "batch", "seq_len", "lr", "warmup", "weight_decay", "recall_fraction",
                 "recall_pairs", "recall_min_gap",
                 "recurrence", "chunk", "seed", "eval_every", "eval_windows", "final_eval_windows",
                 "spectrum_windows", "reserve_seconds"):
        value = getattr(args, flag)
        if value is not None:
            parts += ["--" + flag.replace("_", "-"), str(value)]
    for flag in ("task_fillers", "task_pairs", "task_spreads", "task_lengths"):  # lists
        if getattr(args, flag):
            parts += ["--" + flag.replace("_", "-")] + [str(x) for x in getattr(args, flag)]
    return " ".join(shlex.quote(p) for p in parts)


def export_tensors(config, params) -> dict:
    """HF tensors for the shipped file: bf16, except the decay gates (fp32)."""
    out = {}
    for name, x in to_hf_tensors(config, params).items():
        x = np.asarray(x, np.float32)
        out[name] = x if name.endswith(FP32_TENSOR_SUFFIXES) else x.astype(ml_dtypes.bfloat16)
    return out


__all__ = ["FP32_TENSOR_SUFFIXES", "TRAIN_LOSS_STEPS", "command_line", "describe_model", "export_tensors"]
