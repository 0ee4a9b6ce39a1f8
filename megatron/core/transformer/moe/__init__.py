"""Mixture of experts, after megatron-core: router, token dispatchers, experts, shared experts, the layer."""
