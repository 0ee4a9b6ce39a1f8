"""--reset-position-ids and --reset-attention-mask: each document of a packed sample gives the
logits it gives alone; every layout reproduces one rank on the shipped corpus with the flags
on; what is not built is refused with one line naming the flag."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from megatron.core.models.gpt_model import GPTModel
from megatron.core.tensor_parallel.initialization import initialize_parameters
from megatron.core.tensor_parallel.random import RNGTracker
from megatron.training.arguments.parser import GPT_DEFAULTS, parse_run_config
from megatron.training.datasets import build_run_datasets
from tests.cli import run_cli
from tests.distributed import run_distributed
from tests.parallel.layouts import model_flags
from tests.parallel.test_data_training import MODEL, TOKENIZER, train_on_corpus

BOTH = ["--reset-position-ids", "--reset-attention-mask"]
ROPE = [
    "--position-embedding-type",
    "rope",
    "--normalization",
    "RMSNorm",
    "--swiglu",
    "--group-query-attention",
    "--num-query-groups",
    "2",
]
LONGER = ["--seq-length", "64"]  # more document boundaries inside samples
PACKINGS = [[5, 7, 4], [9, 7]]  # document lengths of the two samples of the batch (16 tokens each)


def _packed_sample_against_documents_alone(rank, model):
    defaults, argv = model_flags(model, [])
    config = parse_run_config(argv, defaults, 1).model
    net = GPTModel(config, tp_group=dist.group.WORLD, rng_tracker=RNGTracker("cpu", 0))
    initialize_parameters(net, 1234)
    net.eval()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(config.vocab_size, (len(PACKINGS), config.seq_length), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in PACKINGS])
    documents = torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)]) for lengths in PACKINGS])
    with torch.no_grad():
        packed = net(tokens, position_ids=positions, document_ids=documents)
        for row, lengths in enumerate(PACKINGS):
            for start, n in zip(np.cumsum([0] + lengths[:-1]), lengths):
                alone = tokens[row].roll(-int(start))[None]  # the document, then the rest of the row
                expected = net(alone)[0, :n]
                torch.testing.assert_close(packed[row, start : start + n], expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(packed, net(tokens)), "the flags change the logits"


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_each_document_of_a_packed_sample_gives_its_logits_alone(model):
    """The oracle needs neither flag: a document alone at the start of a sample, followed by
    anything, has its logits under the plain causal mask and positions 0, 1, ..."""
    run_distributed(1, _packed_sample_against_documents_alone, model)


LAYOUTS = {
    "dp2": [],
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2-v2": ["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"],
}
CP2 = ["--context-parallel-size", "2"]
# (name, flags, world-2 layouts): the document mask is not built for context parallelism
RUNS = [
    (f"{model}-{flags_name}-{layout}", model_flags + LONGER + flags, extra)
    for model, model_flags in (("gpt", []), ("rope", ROPE))
    for flags_name, flags, layouts in (("both", BOTH, LAYOUTS), ("positions", ["--reset-position-ids"], {"cp2": CP2}))
    for layout, extra in layouts.items()
]


def _documents_per_sample(rank, prefix):
    """Mean documents in the first 24 training samples (3 iterations x 8): boundaries are exercised."""
    run = parse_run_config(MODEL + TOKENIZER + LONGER + BOTH + ["--data-path", prefix], GPT_DEFAULTS, 1)
    train = build_run_datasets(run)[0]
    return float(np.mean([train[i]["document_ids"].max().item() + 1 for i in range(24)]))


def test_layouts_reproduce_one_rank_with_the_flags_on_the_corpus(corpus):
    assert run_distributed(1, _documents_per_sample, corpus)[0] > 1.2
    reference_flags = sorted({tuple(flags) for _, flags, _ in RUNS} | {tuple(LONGER), tuple(ROPE + LONGER)})
    references = dict(
        zip(reference_flags, run_distributed(1, train_on_corpus, corpus, [list(flags) for flags in reference_flags])[0])
    )
    for family in ([], ROPE):
        plain = references[tuple(family + LONGER)]["losses"]
        assert not np.allclose(references[tuple(family + LONGER + BOTH)]["losses"], plain)
    per_rank = run_distributed(2, train_on_corpus, corpus, [flags + extra for _, flags, extra in RUNS])
    for index, (name, flags, _) in enumerate(RUNS):
        reference = references[tuple(flags)]
        for rank, runs in enumerate(per_rank):
            got = runs[index]
            np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5, err_msg=f"{name} rank {rank}")
            assert abs(got["valid"] - reference["valid"]) <= 1e-5 * reference["valid"], (name, rank)


def _error(argv) -> str:
    with pytest.raises(ValueError) as failure:
        parse_run_config(MODEL + argv, GPT_DEFAULTS, 2)
    return str(failure.value)


def test_what_is_not_built_is_refused_by_name(corpus):
    data = TOKENIZER + ["--data-path", corpus]
    assert _error(data + ["--reset-attention-mask", "--attention-backend", "triton"]) == (
        "--reset-attention-mask needs --attention-backend auto or torch: the Triton flash kernel has no "
        "document boundaries"
    )
    assert _error(data + ["--reset-attention-mask"] + CP2) == (
        "--reset-attention-mask is not supported with --context-parallel-size > 1; leave one out"
    )
    for flag in BOTH:
        assert (
            _error(["--mock-data", "--vocab-size", "10", flag])
            == f"{flag} needs --data-path: mock data has no documents"
        )


def test_cli_trains_with_both_flags_and_logs_the_attention_path(corpus):
    out = run_cli("pretrain_gpt.py", MODEL + TOKENIZER + BOTH + ["--data-path", corpus, "--log-interval", "1"])
    assert out.returncode == 0, out.stderr[-2000:]
    assert "attention torch scaled_dot_product_attention with a document mask (--reset-attention-mask)" in out.stdout
