"""megatron-core's unfused attention (--attention-backend local): the same attention as SDPA, in float64."""

import torch
import torch.nn.functional as F

from megatron.core.transformer.attention import document_mask, unfused_attention


def _sdpa(q, k, v, mask):
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
    return out.permute(2, 0, 1, 3)


def test_unfused_attention_is_causal_gqa_attention_with_or_without_documents():
    torch.manual_seed(0)
    s, b, h, g, d = 8, 2, 4, 2, 16
    q = torch.randn(s, b, h, d, dtype=torch.float64)
    k, v = (torch.randn(s, b, g, d, dtype=torch.float64) for _ in range(2))
    documents = document_mask(torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [0] * 8]))
    for mask in (None, documents):
        torch.testing.assert_close(unfused_attention(q, k, v, 0.0, mask), _sdpa(q, k, v, mask))
