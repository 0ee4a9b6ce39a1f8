"""Hugging Face Llama (and Mistral-style GQA) and GPT-2 <-> our canonical tensors.

Each family is a config mapping (HF config.json <-> our model flags) and a list of
rules: one canonical tensor, the HF tensors it is made of, and the transforms both
ways. Conventions handled here:
- QKV: HF keeps q_proj / k_proj / v_proj (GPT-2: c_attn = [q; k; v]); ours is one
  tensor with rows per query group [q heads of group g, k_g, v_g] (see
  megatron/core/checkpointing/pieces.py).
- Rotary: HF Llama's q/k rows already follow the rotate-half convention, which
  megatron/core/transformer/rotary.py uses too, so no row permutation is needed.
- GPT-2's Conv1D weights are stored [in, out]: transposed to our [out, in].
- SwiGLU: gate_proj and up_proj stack as our linear_fc1 = [gate; up].
- Tied embeddings: stored once (HF lm_head is absent or equal to the embedding).
- Vocabulary: HF tensors are unpadded, like our canonical form.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


def to_grouped_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """[q heads; k heads; v heads] rows (head-major) -> our per-group rows. Weights or biases."""
    rest = q.shape[1:]
    return torch.cat([t.reshape(groups, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def from_grouped_qkv(qkv: torch.Tensor, groups: int, heads: int, head_dim: int) -> list[torch.Tensor]:
    """Our per-group QKV rows -> [q, k, v] with head-major rows."""
    rest = qkv.shape[1:]
    per_group = qkv.reshape(groups, -1, *rest)
    q, k, v = per_group.split([heads // groups * head_dim, head_dim, head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


@dataclass(frozen=True)
class Rule:
    """Canonical tensor `ours` = to_ours(HF tensors `hf`); the HF tensors = to_hf(ours)."""

    ours: str
    hf: tuple[str, ...]
    to_ours: Callable[..., torch.Tensor] = lambda t: t
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]] = lambda t: [t]


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous()


def _stack(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat(tensors, dim=0)


def _halves(t: torch.Tensor) -> list[torch.Tensor]:
    return [c.contiguous() for c in t.chunk(2, dim=0)]


class ConfigError(ValueError):
    """A Hugging Face config this framework cannot represent (one line)."""


class Llama:
    name = "llama"
    architecture = "LlamaForCausalLM"

    @staticmethod
    def model_args(cfg: dict) -> dict:
        rope = cfg.get("rope_parameters") or {}
        if cfg.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ConfigError(f"rope scaling {cfg.get('rope_scaling') or rope} is not supported (plain RoPE only)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) is supported")
        if cfg.get("sliding_window") and cfg["sliding_window"] < cfg["max_position_embeddings"]:
            raise ConfigError(f"sliding_window {cfg['sliding_window']}: only full causal attention is supported")
        if bool(cfg.get("attention_bias")) != bool(cfg.get("mlp_bias")):
            raise ConfigError("attention_bias and mlp_bias differ; --disable-bias-linear covers both")
        heads = cfg["num_attention_heads"]
        return dict(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                    ffn_hidden_size=cfg["intermediate_size"], num_attention_heads=heads,
                    num_query_groups=cfg.get("num_key_value_heads") or heads,
                    kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab_size=cfg["vocab_size"],
                    position_embedding_type="rope", max_position_embeddings=cfg["max_position_embeddings"],
                    normalization="RMSNorm", swiglu=True, add_bias_linear=bool(cfg.get("attention_bias")),
                    untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
                    norm_epsilon=cfg["rms_norm_eps"], rotary_base=rope.get("rope_theta", cfg.get("rope_theta", 1e4)),
                    seq_length=cfg["max_position_embeddings"], init_method_std=cfg.get("initializer_range", 0.02),
                    attention_dropout=cfg.get("attention_dropout", 0.0), hidden_dropout=0.0)

    @staticmethod
    def hf_config(args: dict) -> dict:
        return dict(architectures=[Llama.architecture], model_type="llama", num_hidden_layers=args["num_layers"],
                    hidden_size=args["hidden_size"], intermediate_size=args["ffn_hidden_size"],
                    num_attention_heads=args["num_attention_heads"], num_key_value_heads=args["num_query_groups"],
                    head_dim=args["kv_channels"], vocab_size=args["vocab_size"],
                    max_position_embeddings=args["max_position_embeddings"], rms_norm_eps=args["norm_epsilon"],
                    rope_theta=args["rotary_base"], attention_bias=args["add_bias_linear"],
                    mlp_bias=args["add_bias_linear"], hidden_act="silu",
                    tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
                    initializer_range=args["init_method_std"], torch_dtype="float32")

    @staticmethod
    def rules(args: dict, prefix: str = "") -> list[Rule]:
        groups, heads, d = args["num_query_groups"], args["num_attention_heads"], args["kv_channels"]
        qkv = dict(to_ours=lambda q, k, v: to_grouped_qkv(q, k, v, groups),
                   to_hf=lambda t: from_grouped_qkv(t, groups, heads, d))
        swiglu = dict(to_ours=_stack, to_hf=_halves)
        rules = [Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
                 Rule("decoder.final_layernorm.weight", ("model.norm.weight",))]
        if args["untie_embeddings_and_output_weights"]:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
        kinds = ("weight", "bias") if args["add_bias_linear"] else ("weight",)
        for i in range(args["num_layers"]):
            ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
            rules += [Rule(ours + "input_layernorm.weight", (hf + "input_layernorm.weight",)),
                      Rule(ours + "pre_mlp_layernorm.weight", (hf + "post_attention_layernorm.weight",))]
            for kind in kinds:
                rules += [
                    Rule(ours + f"self_attention.linear_qkv.{kind}",
                         tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"), **qkv),
                    Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"self_attn.o_proj.{kind}",)),
                    Rule(ours + f"mlp.linear_fc1.{kind}", (hf + f"mlp.gate_proj.{kind}", hf + f"mlp.up_proj.{kind}"),
                         **swiglu),
                    Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.down_proj.{kind}",)),
                ]
        return rules


class GPT2:
    name = "gpt2"
    architecture = "GPT2LMHeadModel"

    @staticmethod
    def model_args(cfg: dict) -> dict:
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"activation_function {activation!r}: only GELU is supported")
        hidden, heads = cfg["n_embd"], cfg["n_head"]
        return dict(num_layers=cfg["n_layer"], hidden_size=hidden, ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
                    num_attention_heads=heads, num_query_groups=heads, kv_channels=hidden // heads,
                    vocab_size=cfg["vocab_size"], position_embedding_type="learned_absolute",
                    max_position_embeddings=cfg["n_positions"], normalization="LayerNorm", swiglu=False,
                    add_bias_linear=True, untie_embeddings_and_output_weights=False,
                    norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5), rotary_base=10000.0,
                    seq_length=cfg["n_positions"], init_method_std=cfg.get("initializer_range", 0.02),
                    attention_dropout=cfg.get("attn_pdrop", 0.1), hidden_dropout=cfg.get("resid_pdrop", 0.1))

    @staticmethod
    def approximation_note(cfg: dict) -> str | None:
        activation = cfg.get("activation_function", "gelu_new")
        if activation == "gelu":
            return None
        return (f"note: config.json has activation_function {activation!r} (tanh approximation); this framework's "
                "GELU is exact (erf), so logits differ slightly (about 1e-3)")

    @staticmethod
    def hf_config(args: dict) -> dict:
        if args["position_embedding_type"] != "learned_absolute" or args["normalization"] != "LayerNorm" \
                or args["swiglu"] or not args["add_bias_linear"] or args["untie_embeddings_and_output_weights"] \
                or args["num_query_groups"] != args["num_attention_heads"] \
                or args["kv_channels"] * args["num_attention_heads"] != args["hidden_size"]:
            raise ConfigError("learned positions, but not GPT-2's architecture (LayerNorm, GELU, biases, tied "
                              "embeddings, no GQA): no Hugging Face family to export to")
        return dict(architectures=[GPT2.architecture], model_type="gpt2", n_layer=args["num_layers"],
                    n_embd=args["hidden_size"], n_inner=args["ffn_hidden_size"], n_head=args["num_attention_heads"],
                    vocab_size=args["vocab_size"], n_positions=args["max_position_embeddings"],
                    layer_norm_epsilon=args["norm_epsilon"], activation_function="gelu",
                    initializer_range=args["init_method_std"], tie_word_embeddings=True, torch_dtype="float32")

    @staticmethod
    def rules(args: dict, prefix: str = "transformer.") -> list[Rule]:
        heads = args["num_attention_heads"]
        d = args["kv_channels"]

        def qkv_to_ours(weight_or_bias):
            q, k, v = (_transpose(weight_or_bias) if weight_or_bias.dim() == 2 else weight_or_bias).chunk(3, dim=0)
            return to_grouped_qkv(q, k, v, heads)

        def qkv_to_hf(t):
            stacked = torch.cat(from_grouped_qkv(t, heads, heads, d), dim=0)
            return [_transpose(stacked) if stacked.dim() == 2 else stacked]

        conv = dict(to_ours=_transpose, to_hf=lambda t: [_transpose(t)])
        rules = [Rule("embedding.word_embeddings.weight", (prefix + "wte.weight",)),
                 Rule("embedding.position_embeddings.weight", (prefix + "wpe.weight",)),
                 Rule("decoder.final_layernorm.weight", (prefix + "ln_f.weight",)),
                 Rule("decoder.final_layernorm.bias", (prefix + "ln_f.bias",))]
        for i in range(args["num_layers"]):
            ours, hf = f"decoder.layers.{i}.", f"{prefix}h.{i}."
            for kind in ("weight", "bias"):
                transposed = conv if kind == "weight" else {}
                rules += [
                    Rule(ours + f"input_layernorm.{kind}", (hf + f"ln_1.{kind}",)),
                    Rule(ours + f"pre_mlp_layernorm.{kind}", (hf + f"ln_2.{kind}",)),
                    Rule(ours + f"self_attention.linear_qkv.{kind}", (hf + f"attn.c_attn.{kind}",),
                         to_ours=qkv_to_ours, to_hf=qkv_to_hf),
                    Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"attn.c_proj.{kind}",), **transposed),
                    Rule(ours + f"mlp.linear_fc1.{kind}", (hf + f"mlp.c_fc.{kind}",), **transposed),
                    Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.c_proj.{kind}",), **transposed),
                ]
        return rules


FAMILIES = {"llama": Llama, "mistral": Llama, "gpt2": GPT2}


def family_of(cfg: dict):
    """The family of an HF config.json (by model_type), or ConfigError naming what is supported."""
    model_type = cfg.get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(f"model_type {model_type!r} is not supported (supported: {', '.join(FAMILIES)})")
    return FAMILIES[model_type]


def family_of_args(args: dict):
    """Our checkpoint's family for export: GPT-2 when learned positions, else Llama."""
    return GPT2 if args["position_embedding_type"] == "learned_absolute" else Llama
