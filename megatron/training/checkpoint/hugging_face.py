"""Hugging Face Llama (with Mistral-style GQA, Qwen2's QKV biases, Qwen3's query/key norms) and
GPT-2 <-> our canonical tensors.

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
- Vocabulary: HF tensors hold the real vocabulary (config.vocab_size rows); ours hold
  Megatron's padded rows too. tools/checkpoint/convert.py strips them on export and pads on
  import (rows drawn as Megatron initialises padding).
- Model variants (megatron.core.transformer.model_fields): --apply-layernorm-1p is folded
  into the norm weights (1 + weight); --rotary-interleaved reorders each q/k head's
  channels to the halves HF rotates; rotary base and Llama-3.1 scaling are config keys;
  a field a family cannot represent (e.g. --rotary-percent < 1) is refused by its flag.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.model_fields import MODEL_FIELDS, RECORDED
from megatron.core.transformer.rotary import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT

# TransformerConfig's defaults: a field the exporting family does not represent must keep its default
FIELD_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(TransformerConfig) if f.default is not dataclasses.MISSING
}


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


def _plus_one(t: torch.Tensor) -> list[torch.Tensor]:
    """--apply-layernorm-1p weights (the norm scales by 1 + weight) as a plain norm's weight."""
    return [(t.float() + 1).to(t.dtype)]


def _minus_one(t: torch.Tensor) -> torch.Tensor:
    return (t.float() - 1).to(t.dtype)


def norm_rule(ours: str, hf: str, args: dict) -> Rule:
    """A norm weight; --apply-layernorm-1p is folded in on export (Hugging Face norms scale by the weight)."""
    if args.get("layernorm_zero_centered_gamma") and ours.endswith(".weight"):
        return Rule(ours, (hf,), to_ours=_minus_one, to_hf=_plus_one)
    return Rule(ours, (hf,))


def halves_order(head_dim: int) -> torch.Tensor:
    """Channel order that turns a head rotated in neighbour pairs (2i, 2i+1) (--rotary-interleaved) into
    one rotated in halves (i, i + d/2), as Hugging Face rotates: [0, 2, 4, .., 1, 3, 5, ..]."""
    return torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])


def permute_heads(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Reorder the rows (channels) of every head of a q or k projection (weight or bias) by `order`."""
    rest = t.shape[1:]
    return t.reshape(-1, len(order), *rest)[:, order].reshape(-1, *rest).contiguous()


def refuse_unrepresented(family, args: dict) -> None:
    """Every model field (megatron.core.transformer.model_fields) either has the value the family
    requires, is one the family represents, or keeps TransformerConfig's default; else one line
    naming the flag."""
    for field in MODEL_FIELDS:
        value = args.get(field.name, FIELD_DEFAULTS.get(field.name))
        if field.name in family.requires and value != family.requires[field.name]:
            raise ConfigError(
                f"{' '.join(field.command_line(value)) or 'without ' + field.flag}: the Hugging Face "
                f"{family.name} family needs {field.flag} {field.describe(family.requires[field.name])}"
            )
        if field.name in family.requires or field.name in family.represents or field.kind == RECORDED:
            continue
        if field.applies(args) and value != FIELD_DEFAULTS.get(field.name, value):
            raise ConfigError(
                f"{' '.join(field.command_line(value))}: no Hugging Face {family.name} counterpart, "
                "so the exported model would compute another function"
            )


class Llama:
    """Llama, with the variants Hugging Face keeps as their own architectures: QKV biases without
    other biases (Qwen2) and per-head query/key RMSNorm (Qwen3)."""

    name = "llama"
    architecture = "LlamaForCausalLM"
    requires = {"position_embedding_type": "rope", "normalization": "RMSNorm", "swiglu": True}
    represents = {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "max_position_embeddings",
        "add_bias_linear",
        "add_qkv_bias",
        "qk_layernorm",
        "untie_embeddings_and_output_weights",
        "layernorm_zero_centered_gamma",
        "norm_epsilon",
        "rotary_interleaved",
        "rotary_base",
        "rope_scaling",
        "rope_scaling_factor",
    }

    @staticmethod
    def _rope(cfg: dict) -> dict:
        """rotary_base and Llama-3.1 scaling from `rope_parameters` (transformers 5) or the older keys."""
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        base = rope.get("rope_theta", cfg.get("rope_theta", 1e4))
        kind = rope.get("rope_type", rope.get("type", "default"))
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError(
                f"partial_rotary_factor {cfg['partial_rotary_factor']}: Llama-family models rotate every channel here"
            )
        if kind == "default":
            return dict(rotary_base=base, rope_scaling=False)
        if kind != "llama3":
            raise ConfigError(f"rope_type {kind!r}: only default and llama3 rotary scaling are supported")
        ours = {
            "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
            "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
            "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT,
        }
        for key, value in ours.items():
            if rope.get(key, value) != value:
                raise ConfigError(f"rope scaling {key} {rope[key]}: only Llama-3.1's {value} is supported")
        return dict(rotary_base=base, rope_scaling=True, rope_scaling_factor=float(rope["factor"]))

    @staticmethod
    def model_args(cfg: dict) -> dict:
        if cfg.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {cfg['hidden_act']!r}: only silu (SwiGLU) is supported")
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
        if sliding and sliding < cfg["max_position_embeddings"]:
            raise ConfigError(f"sliding_window {sliding}: only full causal attention is supported")
        model_type = cfg.get("model_type")
        if model_type == "qwen2":  # biases on q, k and v only
            biases, qkv_bias = False, True
        elif model_type == "qwen3":
            if cfg.get("attention_bias"):
                raise ConfigError(
                    "attention_bias true in a Qwen3 config: biases on attention but not on the MLP "
                    "have no counterpart here"
                )
            biases, qkv_bias = False, False
        else:
            if bool(cfg.get("attention_bias")) != bool(cfg.get("mlp_bias")):
                raise ConfigError("attention_bias and mlp_bias differ; --disable-bias-linear covers both")
            biases, qkv_bias = bool(cfg.get("attention_bias")), False
        heads = cfg["num_attention_heads"]
        return dict(
            num_layers=cfg["num_hidden_layers"],
            hidden_size=cfg["hidden_size"],
            ffn_hidden_size=cfg["intermediate_size"],
            num_attention_heads=heads,
            num_query_groups=cfg.get("num_key_value_heads") or heads,
            kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            vocab_size=cfg["vocab_size"],
            position_embedding_type="rope",
            max_position_embeddings=cfg["max_position_embeddings"],
            normalization="RMSNorm",
            swiglu=True,
            add_bias_linear=biases,
            add_qkv_bias=qkv_bias,
            qk_layernorm=model_type == "qwen3",
            untie_embeddings_and_output_weights=not cfg.get("tie_word_embeddings", False),
            norm_epsilon=cfg["rms_norm_eps"],
            **Llama._rope(cfg),
            seq_length=cfg["max_position_embeddings"],
            init_method_std=cfg.get("initializer_range", 0.02),
            attention_dropout=cfg.get("attention_dropout", 0.0),
            hidden_dropout=0.0,
        )

    @staticmethod
    def _architecture(args: dict) -> tuple[str, str]:
        """(model_type, architecture) that has the model's attention variant."""
        if args.get("qk_layernorm"):
            if args.get("add_qkv_bias") or args["add_bias_linear"]:
                raise ConfigError(
                    "--qk-layernorm with linear biases: Hugging Face's Qwen3 (query/key norms) has "
                    "no biases in its MLP or on q/k/v alone"
                )
            return "qwen3", "Qwen3ForCausalLM"
        if args.get("add_qkv_bias") and not args["add_bias_linear"]:
            return "qwen2", "Qwen2ForCausalLM"
        return "llama", Llama.architecture

    @staticmethod
    def hf_config(args: dict, dtype: str) -> dict:
        refuse_unrepresented(Llama, args)
        return Llama.attention_config(args, dtype)

    @staticmethod
    def attention_config(args: dict, dtype: str) -> dict:
        """The config keys of the architecture, attention, norms and positions (also the MoE families')."""
        model_type, architecture = Llama._architecture(args)
        rope = {"rope_type": "default", "rope_theta": args["rotary_base"]}
        if args.get("rope_scaling"):
            rope.update(
                rope_type="llama3",
                factor=args["rope_scaling_factor"],
                low_freq_factor=LLAMA3_LOW_FREQ_FACTOR,
                high_freq_factor=LLAMA3_HIGH_FREQ_FACTOR,
                original_max_position_embeddings=LLAMA3_ORIGINAL_CONTEXT,
            )
        config = {field.hf_key: args[field.name] for field in MODEL_FIELDS if field.hf_key is not None}
        config.update(
            architectures=[architecture],
            model_type=model_type,
            rope_parameters=rope,
            hidden_act="silu",
            tie_word_embeddings=not args["untie_embeddings_and_output_weights"],
            dtype=dtype,
            torch_dtype=dtype,
        )
        if model_type == "qwen2":
            config.update(use_sliding_window=False, sliding_window=None)
        else:
            config.update(attention_bias=args["add_bias_linear"], mlp_bias=args["add_bias_linear"])
        return config

    @staticmethod
    def rules(args: dict, prefix: str = "") -> list[Rule]:
        groups, heads, d = args["num_query_groups"], args["num_attention_heads"], args["kv_channels"]
        order = halves_order(d) if args.get("rotary_interleaved") else None
        inverse = torch.argsort(order) if order is not None else None

        def qkv_to_hf(t):
            q, k, v = from_grouped_qkv(t, groups, heads, d)
            return [q, k, v] if order is None else [permute_heads(q, order), permute_heads(k, order), v]

        def qkv_to_ours(q, k, v):
            if inverse is not None:
                q, k = permute_heads(q, inverse), permute_heads(k, inverse)
            return to_grouped_qkv(q, k, v, groups)

        rules = [
            Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",)),
            norm_rule("decoder.final_layernorm.weight", "model.norm.weight", args),
        ]
        if args["untie_embeddings_and_output_weights"]:
            rules.append(Rule("output_layer.weight", ("lm_head.weight",)))
        linear_kinds = ("weight", "bias") if args["add_bias_linear"] else ("weight",)
        qkv_kinds = ("weight", "bias") if args["add_bias_linear"] or args.get("add_qkv_bias") else ("weight",)
        for i in range(args["num_layers"]):
            ours, hf = f"decoder.layers.{i}.", f"model.layers.{i}."
            rules += [
                norm_rule(ours + "input_layernorm.weight", hf + "input_layernorm.weight", args),
                norm_rule(ours + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight", args),
            ]
            if args.get("qk_layernorm"):
                for part in "qk":
                    rule = norm_rule(
                        ours + f"self_attention.{part}_layernorm.weight", hf + f"self_attn.{part}_norm.weight", args
                    )
                    if order is not None:  # a per-channel weight: its channels move with the head's
                        fold = rule.to_hf
                        rule = Rule(
                            rule.ours,
                            rule.hf,
                            to_ours=lambda t, f=rule.to_ours: f(t[inverse]),
                            to_hf=lambda t, f=fold: [x[order] for x in f(t)],
                        )
                    rules.append(rule)
            rules += [
                Rule(
                    ours + f"self_attention.linear_qkv.{kind}",
                    tuple(hf + f"self_attn.{p}_proj.{kind}" for p in "qkv"),
                    to_ours=qkv_to_ours,
                    to_hf=qkv_to_hf,
                )
                for kind in qkv_kinds
            ]
            for kind in linear_kinds:
                rules += [
                    Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"self_attn.o_proj.{kind}",)),
                    Rule(
                        ours + f"mlp.linear_fc1.{kind}",
                        (hf + f"mlp.gate_proj.{kind}", hf + f"mlp.up_proj.{kind}"),
                        to_ours=_stack,
                        to_hf=_halves,
                    ),
                    Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.down_proj.{kind}",)),
                ]
        return rules


class GPT2:
    name = "gpt2"
    architecture = "GPT2LMHeadModel"
    requires = {
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "swiglu": False,
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": False,
    }
    represents = {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "vocab_size",
        "max_position_embeddings",
        "add_qkv_bias",
        "layernorm_zero_centered_gamma",
        "norm_epsilon",
    }

    @staticmethod
    def model_args(cfg: dict) -> dict:
        activation = cfg.get("activation_function", "gelu_new")
        if activation not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ConfigError(f"activation_function {activation!r}: only GELU is supported")
        hidden, heads = cfg["n_embd"], cfg["n_head"]
        return dict(
            num_layers=cfg["n_layer"],
            hidden_size=hidden,
            ffn_hidden_size=cfg.get("n_inner") or 4 * hidden,
            num_attention_heads=heads,
            num_query_groups=heads,
            kv_channels=hidden // heads,
            vocab_size=cfg["vocab_size"],
            position_embedding_type="learned_absolute",
            max_position_embeddings=cfg["n_positions"],
            normalization="LayerNorm",
            swiglu=False,
            add_bias_linear=True,
            untie_embeddings_and_output_weights=False,
            norm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
            rotary_base=10000.0,
            seq_length=cfg["n_positions"],
            init_method_std=cfg.get("initializer_range", 0.02),
            attention_dropout=cfg.get("attn_pdrop", 0.1),
            hidden_dropout=cfg.get("resid_pdrop", 0.1),
        )

    @staticmethod
    def approximation_note(cfg: dict) -> str | None:
        activation = cfg.get("activation_function", "gelu_new")
        if activation == "gelu":
            return None
        return (
            f"note: config.json has activation_function {activation!r} (tanh approximation); this framework's "
            "GELU is exact (erf), so logits differ slightly (about 1e-3)"
        )

    @staticmethod
    def hf_config(args: dict, dtype: str) -> dict:
        refuse_unrepresented(GPT2, args)
        if (
            args["num_query_groups"] != args["num_attention_heads"]
            or args["kv_channels"] * args["num_attention_heads"] != args["hidden_size"]
        ):
            raise ConfigError(
                "grouped-query attention or --kv-channels x heads != --hidden-size: GPT-2 has "
                "neither, so there is no Hugging Face family to export to"
            )
        return dict(
            architectures=[GPT2.architecture],
            model_type="gpt2",
            n_layer=args["num_layers"],
            n_embd=args["hidden_size"],
            n_inner=args["ffn_hidden_size"],
            n_head=args["num_attention_heads"],
            vocab_size=args["vocab_size"],
            n_positions=args["max_position_embeddings"],
            layer_norm_epsilon=args["norm_epsilon"],
            activation_function="gelu",
            initializer_range=args["init_method_std"],
            tie_word_embeddings=True,
            dtype=dtype,
            torch_dtype=dtype,
        )

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
        rules = [
            Rule("embedding.word_embeddings.weight", (prefix + "wte.weight",)),
            Rule("embedding.position_embeddings.weight", (prefix + "wpe.weight",)),
            norm_rule("decoder.final_layernorm.weight", prefix + "ln_f.weight", args),
            Rule("decoder.final_layernorm.bias", (prefix + "ln_f.bias",)),
        ]
        for i in range(args["num_layers"]):
            ours, hf = f"decoder.layers.{i}.", f"{prefix}h.{i}."
            for kind in ("weight", "bias"):
                transposed = conv if kind == "weight" else {}
                rules += [
                    norm_rule(ours + f"input_layernorm.{kind}", hf + f"ln_1.{kind}", args),
                    norm_rule(ours + f"pre_mlp_layernorm.{kind}", hf + f"ln_2.{kind}", args),
                    Rule(
                        ours + f"self_attention.linear_qkv.{kind}",
                        (hf + f"attn.c_attn.{kind}",),
                        to_ours=qkv_to_ours,
                        to_hf=qkv_to_hf,
                    ),
                    Rule(ours + f"self_attention.linear_proj.{kind}", (hf + f"attn.c_proj.{kind}",), **transposed),
                    Rule(ours + f"mlp.linear_fc1.{kind}", (hf + f"mlp.c_fc.{kind}",), **transposed),
                    Rule(ours + f"mlp.linear_fc2.{kind}", (hf + f"mlp.c_proj.{kind}",), **transposed),
                ]
        return rules
