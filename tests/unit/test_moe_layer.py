"""The MoE layer against megatron-core's MoELayer, from the same weights and inputs.

Each case builds our MoELayer (one rank), then megatron-core 0.16.1's (its own environment,
tests/mcore_oracle/moe_driver.py) with our weights and expert bias, runs forward and backward in training
mode on the same input and output gradient with the same auxiliary-loss backward scale, and compares the
output, the input gradient, every weight gradient (the auxiliary losses' included), the logged aux / z losses
and the expert bias after one update, within 1e-5. Cases: Mixtral-like routers (softmax top-2, aux loss,
z-loss) dropless and capacity-limited (both drop policies, padded), a top-1 pre-softmax router, and
DeepSeek-like routers (sigmoid, expert bias, group-limited top-k, scaling factor, per-sequence aux loss,
shared expert with and without gate) dropless and capacity-limited; both dispatchers.
"""

from __future__ import annotations

import pytest
import torch

from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.moe.aux_losses import set_aux_loss_scale
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.router import update_expert_biases
from tests.distributed import run_distributed
from tests.mcore_oracle.oracle import megatron_core_python, run_moe_oracle

TOL = 1e-5
SEQ, BATCH, HIDDEN = 16, 2, 32
SHAPE = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64, init_method_std=0.02)
MIXTRAL = dict(
    swiglu=True,
    num_moe_experts=8,
    moe_router_topk=2,
    moe_aux_loss_coeff=1e-2,
    moe_z_loss_coeff=1e-3,
    moe_ffn_hidden_size=48,
)
DEEPSEEK = dict(
    swiglu=True,
    num_moe_experts=8,
    moe_router_topk=4,
    moe_ffn_hidden_size=24,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_bias_update_rate=1e-2,
    moe_router_num_groups=4,
    moe_router_group_topk=2,
    moe_router_topk_scaling_factor=2.5,
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-3,
    moe_shared_expert_intermediate_size=40,
    moe_router_dtype="fp32",
)
CASES = {
    "mixtral_dropless_allgather": MIXTRAL,
    "mixtral_capacity_probs_alltoall": MIXTRAL
    | dict(moe_expert_capacity_factor=1.0, moe_token_dispatcher_type="alltoall"),
    "mixtral_capacity_position_padded": MIXTRAL
    | dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
    "top1_pre_softmax_gelu": dict(
        swiglu=False, num_moe_experts=4, moe_router_topk=1, moe_router_pre_softmax=True, moe_aux_loss_coeff=1e-2
    ),
    "deepseek_dropless_gated_shared": DEEPSEEK | dict(moe_shared_expert_gate=True),
    "deepseek_capacity_alltoall": DEEPSEEK
    | dict(
        moe_expert_capacity_factor=1.25,
        moe_token_dispatcher_type="alltoall",
        moe_router_load_balancing_type="aux_loss",
        moe_z_loss_coeff=1e-3,
    ),
}


def _ours(rank: int, directory: str) -> dict:
    results = {}
    for k, (name, moe) in enumerate(CASES.items()):
        config = TransformerConfig(
            **SHAPE,
            **moe,
            vocab_size=100,
            seq_length=SEQ,
            add_bias_linear=False,
            normalization="RMSNorm",
            attention_dropout=0.0,
            hidden_dropout=0.0,
        )
        torch.manual_seed(k)
        layer = MoELayer(config, tp_group=torch.distributed.group.WORLD)
        with torch.no_grad():
            for p in layer.parameters():
                p.normal_(0.0, 0.1)
            if layer.router.expert_bias is not None:
                layer.router.expert_bias.normal_(0.0, 0.05)
        torch.save(layer.state_dict(), f"{directory}/{name}_state.pt")
        inputs = {"x": torch.randn(SEQ, BATCH, HIDDEN), "grad": torch.randn(SEQ, BATCH, HIDDEN), "scale": 0.5}
        torch.save(inputs, f"{directory}/{name}_inputs.pt")
        layer.train()
        set_aux_loss_scale([layer], inputs["scale"])
        x = inputs["x"].clone().requires_grad_(True)
        y = layer(x)
        y.backward(inputs["grad"])
        result = {
            "y": y.detach(),
            "x_grad": x.grad,
            "grads": {n: p.grad for n, p in layer.named_parameters()},
            "logged": {n: float(v) for n, v in layer.router.tracked_losses.items()},
        }
        if config.moe_router_enable_expert_bias:
            update_expert_biases([layer], None, config.moe_router_bias_update_rate)
            result["expert_bias"] = layer.router.expert_bias.clone()
        results[name] = result
    return results


def _mcore_config(moe: dict) -> dict:
    return SHAPE | moe


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def test_moe_layer_equals_megatron_core(tmp_path):
    megatron_core_python()
    ours = run_distributed(1, _ours, str(tmp_path))[0]
    cases = [
        {
            "config": _mcore_config(moe),
            "state": str(tmp_path / f"{name}_state.pt"),
            "inputs": str(tmp_path / f"{name}_inputs.pt"),
            "out": str(tmp_path / f"{name}_out.pt"),
        }
        for name, moe in CASES.items()
    ]
    run_moe_oracle(cases, tmp_path)
    for name in CASES:
        mine, theirs = ours[name], torch.load(tmp_path / f"{name}_out.pt")
        diffs = {"y": _max_diff(mine["y"], theirs["y"]), "x_grad": _max_diff(mine["x_grad"], theirs["x_grad"])}
        assert set(mine["grads"]) == set(theirs["grads"]), (name, set(mine["grads"]) ^ set(theirs["grads"]))
        for param, grad in mine["grads"].items():
            diffs[param] = _max_diff(grad, theirs["grads"][param])
        assert mine["logged"].keys() == theirs["logged"].keys(), (name, mine["logged"], theirs["logged"])
        for loss, value in mine["logged"].items():
            diffs[loss] = abs(value - theirs["logged"][loss])
        if "expert_bias" in theirs:
            diffs["expert_bias"] = _max_diff(mine["expert_bias"], theirs["expert_bias"])
        worst = max(diffs, key=diffs.get)
        print(f"{name}: max abs diff {diffs[worst]:.2e} ({worst})")
        assert diffs[worst] <= TOL, (name, worst, diffs[worst])
        # the routing is not trivial: some expert got no gradient would hide a dropped path
        assert all(g.abs().sum() > 0 for g in mine["grads"].values()), name


@pytest.mark.parametrize(
    "moe, message",
    [
        (dict(num_moe_experts=4, moe_router_topk=5), "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
        (dict(num_moe_experts=4, moe_router_score_function="relu"), "--moe-router-score-function must be one of"),
        (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
        (dict(num_moe_experts=4, moe_router_enable_expert_bias=True), "needs --moe-router-score-function sigmoid"),
        (dict(num_moe_experts=4, moe_router_topk=1), "needs --moe-router-pre-softmax"),
        (dict(num_moe_experts=6, moe_router_num_groups=4, moe_router_group_topk=2), "divisible by --moe-router-num"),
        (dict(num_moe_experts=4, moe_router_num_groups=2), "needs both --moe-router-num-groups and"),
        (dict(num_moe_experts=4, moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0"),
        (dict(num_moe_experts=4, moe_layer_freq=[1, 0, 1]), "one 0 or 1 per layer"),
        (dict(num_moe_experts=4, moe_router_load_balancing_type="sinkhorn"), "sinkhorn and global_aux_loss are not"),
        (dict(num_moe_experts=4, moe_shared_expert_gate=True), "--moe-shared-expert-gate needs"),
        (dict(num_moe_experts=6, expert_model_parallel_size=4), "must be divisible by --expert-model-parallel-size"),
    ],
)
def test_bad_moe_config_is_one_line(moe, message):
    with pytest.raises(ValueError) as info:
        TransformerConfig(
            **(SHAPE | {"num_layers": 2}), vocab_size=100, seq_length=SEQ, add_bias_linear=False, swiglu=True, **moe
        )
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


# --- the whole model against transformers' MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE) from the same weights ---

HF_COMMON = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def _hf_models():
    transformers = pytest.importorskip("transformers")
    return {
        "mixtral": transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **HF_COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6
            )
        ),
        "qwen2_moe": transformers.Qwen2MoeForCausalLM(
            transformers.Qwen2MoeConfig(
                **HF_COMMON,
                intermediate_size=64,
                moe_intermediate_size=24,
                shared_expert_intermediate_size=40,
                num_experts=8,
                num_experts_per_tok=2,
                norm_topk_prob=False,
                mlp_only_layers=[0],
            )
        ),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(
            transformers.Qwen3MoeConfig(
                **HF_COMMON,
                head_dim=8,
                intermediate_size=64,
                moe_intermediate_size=24,
                num_experts=8,
                num_experts_per_tok=3,
                norm_topk_prob=True,
            )
        ),
    }


def _our_config(family: str, hf) -> TransformerConfig:
    c = hf.config
    moe = dict(num_moe_experts=getattr(c, "num_local_experts", None) or c.num_experts)
    moe.update(moe_router_topk=c.num_experts_per_tok, moe_ffn_hidden_size=getattr(c, "moe_intermediate_size", None))
    if family == "qwen2_moe":
        moe.update(
            moe_router_pre_softmax=True,  # softmax over all experts, the top-k weights not renormalised
            moe_shared_expert_intermediate_size=c.shared_expert_intermediate_size,
            moe_shared_expert_gate=True,
            moe_layer_freq=[0 if i in c.mlp_only_layers else 1 for i in range(c.num_hidden_layers)],
        )
    rope = c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta
    return TransformerConfig(
        num_layers=c.num_hidden_layers,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_query_groups=c.num_key_value_heads,
        kv_channels=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        seq_length=SEQ,
        position_embedding_type="rope",
        rotary_base=rope,
        normalization="RMSNorm",
        norm_epsilon=c.rms_norm_eps,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=family == "qwen2_moe",
        qk_layernorm=family == "qwen3_moe",
        untie_embeddings_and_output_weights=True,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        make_vocab_size_divisible_by=4,
        **moe,
    )


def _our_weights(hf, config: TransformerConfig) -> dict:
    """transformers' tensors under our names (its experts are stored fused: gate_up_proj [E, 2f, h] = our
    linear_fc1 [gate; up] of each expert, down_proj [E, h, f] = linear_fc2)."""
    from megatron.training.checkpoint.hugging_face import to_grouped_qkv

    sd = hf.state_dict()
    ours = {
        "embedding.word_embeddings.weight": sd["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": sd["model.norm.weight"],
        "output_layer.weight": sd["lm_head.weight"],
    }
    for i in range(config.num_layers):
        o, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        ours[o + "input_layernorm.weight"] = sd[h + "input_layernorm.weight"]
        ours[o + "pre_mlp_layernorm.weight"] = sd[h + "post_attention_layernorm.weight"]
        kinds = ("weight", "bias") if config.add_qkv_bias else ("weight",)
        for kind in kinds:
            qkv = [sd[h + f"self_attn.{p}_proj.{kind}"] for p in "qkv"]
            ours[o + f"self_attention.linear_qkv.{kind}"] = to_grouped_qkv(*qkv, config.num_query_groups)
        ours[o + "self_attention.linear_proj.weight"] = sd[h + "self_attn.o_proj.weight"]
        if config.qk_layernorm:
            for p in "qk":
                ours[o + f"self_attention.{p}_layernorm.weight"] = sd[h + f"self_attn.{p}_norm.weight"]
        if not config.is_moe_layer(i):
            ours[o + "mlp.linear_fc1.weight"] = torch.cat(
                [sd[h + "mlp.gate_proj.weight"], sd[h + "mlp.up_proj.weight"]]
            )
            ours[o + "mlp.linear_fc2.weight"] = sd[h + "mlp.down_proj.weight"]
            continue
        ours[o + "mlp.router.weight"] = sd[h + "mlp.gate.weight"]
        for e in range(config.num_moe_experts):
            ours[o + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] = sd[h + "mlp.experts.gate_up_proj"][e]
            ours[o + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] = sd[h + "mlp.experts.down_proj"][e]
        if config.moe_shared_expert_intermediate_size is not None:
            s = h + "mlp.shared_expert."
            ours[o + "mlp.shared_experts.linear_fc1.weight"] = torch.cat(
                [sd[s + "gate_proj.weight"], sd[s + "up_proj.weight"]]
            )
            ours[o + "mlp.shared_experts.linear_fc2.weight"] = sd[s + "down_proj.weight"]
            ours[o + "mlp.shared_experts.gate_weight"] = sd[h + "mlp.shared_expert_gate.weight"]
    return ours


def _our_logits(rank: int, configs: dict, weights: dict, tokens: torch.Tensor) -> dict:
    from megatron.core.models.gpt_model import GPTModel
    from megatron.core.tensor_parallel.random import RNGTracker

    logits = {}
    for family, config in configs.items():
        model = GPTModel(
            config,
            tp_group=torch.distributed.group.WORLD,
            rng_tracker=RNGTracker("cpu", 0, stage=0, cp_rank=0, tp_rank=0),
        )
        model.load_state_dict(weights[family], strict=True)
        model.eval()
        with torch.no_grad():
            logits[family] = model(tokens)
    return logits


def test_gpt_model_with_moe_layers_equals_transformers():
    models = _hf_models()
    torch.manual_seed(0)
    tokens = torch.randint(0, HF_COMMON["vocab_size"], (BATCH, SEQ))
    configs, weights, expected = {}, {}, {}
    for family, hf in models.items():
        with torch.no_grad():
            for p in hf.parameters():  # transformers leaves some MoE tensors unset at construction
                p.normal_(0.0, 0.1)
        hf.eval()
        configs[family] = _our_config(family, hf)
        weights[family] = _our_weights(hf, configs[family])
        with torch.no_grad():
            expected[family] = hf(tokens).logits
    ours = run_distributed(1, _our_logits, configs, weights, tokens)[0]
    for family in models:
        diff = _max_diff(ours[family], expected[family])
        print(f"{family}: max abs logit diff vs transformers {diff:.2e}")
        assert diff <= TOL, (family, diff)


TINY = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 2 --train-iters 1 "
TINY += "--mock-data --vocab-size 100"


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--moe-router-topk 3", "--moe-router-topk need --num-experts"),
        ("--num-experts 4 --moe-router-topk 5", "--moe-router-topk (5) must be between 1 and --num-experts (4)"),
        ("--num-experts 4 --moe-aux-loss-coeff 0.1 0.2", "--moe-aux-loss-coeff takes one value here"),
        ("--num-experts 4 --moe-layer-freq 'x'", "--moe-layer-freq"),
        ("--num-experts 4 --moe-token-dispatcher-type flex", "flex is not built"),
        ("--num-experts 4 --moe-enable-deepep", "MoE (an MoE option not built here"),
        ("--num-experts 6 --expert-model-parallel-size 4", "--num-experts (6) must be divisible by --expert-model"),
        ("--num-experts 8 --expert-model-parallel-size 8", "--expert-model-parallel-size (8) = 8 must divide tp x cp"),
        ("--expert-model-parallel-size 2", "--expert-model-parallel-size need --num-experts"),
        (
            "--num-experts 4 --save /x --ckpt-format torch_dist --use-distributed-optimizer --moe-grouped-gemm",
            "--ckpt-format torch_dist --use-distributed-optimizer with --moe-grouped-gemm",
        ),
        (
            "--num-experts 4 --save /x --ckpt-format torch_dist --use-distributed-optimizer "
            "--tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1",
            "with --expert-tensor-parallel-size 1 != --tensor-model-parallel-size 2 without expert parallelism",
        ),
    ],
)
def test_bad_moe_flags_are_one_line(flags, message):
    import shlex

    from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config

    with pytest.raises(ValueError) as info:
        parse_run_config(shlex.split(TINY + " " + flags), LLAMA_DEFAULTS, 4)
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_moe_flags_reach_the_config():
    import shlex

    from megatron.training.arguments.parser import LLAMA_DEFAULTS, parse_run_config

    flags = " --num-experts 8 --moe-layer-freq ([0]+[1]*1)*1 --moe-router-topk 3 --moe-z-loss-coeff 0.001"
    run = parse_run_config(shlex.split(TINY + flags), LLAMA_DEFAULTS, 1)
    assert run.model.moe_layer_freq == [0, 1] and run.model.moe_router_topk == 3 and run.model.moe_z_loss_coeff == 1e-3
    assert [run.model.is_moe_layer(i) for i in range(2)] == [False, True]


def test_flops_count_the_routed_experts():
    from megatron.core.transformer.flops import flops_per_iteration

    moe = dict(num_moe_experts=8, moe_router_topk=2, moe_ffn_hidden_size=16, moe_layer_freq=[0, 1])
    config = TransformerConfig(
        **(SHAPE | {"num_layers": 2}), vocab_size=128, seq_length=SEQ, add_bias_linear=False, swiglu=True, **moe
    )
    h, s, f = 32, SEQ, 64  # 4 heads of 8 channels, no GQA
    attention = h * 3 * h + h * h + 2 * s * h
    dense, routed = 3 * h * f, h * 8 + 3 * h * 2 * 16  # router + the 2 experts a token reaches
    per_token = 2 * (2 * attention + dense + routed + h * 128)
    assert flops_per_iteration(config, global_batch_size=3) == 3 * per_token * s * 3
