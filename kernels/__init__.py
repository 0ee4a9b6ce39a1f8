"""Fused Triton kernels, each with a plain torch reference of the same signature.

    from kernels.flash_attention import flash_attention, flash_attention_block, merge_attention_blocks
    from kernels.normalization import rms_norm, layer_norm

Every public op takes `impl` in {'auto', 'triton', 'torch'} (kernels/triton_support.py resolves it per
call); `kernels.dispatch.kernel_paths` says which path each op of a model runs. (The ops are not
re-exported here: `flash_attention` would shadow the submodule of the same name.)
"""
