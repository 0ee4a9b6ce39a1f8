"""Hugging Face <-> our checkpoint conversion, checked against transformers itself.

A tiny LlamaForCausalLM (GQA, untied, vocabulary not a multiple of 128) and a tiny
GPT2LMHeadModel (tied, biases, learned positions) are built from configs in fp32,
saved, converted to our checkpoint and loaded -- with the printed command line --
into our model at one rank and at TP=2 x PP=2. The import pads the vocabulary (100 tokens) as
Megatron does at the target tp (256 rows at tp 2), the padding rows drawn as Megatron initialises
them; both runs pad to 128 rows (--make-vocab-size-divisible-by 64: the load drops rows 128-255,
saying so). Logits over the real vocabulary match transformers' within 1e-5, and the loss, whose
softmax spans the padding as Megatron's does, matches transformers' model given the same 28
padding rows. Converting back strips the padding (saying so) and gives every original tensor bit
for bit, and transformers loads the result.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.training.arguments.parser import GPT_DEFAULTS, LLAMA_DEFAULTS, parse_run_config
from megatron.training.checkpoint import checkpoint_to_load, load_checkpoint
from megatron.training.trainer import Trainer
from tests.distributed import run_distributed
from tools.checkpoint.convert import canonical_source
from tools.checkpoint.convert import main as convert

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

SEQ, VOCAB = 16, 100
PADDED = 128  # --make-vocab-size-divisible-by 64 at tp 1 and tp 2


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=False,
        rms_norm_eps=1e-6,
    )
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=SEQ,
        activation_function="gelu",
        attn_pdrop=0.0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


MODELS = {"llama": _llama, "gpt2": _gpt2}


def _samples():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, SEQ + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def _hf_reference(model):
    """(logits, mean token loss) of transformers on the test tokens."""
    inputs, labels = _samples()
    with torch.no_grad():
        logits = model.eval()(inputs).logits
    return logits, F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)).item()


def _with_padding(model, ours: str):
    """The transformers model given the checkpoint's first PADDED vocabulary rows (Megatron's padding
    after the real ones), in its embedding and, untied, its output layer."""
    source = canonical_source(ours)
    names = [n for n in ("embedding.word_embeddings.weight", "output_layer.weight") if n in source.saved]
    rows = {name: tensor[:PADDED] for name, tensor in source.read(names).items()}
    model.resize_token_embeddings(PADDED)
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(rows[names[0]])
        model.get_output_embeddings().weight.copy_(rows[names[-1]])
    return model


def _converted(family: str, tmp_path, tp: int = 1, pp: int = 1):
    """Save a fresh HF model, convert it; returns (model, HF dir, our dir, printed command line)."""
    torch.manual_seed(0)
    model = MODELS[family]()
    hf_dir, ours = str(tmp_path / f"{family}_hf"), str(tmp_path / f"{family}_ours")
    model.save_pretrained(hf_dir)
    assert (
        convert(
            [
                "--loader",
                "hf",
                "--saver",
                "canonical",
                "--load-dir",
                hf_dir,
                "--save-dir",
                ours,
                "--target-tensor-parallel-size",
                str(tp),
                "--target-pipeline-parallel-size",
                str(pp),
            ]
        )
        == 0
    )
    return model, hf_dir, ours


def _printed_command(capsys) -> list[str]:
    line = capsys.readouterr().out.strip().splitlines()[-1].split()
    return line


def _evaluate(rank: int, script: str, flags: list[str]):
    """Load the converted checkpoint with the printed flags; (loss of one step on the test tokens,
    full logits on a one-rank run)."""
    defaults = LLAMA_DEFAULTS if script == "pretrain_llama.py" else GPT_DEFAULTS
    argv = flags + [
        "--micro-batch-size",
        "2",
        "--global-batch-size",
        "4",
        "--train-iters",
        "1",
        "--mock-data",
        "--lr",
        "0",
    ]
    run = parse_run_config(argv, defaults, dist.get_world_size())
    trainer = Trainer(run, torch.device("cpu"))
    load_checkpoint(checkpoint_to_load(run), trainer, run.checkpoint)
    inputs, labels = _samples()
    trainer.dataset = [{"tokens": t, "labels": lab, "loss_mask": torch.ones(SEQ)} for t, lab in zip(inputs, labels)]
    logits = None
    if dist.get_world_size() == 1:
        module = trainer.chunks[0].module.eval()
        with torch.no_grad():
            logits = module(inputs)
    loss, *_ = trainer.forward_backward(1)
    return loss, logits


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_hf_to_ours_matches_transformers_and_back_is_identical(family, tmp_path, capsys):
    model, hf_dir, ours = _converted(family, tmp_path, tp=2, pp=2)
    out, err = capsys.readouterr()
    assert f"> note: {hf_dir}: vocabulary rows 100..255 are not in the checkpoint (100 rows;" in err, err
    command = out.strip().splitlines()[-1].split()
    script, flags = command[0], command[1:] + ["--make-vocab-size-divisible-by", "64"]
    assert flags[flags.index("--tensor-model-parallel-size") + 1] == "2"
    hf_logits, _ = _hf_reference(model)
    _, hf_loss = _hf_reference(_with_padding(copy.deepcopy(model), ours))

    one = flags.copy()
    one[one.index("--tensor-model-parallel-size") + 1] = "1"
    one[one.index("--pipeline-model-parallel-size") + 1] = "1"
    loss, logits = run_distributed(1, _evaluate, script, one)[0]
    torch.testing.assert_close(logits, hf_logits, atol=1e-5, rtol=0)
    assert abs(loss - hf_loss) < 1e-5, (loss, hf_loss)
    losses = [r[0] for r in run_distributed(4, _evaluate, script, flags)]
    assert all(abs(loss - hf_loss) < 1e-5 for loss in losses), (losses, hf_loss)

    back = str(tmp_path / f"{family}_back")
    assert convert(["--loader", "canonical", "--saver", "hf", "--load-dir", ours, "--save-dir", back]) == 0
    assert "> note: vocabulary rows 100..255 (Megatron's padding) not exported" in capsys.readouterr().err
    original = safetensors_torch.load_file(os.path.join(hf_dir, "model.safetensors"))
    with open(os.path.join(back, "model.safetensors.index.json")) as handle:
        index = json.load(handle)["weight_map"]
    restored = {}
    for file in set(index.values()):
        restored.update(safetensors_torch.load_file(os.path.join(back, file)))
    assert set(restored) == set(original), set(restored) ^ set(original)
    for name, tensor in original.items():
        assert torch.equal(restored[name], tensor), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(back)
    torch.testing.assert_close(_hf_reference(reloaded)[0], hf_logits, atol=0, rtol=0)


def test_bad_conversion_inputs_are_one_line_errors(tmp_path, capsys):
    _, hf_dir, _ = _converted("llama", tmp_path)
    capsys.readouterr()
    # 2 query groups do not split over tp 4
    assert (
        convert(
            [
                "--loader",
                "hf",
                "--saver",
                "canonical",
                "--load-dir",
                hf_dir,
                "--save-dir",
                str(tmp_path / "x"),
                "--target-tensor-parallel-size",
                "4",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--num-query-groups (2)" in err, err
    assert (
        convert(
            [
                "--loader",
                "hf",
                "--saver",
                "canonical",
                "--load-dir",
                hf_dir,
                "--save-dir",
                str(tmp_path / "x"),
                "--target-pipeline-parallel-size",
                "3",
            ]
        )
        == 2
    )
    assert "--num-layers (2)" in capsys.readouterr().err
    with open(os.path.join(hf_dir, "config.json")) as handle:
        config = json.load(handle)
    config["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "rope_theta": 10000.0}
    with open(os.path.join(hf_dir, "config.json"), "w") as handle:
        json.dump(config, handle)
    assert (
        convert(["--loader", "hf", "--saver", "canonical", "--load-dir", hf_dir, "--save-dir", str(tmp_path / "y")])
        == 2
    )
    assert "rope_type 'yarn': only default and llama3" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "y")
    assert (
        convert(
            ["--loader", "canonical", "--saver", "hf", "--load-dir", str(tmp_path), "--save-dir", str(tmp_path / "z")]
        )
        == 2
    )
    assert "no checkpoint" in capsys.readouterr().err


def test_printed_command_parses(tmp_path, capsys):
    _converted("gpt2", tmp_path)
    command = _printed_command(capsys)
    assert command[0] == "pretrain_gpt.py"
    run = parse_run_config(
        command[1:] + ["--micro-batch-size", "1", "--train-iters", "1", "--mock-data"], GPT_DEFAULTS, 1
    )
    assert run.model.num_layers == 2 and not run.model.untie_embeddings_and_output_weights
