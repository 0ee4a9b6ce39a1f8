"""Model variants survive checkpoints and Hugging Face export, or are refused by name.

For each variant flag a tiny model is saved with the flag (weights drawn at random, so
norm weights of --apply-layernorm-1p are not zero); then:
- resuming without the flag stops with one line naming it (positional fields: --finetune
  may change them, with a note);
- export to Hugging Face gives a model whose logits equal ours within 1e-5 in transformers
  (an architecture with the variant, or folded/reordered tensors), or is refused by the flag;
- exported models convert back to the same tensors (the importer reads rope_theta, llama3
  scaling, Qwen2's QKV biases and Qwen3's query/key norms).
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from megatron.core.checkpointing import CheckpointError, saved_tensors
from megatron.core.tensor_parallel.initialization import initialize_
from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint, save_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")

SEQ, VOCAB = 16, 100
LLAMA = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--group-query-attention",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "96",
]
GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4"]
COMMON = [
    "--seq-length",
    str(SEQ),
    "--micro-batch-size",
    "1",
    "--global-batch-size",
    "1",
    "--train-iters",
    "1",
    "--mock-data",
    "--vocab-size",
    str(VOCAB),
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]

# variant flags -> (model, Hugging Face model_type of the export, or the refusal naming the flag)
VARIANTS = {
    "qk-layernorm": ("llama", ["--qk-layernorm"], "qwen3"),
    "qk-layernorm-interleaved": ("llama", ["--qk-layernorm", "--rotary-interleaved"], "qwen3"),
    "add-qkv-bias": ("llama", ["--add-qkv-bias"], "qwen2"),
    "layernorm-1p": ("llama", ["--apply-layernorm-1p"], "llama"),
    "gpt-layernorm-1p": ("gpt", ["--apply-layernorm-1p"], "gpt2"),
    "rotary-interleaved": ("llama", ["--rotary-interleaved"], "llama"),
    "rotary-base": ("llama", ["--rotary-base", "500000"], "llama"),
    "rope-scaling": ("llama", ["--rope-scaling", "--rope-scaling-factor", "8", "--rotary-base", "500000"], "llama"),
    "rotary-percent": ("llama", ["--rotary-percent", "0.5"], "error: --rotary-percent 0.5: no Hugging Face llama"),
}


def _run(model: str, flags: list[str]):
    defaults, base = (LLAMA_DEFAULTS, LLAMA) if model == "llama" else (GPT_DEFAULTS, GPT)
    return parse_run_config(base + COMMON + flags, defaults, 1)


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _save_random_model(rank: int, model: str, flags: list[str], root: str) -> torch.Tensor:
    """Save a model with random weights; its logits on the test tokens."""
    trainer = Trainer(_run(model, flags), torch.device("cpu"))
    for name, param in trainer.chunks[0].module.named_parameters():
        initialize_(param.detach(), dataclasses.replace(param.init_spec, kind="normal", std=0.3), 5, name)
    save_checkpoint(root, 1, trainer)
    with torch.no_grad():
        return trainer.chunks[0].module.eval()(_tokens())


def _hf_logits(directory: str) -> torch.Tensor:
    hf = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    with torch.no_grad():
        return hf(_tokens()).logits


def _refusal(model: str, flags: list[str]) -> str:
    with pytest.raises(CheckpointError) as error:
        checkpoint_to_load(_run(model, flags))
    return str(error.value)


def _without(flags: list[str], flag: str) -> list[str]:
    """`flags` less `flag` and its value (if it takes one)."""
    at = flags.index(flag)
    takes_value = at + 1 < len(flags) and not flags[at + 1].startswith("--")
    return flags[:at] + flags[at + 1 + takes_value :]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_variant_resume_and_export(variant, tmp_path, capsys):
    model, flags, export = VARIANTS[variant]
    root, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    ours = run_distributed(1, _save_random_model, model, flags, root)[0]
    if model == "llama":
        ours = ours[..., :VOCAB]

    first = flags[0]
    refused = _refusal(model, _without(flags, first) + ["--load", root])
    assert refused.startswith(f"{root}/iter_0000001: saved with {first}"), refused
    if first in ("--rotary-base", "--rope-scaling"):  # context extension: a fine-tune may change them
        info = checkpoint_to_load(_run(model, _without(flags, first) + ["--load", root, "--finetune"]))
        expected = f"> note: --finetune changes how positions are encoded (saved with {first}"
        assert any(line.startswith(expected) for line in info.notes), info.notes

    status = convert(["--loader", "canonical", "--saver", "hf", "--load-dir", root, "--save-dir", hf_dir])
    err = capsys.readouterr().err.strip()
    if export.startswith("error:"):
        assert status == 2 and err.startswith(export) and len(err.splitlines()) == 1, err
        assert not os.path.exists(hf_dir)
        return
    assert status == 0, err
    with open(os.path.join(hf_dir, "config.json")) as handle:
        config = json.load(handle)
    assert config["model_type"] == export and config["dtype"] == "float32"
    torch.testing.assert_close(_hf_logits(hf_dir), ours, atol=1e-5, rtol=0)

    back = str(tmp_path / "back")
    assert convert(["--loader", "hf", "--saver", "canonical", "--load-dir", hf_dir, "--save-dir", back]) == 0
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    for flag in flags:
        if flag not in ("--apply-layernorm-1p", "--rotary-interleaved"):  # folded into the tensors on export
            assert flag in printed.split(), (flag, printed)
    before, after = saved_tensors(os.path.join(root, "iter_0000001")), saved_tensors(os.path.join(back, "iter_0000000"))
    assert {n for n in before if not n.startswith(("optimizer.", "rng."))} == set(after)


def _load_without_record(rank: int, root: str) -> str:
    run = _run("llama", ["--load", root, "--no-load-optim"])
    info = checkpoint_to_load(run)
    try:
        load_checkpoint(info, Trainer(run, torch.device("cpu")), run.checkpoint)
    except CheckpointError as error:
        return str(error)
    return "loaded"


def test_a_saved_tensor_is_never_dropped_even_without_a_record(tmp_path):
    """A checkpoint written before --qk-layernorm was recorded: the load still refuses to drop the
    query/key norm weights when the flag is left out."""
    root = str(tmp_path / "ckpt")
    run_distributed(1, _save_random_model, "llama", ["--qk-layernorm"], root)
    metadata = os.path.join(root, "iter_0000001", "metadata.json")
    with open(metadata) as handle:
        record = json.load(handle)
    del record["model"]["qk_layernorm"]
    with open(metadata, "w") as handle:
        json.dump(record, handle)
    message = run_distributed(1, _load_without_record, root)[0]
    assert message.startswith(
        f"{root}/iter_0000001: 4 saved model tensors have no place in the flags' model, "
        "e.g. decoder.layers.0.self_attention.k_layernorm.weight"
    ), message


def test_hf_llama_rope_theta_and_llama3_scaling_are_imported(tmp_path, capsys):
    """transformers' own Llama-3-style model (rope_theta 500000, llama3 scaling) -> ours: same logits."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    )
    hf_dir, ours = str(tmp_path / "hf"), str(tmp_path / "ours")
    transformers.LlamaForCausalLM(config).save_pretrained(hf_dir)
    assert convert(["--loader", "hf", "--saver", "canonical", "--load-dir", hf_dir, "--save-dir", ours]) == 0
    flags = capsys.readouterr().out.strip().splitlines()[-1].split()[1:]
    assert flags[flags.index("--rotary-base") + 1] == "500000" and "--rope-scaling" in flags
    logits = run_distributed(1, _converted_logits, flags)[0]
    torch.testing.assert_close(logits[..., :VOCAB], _hf_logits(hf_dir), atol=1e-5, rtol=0)


def _converted_logits(rank: int, flags: list[str]) -> torch.Tensor:
    run = parse_run_config(flags + ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data"], LLAMA_DEFAULTS, 1)
    trainer = Trainer(run, torch.device("cpu"))
    load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    with torch.no_grad():
        return trainer.chunks[0].module.eval()(_tokens())
