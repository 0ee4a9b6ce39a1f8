"""Megatron's --use-tp-pp-dp-mapping and --init-method-xavier-uniform reproduce one process.

The alternative rank order only renumbers ranks, so TP=2 x PP=2 x DP=2 on 8 ranks with it gives
the one-process losses, grad norm, gradients and initial weights (GPT: tied embeddings, whose
embedding group now joins ranks 2 apart). Xavier-uniform weights are drawn per tile of the full
tensor, so TP=2 and PP=2 start from exactly the one-process weights and reproduce its run. The trainer,
which initialises every parameter in its place in the gradient buffers, starts from the values
an eagerly built and initialised model holds (GPT with learned positions and Llama, replicated
and with sharded parameters).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron.core.tensor_parallel.initialization import xavier_bound
from tests.distributed import run_distributed
from tests.parallel.layouts import assert_matches_one_process, train_many

TP2 = ["--tensor-model-parallel-size", "2"]
PP2 = ["--pipeline-model-parallel-size", "2"]
XAVIER = ["--init-method-xavier-uniform"]
TP_PP_DP = ["--use-tp-pp-dp-mapping"]

# name -> (world size, model, flags); "one-process" runs are the references
RUNS = {
    "one-process": (1, "gpt", []),
    "one-process-xavier-gpt": (1, "gpt", XAVIER),
    "one-process-xavier-llama": (1, "llama", XAVIER),
    "tp2-xavier-gpt": (2, "gpt", XAVIER + TP2),
    "tp2-xavier-llama": (2, "llama", XAVIER + TP2),
    "pp2-xavier-gpt": (2, "gpt", XAVIER + PP2),
    "pp2-xavier-llama": (2, "llama", XAVIER + PP2),
    "tp2-pp2-dp2-tp-pp-dp-gpt": (8, "gpt", TP_PP_DP + TP2 + PP2),
}
CASES = {  # layout -> its one-process reference
    "tp2-xavier-gpt": "one-process-xavier-gpt",
    "tp2-xavier-llama": "one-process-xavier-llama",
    "pp2-xavier-gpt": "one-process-xavier-gpt",
    "pp2-xavier-llama": "one-process-xavier-llama",
    "tp2-pp2-dp2-tp-pp-dp-gpt": "one-process",
}


@pytest.fixture(scope="module")
def results():
    """One process group per world size runs every layout of that size."""
    out = {}
    for world in sorted({w for w, _, _ in RUNS.values()}):
        names = [name for name, (w, _, _) in RUNS.items() if w == world]
        per_rank = run_distributed(world, train_many, [RUNS[name][1:] for name in names])
        for index, name in enumerate(names):
            out[name] = [rank_results[index] for rank_results in per_rank]
    return out


@pytest.mark.parametrize("layout", list(CASES))
def test_layout_matches_one_process(results, layout):
    assert_matches_one_process(results[layout], results[CASES[layout]][0])


def test_tp_pp_dp_mapping_places_pipeline_stages_two_ranks_apart(results):
    """With the flag rank = tp + 2 pp + 4 dp: ranks 2, 3, 6, 7 hold the last stage (layers 2 and 3),
    where the default order would put it on ranks 4 to 7."""
    for rank, out in enumerate(results["tp2-pp2-dp2-tp-pp-dp-gpt"]):
        layers = {int(name.split(".")[2]) for name in out["grads"] if name.startswith("decoder.layers.")}
        assert layers == ({2, 3} if (rank // 2) % 2 else {0, 1}), rank


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_xavier_uniform_draws_every_weight_matrix(results, model):
    """Every matrix (QKV, projection, fc1, fc2, word and position embeddings, untied output layer) is
    uniform within its full tensor's Xavier bound and fills it; vectors keep their constants; the
    run trains differently from the normal initialisation."""
    initial = results[f"one-process-xavier-{model}"][0]["initial"]
    matrices = {name: (weight, spec) for name, (weight, spec) in initial.items() if weight.dim() == 2}
    assert any("embedding" in name for name in matrices) and any("fc2" in name for name in matrices)
    for name, (weight, spec) in matrices.items():
        bound = xavier_bound(spec)
        rows = spec.real_rows or spec.full_shape[0]
        assert spec.kind == "xavier_uniform" and bound == math.sqrt(6.0 / (rows + spec.full_shape[1])), name
        assert 0.9 * bound < weight.abs().max().item() <= bound * (1 + 1e-6), name
        padding = weight[rows:]  # Megatron's vocabulary padding: drawn like the other rows
        assert padding.numel() == 0 or 0 < padding.abs().min() <= padding.abs().max() <= bound * (1 + 1e-6), name
    for name, (weight, spec) in initial.items():
        if weight.dim() == 1:
            assert spec.kind in ("zeros", "ones"), name
    if model == "gpt":
        assert results["one-process-xavier-gpt"][0]["losses"] != results["one-process"][0]["losses"]


def _trainer_and_eager_weights(rank: int) -> list[tuple[str, bool]]:
    """The trainer initialises each parameter in its buffer (deferred); a model built eagerly and
    initialised by `initialize_parameters` must hold the very same values, whatever the strategy."""
    from megatron.core.models.stages import build_model_chunks
    from megatron.core.tensor_parallel.initialization import initialize_parameters
    from tests.parallel.layouts import build_trainer

    out = []
    for model in ("gpt", "llama"):
        for flags in ([], ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params"]):
            trainer = build_trainer(model, flags)  # GPT: learned absolute positions
            trainer.optimizer.finish_param_sync()
            run = trainer.run
            eager = build_model_chunks(run.model, trainer.mesh, run.parallel.virtual_stages, run.training.seed)
            for module in eager:
                initialize_parameters(module, run.training.seed)
            built = dict(p for m in eager for p in m.named_parameters())
            out += [
                (name, torch.equal(p, built[name]))
                for chunk in trainer.chunks
                for name, p in chunk.module.named_parameters()
            ]
    return out


def test_trainer_initialises_as_an_eagerly_built_model():
    for name, equal in run_distributed(1, _trainer_and_eager_weights)[0]:
        assert equal, f"{name}: initialised in its buffer differs from the eagerly built model"
