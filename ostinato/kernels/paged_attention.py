"""Causal attention over a paged KV cache for any mix of prefill chunks and decodes."""

import torch
import torch.nn.functional as F

from ostinato.kernels.dispatch import use_triton


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, head_dim]
    v_cache: torch.Tensor,
    out: torch.Tensor,  # like q, written in place
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    block_table: torch.Tensor,  # int32 [num_reqs, max_blocks]
    scale: float,
) -> None:
    if use_triton(q):
        return _paged_attention_triton(
            q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale
        )
    return paged_attention_torch(
        q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale
    )


def paged_attention_torch(
    q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale
) -> None:
    """Reference: a host loop over requests (reads lengths on the host; never graph-captured)."""
    block_size = k_cache.shape[1]
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        q_start, q_end = starts[i], starts[i + 1]
        if q_end == q_start:
            continue
        blocks = block_table[i, : -(-seq_len // block_size)].long()
        keys = k_cache[blocks].flatten(0, 1)[:seq_len]
        values = v_cache[blocks].flatten(0, 1)[:seq_len]
        out[q_start:q_end] = causal_attention(q[q_start:q_end], keys, values, scale)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """q [n, H, D] are the last n positions of a sequence whose keys are k [s, KH, D]."""
    n, s = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    mask = torch.ones(n, s, dtype=torch.bool, device=q.device).tril(diagonal=s - n)
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return o.transpose(0, 1)


def _paged_attention_triton(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, scale):
    raise NotImplementedError("Triton paged_attention is being written (kernels issue)")
