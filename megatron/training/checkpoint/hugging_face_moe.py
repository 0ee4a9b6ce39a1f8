"""Hugging Face MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) <-> our canonical tensors.

Attention, norms, embeddings and dense layers are Llama's (hf_formats.Llama: Mistral-style GQA, Qwen2's QKV
biases, Qwen3's query/key norms); MoE layers map as:
- router: HF `gate.weight` [E, h] = our `mlp.router.weight`;
- expert e: HF w1 / w3 / w2 (Mixtral) or gate_proj / up_proj / down_proj (Qwen) = our
  `mlp.experts.local_experts.<e>.linear_fc1` [gate; up] and `linear_fc2`;
- Qwen2-MoE's shared expert and its gate = our `mlp.shared_experts.linear_fc1/fc2` and `gate_weight`.
Routing: Mixtral and Qwen with `norm_topk_prob` renormalise the top-k softmax weights (our softmax over the
top-k logits, the same numbers); Qwen without it keeps them (our --moe-router-pre-softmax). Qwen's
`decoder_sparse_step` and `mlp_only_layers` become --moe-layer-freq's list.
"""

from __future__ import annotations

from megatron.training.checkpoint.hugging_face import ConfigError, Llama, Rule, _halves, _stack, refuse_unrepresented

# model_type -> (Llama's model_type for the attention variant, the MoE block's name, expert tensor names
# [gate, up, down])
KINDS = {
    "mixtral": ("mistral", "block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": ("qwen2", "mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": ("qwen3", "mlp", ("gate_proj", "up_proj", "down_proj")),
}
ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def _moe_layers(cfg: dict, layers: int) -> list[int]:
    """Qwen's layer pattern: MoE where (i + 1) is a multiple of decoder_sparse_step, but not mlp_only_layers."""
    step, dense = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or [])
    return [int((i + 1) % step == 0 and i not in dense) for i in range(layers)]


def _model_type(args: dict) -> str:
    """The HF architecture that has this model's variant (ConfigError when none does)."""
    if args.get("moe_shared_expert_intermediate_size") is not None:
        if not args.get("moe_shared_expert_gate") or args.get("qk_layernorm"):
            raise ConfigError(
                "--moe-shared-expert-intermediate-size: Hugging Face's Qwen2-MoE (the MoE family with a shared "
                "expert) has --moe-shared-expert-gate and no --qk-layernorm"
            )
        return "qwen2_moe"
    if args.get("qk_layernorm"):
        return "qwen3_moe"
    if args.get("add_qkv_bias"):
        raise ConfigError(
            "--add-qkv-bias without a shared expert or --qk-layernorm: Hugging Face's Mixtral has no biases"
        )
    if args.get("moe_router_pre_softmax") or args.get("moe_layer_freq", 1) != 1:
        raise ConfigError(
            "--moe-router-pre-softmax or --moe-layer-freq without a shared expert or --qk-layernorm: Hugging Face's "
            "Mixtral renormalises the top-k weights and has experts in every layer"
        )
    return "mixtral"


class MoE:
    """Mixtral, Qwen2-MoE and Qwen3-MoE (see the module docstring)."""

    name = "moe"
    requires = {**Llama.requires, "moe_router_score_function": "softmax"}
    represents = Llama.represents | {
        "num_moe_experts",
        "moe_ffn_hidden_size",
        "moe_router_topk",
        "moe_router_pre_softmax",
        "moe_layer_freq",
        "moe_shared_expert_intermediate_size",
        "moe_shared_expert_gate",
    }

    @staticmethod
    def model_args(cfg: dict) -> dict:
        model_type = cfg["model_type"]
        if cfg.get("router_jitter_noise"):
            raise ConfigError(f"router_jitter_noise {cfg['router_jitter_noise']}: routing without jitter only")
        attention, _, _ = KINDS[model_type]
        args = Llama.model_args({**cfg, "model_type": attention})
        layers = args["num_layers"]
        if model_type == "mixtral":
            experts, expert_ffn, pre_softmax, pattern = cfg["num_local_experts"], cfg["intermediate_size"], False, 1
        else:
            experts = cfg.get("num_experts", cfg.get("num_local_experts"))  # transformers 5 writes the latter
            expert_ffn = cfg["moe_intermediate_size"]
            pre_softmax = not cfg.get("norm_topk_prob", False)
            pattern = _moe_layers(cfg, layers)
            pattern = 1 if all(pattern) else pattern
        args.update(
            num_moe_experts=experts,
            moe_ffn_hidden_size=expert_ffn,
            moe_router_topk=cfg["num_experts_per_tok"],
            moe_router_pre_softmax=pre_softmax,
            moe_layer_freq=pattern,
        )
        if model_type == "qwen2_moe":
            args.update(
                moe_shared_expert_intermediate_size=cfg["shared_expert_intermediate_size"],
                moe_shared_expert_gate=True,
                add_qkv_bias=cfg.get("qkv_bias", True),
            )
        return args

    @staticmethod
    def hf_config(args: dict, dtype: str) -> dict:
        refuse_unrepresented(MoE, args)
        model_type = _model_type(args)
        config = Llama.attention_config(args, dtype)
        config.update(model_type=model_type, architectures=[ARCHITECTURES[model_type]])
        for key in ("attention_bias", "mlp_bias"):
            config.pop(key, None)
        layers, pattern = args["num_layers"], args["moe_layer_freq"]
        if model_type == "mixtral":
            config.update(
                num_local_experts=args["num_moe_experts"],
                intermediate_size=args["moe_ffn_hidden_size"],
                router_jitter_noise=0.0,
            )
        else:
            config.update(
                num_experts=args["num_moe_experts"],
                moe_intermediate_size=args["moe_ffn_hidden_size"],
                norm_topk_prob=not args["moe_router_pre_softmax"],
                decoder_sparse_step=1,
                mlp_only_layers=[] if pattern == 1 else [i for i in range(layers) if not pattern[i]],
            )
        if model_type == "qwen2_moe":
            config.update(
                shared_expert_intermediate_size=args["moe_shared_expert_intermediate_size"],
                qkv_bias=bool(args.get("add_qkv_bias")),
            )
        config["num_experts_per_tok"] = args["moe_router_topk"]
        return config

    @staticmethod
    def rules(args: dict, prefix: str = "") -> list[Rule]:
        model_type = _model_type(args)
        _, block, (gate, up, down) = KINDS[model_type]
        pattern = args["moe_layer_freq"]
        moe = [pattern == 1 or bool(pattern[i]) for i in range(args["num_layers"])]
        dense_mlp = {
            f"decoder.layers.{i}.mlp.{p}"
            for i in range(args["num_layers"])
            if moe[i]
            for p in ("linear_fc1.weight", "linear_fc2.weight")
        }
        rules = [rule for rule in Llama.rules(args, prefix) if rule.ours not in dense_mlp]
        for i in (i for i in range(args["num_layers"]) if moe[i]):
            ours, hf = f"decoder.layers.{i}.mlp.", f"model.layers.{i}.{block}."
            rules.append(Rule(ours + "router.weight", (hf + "gate.weight",)))
            for e in range(args["num_moe_experts"]):
                expert, theirs = ours + f"experts.local_experts.{e}.", hf + f"experts.{e}."
                rules += [
                    Rule(
                        expert + "linear_fc1.weight",
                        (theirs + f"{gate}.weight", theirs + f"{up}.weight"),
                        to_ours=_stack,
                        to_hf=_halves,
                    ),
                    Rule(expert + "linear_fc2.weight", (theirs + f"{down}.weight",)),
                ]
            if args.get("moe_shared_expert_intermediate_size") is not None:
                shared = hf + "shared_expert."
                rules += [
                    Rule(
                        ours + "shared_experts.linear_fc1.weight",
                        (shared + "gate_proj.weight", shared + "up_proj.weight"),
                        to_ours=_stack,
                        to_hf=_halves,
                    ),
                    Rule(ours + "shared_experts.linear_fc2.weight", (shared + "down_proj.weight",)),
                    Rule(ours + "shared_experts.gate_weight", (hf + "shared_expert_gate.weight",)),
                ]
        return rules
