"""The estimate follows the model code: an option added to the modules only shows up in it.

A test-only option (every transformer layer normalises its output once more) is patched into
TransformerLayer, nothing in megatron/planning/ changes, and the estimate grows by that
norm's weight and by what it saves for backward; on CPU the traced bytes equal the bytes a
real forward of the patched model saves.
"""

import dataclasses

import pytest
import torch

from megatron.core.models.gpt_model import GPTModel
from megatron.core.pipeline_parallel.executor import StepStats
from megatron.core.transformer.config import TransformerConfig
from megatron.core.transformer.layer import TransformerLayer
from megatron.core.transformer.norm import Norm
from megatron.planning import MemoryLayout, estimate_memory, trace
from megatron.planning.fake_dist import FakeGroup, fake_collectives
from megatron.planning.trace import trace_cache_clear

B, S, H, LAYERS = 2, 32, 64, 2
LLAMA = TransformerConfig(
    num_layers=LAYERS,
    hidden_size=H,
    ffn_hidden_size=128,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    seq_length=S,
    normalization="RMSNorm",
    position_embedding_type="rope",
    swiglu=True,
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    attention_dropout=0.0,
    hidden_dropout=0.0,
    params_dtype=torch.bfloat16,
)


@pytest.fixture
def extra_norm(monkeypatch):
    """Patch the option into the model; the traces cached before and after it describe other code."""
    init, forward = TransformerLayer.__init__, TransformerLayer.forward

    def patched_init(self, config, **kwargs):
        init(self, config, **kwargs)
        self.extra_norm = Norm(config, config.hidden_size, kwargs.get("device"))

    def patched_forward(self, x, *args):
        return self.extra_norm(forward(self, x, *args))

    def patch():
        trace_cache_clear()
        monkeypatch.setattr(TransformerLayer, "__init__", patched_init)
        monkeypatch.setattr(TransformerLayer, "forward", patched_forward)

    trace_cache_clear()
    yield patch
    monkeypatch.undo()
    trace_cache_clear()


def _rank(device_type: str):
    layout = MemoryLayout(micro_batch_size=B, device_type=device_type)
    return estimate_memory(LLAMA, layout).ranks[0]


def _measured_saved_bytes() -> int:
    """Unique storages a real CPU forward of one microbatch saves, parameters excluded, the loss
    accounted as the pipeline executor does (tools/bench/estimator_accuracy.py's rule)."""
    with fake_collectives():
        model = GPTModel(LLAMA, tp_group=FakeGroup(1), rng_tracker=None)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    for p in model.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tokens = torch.randint(0, LLAMA.vocab_size, (B, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fake_collectives():
        StepStats.zeros("cpu").add_loss(model(tokens, torch.randint(0, LLAMA.vocab_size, (B, S))), torch.ones(B, S))
    return sum(saved.values())


def test_an_option_added_to_the_model_only_shows_up_in_the_estimate(extra_norm):
    before_cuda, before_cpu = _rank("cuda"), _rank("cpu")
    assert before_cpu.activations_bytes == _measured_saved_bytes()
    extra_norm()
    after_cuda, after_cpu = _rank("cuda"), _rank("cpu")
    for before, after in ((before_cuda, after_cuda), (before_cpu, after_cpu)):
        assert after.parameters - before.parameters == LAYERS * H  # one RMSNorm weight per layer
    # CUDA, Triton norm: the norm keeps its input (the layer's sum, a new storage) and its fp32 rstd;
    # its output takes the old output's place as the next norm's saved input
    rows = S * B
    assert after_cuda.activations_bytes - before_cuda.activations_bytes == LAYERS * (rows * H * 2 + rows * 4)
    # CPU: the torch reference's fp32 copies (input, normalised input, weight) and rstd, as a real forward saves
    assert after_cpu.activations_bytes > before_cpu.activations_bytes
    assert after_cpu.activations_bytes == _measured_saved_bytes()


@pytest.mark.parametrize("keep_angles", [False, True])
def test_chunks_composed_from_pieces_equal_one_trace_of_the_chunk(monkeypatch, keep_angles):
    """A chunk adds up one-layer pieces; tracing its three layers at once gives the same bytes, also
    when every layer keeps the rotary angles the block hands it (one storage, counted once)."""
    if keep_angles:
        forward = TransformerLayer.forward

        def keeping_angles(self, x, angles=None, mask=None):
            return forward(self, x, angles, mask) * angles[:, :, 0, :1]  # mul keeps a view of the angles

        monkeypatch.setattr(TransformerLayer, "forward", keeping_angles)
    trace_cache_clear()
    config = dataclasses.replace(LLAMA, params_dtype=torch.float32)
    setting = trace.Setting(1, 1, B, "cpu", "flash")
    whole = trace._trace(trace.config_key(config), setting, "layers", (False,) * 3)
    assert (whole.block_inputs_bytes > 0) == keep_angles
    expected = (
        trace._residual_bytes(config, setting)
        + whole.own_bytes
        + whole.block_inputs_bytes
        + (whole.output_bytes if whole.output_saved else 0)
    )
    assert trace.chunk_saved(config, setting, False, False, range(3)).bytes == expected
    trace_cache_clear()
