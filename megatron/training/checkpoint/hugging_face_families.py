"""Which Hugging Face family converts a model: by config.json's model_type on import, by our model args on export."""

from __future__ import annotations

from megatron.training.checkpoint.hugging_face import GPT2, ConfigError, Llama
from megatron.training.checkpoint.hugging_face_moe import KINDS, MoE

FAMILIES = {"llama": Llama, "mistral": Llama, "qwen2": Llama, "qwen3": Llama, "gpt2": GPT2} | dict.fromkeys(KINDS, MoE)


def family_of(cfg: dict):
    """The family of an HF config.json (by model_type), or ConfigError naming what is supported."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def family_of_args(args: dict):
    """Our checkpoint's family for export: MoE with experts, GPT-2 with learned positions, else Llama."""
    if args.get("num_moe_experts") is not None:
        return MoE
    return GPT2 if args["position_embedding_type"] == "learned_absolute" else Llama
