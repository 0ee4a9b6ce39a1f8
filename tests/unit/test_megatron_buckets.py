"""megatron-core's bucket layout rules (megatron_buckets.bucket_layout) on hand-made parameter lists; the
layout of real models is compared with megatron-core's own buffers in
tests/mcore_oracle/test_megatron_distributed_optimizer.py."""

from megatron.core.checkpointing.megatron_buckets import Bucket, bucket_layout, megatron_parameter_order


def test_reverse_order_alignment_padding_and_bucket_closing():
    params = [("a", 100), ("b", 10), ("c", 70)]
    # reversed: c at 0, b at 128 (the next multiple of 64), a at 192; one bucket padded to lcm(3, 128) = 384
    assert bucket_layout(params, dp_size=3) == [Bucket(384, 292, {"c": (0, 70), "b": (128, 138), "a": (192, 292)})]
    # a bucket closes after the parameter that reaches bucket_size; the next starts at the padded end
    assert bucket_layout(params, dp_size=2, bucket_size=70) == [
        Bucket(128, 70, {"c": (0, 70)}),
        Bucket(256, 164, {"b": (0, 10), "a": (64, 164)}),
    ]


def test_a_shared_embedding_gets_a_bucket_of_its_own():
    params = [("embedding.word_embeddings.weight", 50), ("decoder.layers.0.mlp.linear_fc2.weight", 30)]
    shared = frozenset({"embedding.word_embeddings.weight"})
    buckets = bucket_layout(params, dp_size=1, shared_embedding=shared)
    assert [b.params for b in buckets] == [
        {"decoder.layers.0.mlp.linear_fc2.weight": (0, 30)},
        {"embedding.word_embeddings.weight": (0, 50)},
    ]
    assert [(b.numel, b.numel_unpadded) for b in buckets] == [(128, 64), (128, 50)]


def test_parameter_order_is_the_local_specs():
    names = [
        "output_layer.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "embedding.word_embeddings.weight",
        "decoder.final_layernorm.weight",
    ]
    assert megatron_parameter_order(names) == [
        "embedding.word_embeddings.weight",
        "decoder.layers.0.self_attention.linear_proj.weight",
        "decoder.layers.0.self_attention.linear_qkv.weight",
        "decoder.layers.1.input_layernorm.weight",
        "decoder.final_layernorm.weight",
        "output_layer.weight",
    ]
