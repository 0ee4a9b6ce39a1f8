"""Hugging Face MoE models through the converter: Mixtral, Qwen2-MoE (shared expert with gate, top-k weights not
renormalised, a dense first layer) and Qwen3-MoE (query/key norms, renormalised top-3) saved by transformers,
converted to our checkpoint, loaded with the printed command line: transformers' logits (1e-5); converted back:
every tensor bit-identical and the config's MoE keys unchanged."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.distributed import run_distributed
from tests.unit.test_hf_convert import _evaluate, _samples
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

COMMON = dict(
    vocab_size=100,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=16,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MODELS = {
    "mixtral": lambda: transformers.MixtralForCausalLM(
        transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)
    ),
    "qwen2_moe": lambda: transformers.Qwen2MoeForCausalLM(
        transformers.Qwen2MoeConfig(
            **COMMON,
            intermediate_size=64,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=False,
            mlp_only_layers=[0],
        )
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(
        transformers.Qwen3MoeConfig(
            **COMMON, head_dim=8, moe_intermediate_size=24, num_experts=8, num_experts_per_tok=3, norm_topk_prob=True
        )
    ),
}
MOE_KEYS = (
    "num_local_experts",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "intermediate_size",
    "shared_expert_intermediate_size",
    "mlp_only_layers",
    "decoder_sparse_step",
)


@pytest.mark.parametrize("family", list(MODELS))
def test_hf_moe_to_ours_matches_transformers_and_back_is_identical(family, tmp_path, capsys):
    torch.manual_seed(0)
    model = MODELS[family]()
    with torch.no_grad():
        for p in model.parameters():  # transformers leaves some MoE tensors unset at construction
            p.normal_(0.0, 0.1)
    hf_dir, ours, back = (str(tmp_path / name) for name in ("hf", "ours", "back"))
    model.save_pretrained(hf_dir)
    assert convert(["--loader", "hf", "--saver", "canonical", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert "--num-experts" in command
    inputs, _ = _samples()
    with torch.no_grad():
        expected = model.eval()(inputs).logits
    _, logits = run_distributed(1, _evaluate, command[0], command[1:])[0]
    diff = (logits - expected).abs().max().item()
    print(f"{family}: max abs logit diff vs transformers {diff:.2e}")
    assert diff <= 1e-5, diff

    assert convert(["--loader", "canonical", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    original = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    index = json.load(open(os.path.join(back, "model.safetensors.index.json")))["weight_map"]
    restored = {}
    for file in set(index.values()):
        restored.update(safetensors_torch.load_file(os.path.join(back, file)))
    assert restored.keys() == original.keys(), original.keys() ^ restored.keys()
    assert all(torch.equal(restored[name], original[name]) for name in original)
    saved, exported = (transformers.AutoConfig.from_pretrained(d) for d in (hf_dir, back))
    assert exported.model_type == saved.model_type == family
    differing = [(k, getattr(saved, k, None), getattr(exported, k, None)) for k in MOE_KEYS]
    assert all(a == b for _, a, b in differing), differing
