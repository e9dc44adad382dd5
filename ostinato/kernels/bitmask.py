"""Structured outputs' token bitmask applied to the logits in place: a disallowed id's logit
becomes -inf (ostinato/structured/bitmask.py fills the mask).

rows [k] int32: the logits rows a grammar constrains; bits [k, words] int32: row i allows id t
when bit t % 32 of bits[i, t // 32] is set; ids from 32 * words on are never allowed. Other
logits rows keep every token. The kernel reads the packed words and writes only the -inf
entries, in one launch; expanding the bits in torch takes several launches and intermediates
32 times the mask's size."""

import torch
import triton
import triton.language as tl

from ostinato.kernels.dispatch import interpreting, jit, use_triton
from ostinato.kernels.launch import Launch

BLOCK = 1024  # ids per program


def apply_token_bitmask(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    """logits [rows, vocab] float, rows [k] and bits [k, words] int32, all on one device."""
    if rows.numel() == 0:
        return
    if use_triton(logits):
        return _apply_triton(logits, rows, bits)
    return apply_token_bitmask_torch(logits, rows, bits)


def apply_token_bitmask_torch(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    vocab = logits.shape[1]
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    allowed = ((bits[:, :, None] >> shifts) & 1).flatten(1)[:, :vocab].bool()
    keep = torch.zeros(len(rows), vocab, dtype=torch.bool, device=logits.device)
    keep[:, : allowed.shape[1]] = allowed
    index = rows.long()
    logits[index] = logits[index].masked_fill(~keep, float("-inf"))


@jit(do_not_specialize=["words"])  # one kernel for every tokenizer: start-up warms it
def _apply_kernel(logits_ptr, rows_ptr, bits_ptr, vocab, words, stride_logits,
                  BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0).to(tl.int64)
    ids = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    row = tl.load(rows_ptr + i).to(tl.int64)
    word = tl.load(bits_ptr + i * words + ids // 32, mask=ids < words * 32, other=0)
    banned = ((word >> (ids % 32)) & 1) == 0
    inf = tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty)
    tl.store(logits_ptr + row * stride_logits + ids, inf, mask=banned & (ids < vocab))


_launches: dict[tuple, Launch] = {}  # eager calls skip Triton's Python launch path


def _apply_triton(logits: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> None:
    assert logits.stride(1) == 1 and bits.is_contiguous()
    vocab, words = logits.shape[1], bits.shape[1]
    key = (vocab, words, logits.stride(0), interpreting())
    launch = _launches.get(key)
    if launch is None:
        launch = _launches[key] = Launch(
            _apply_kernel, (1, triton.cdiv(vocab, BLOCK), 1), num_head=3,
            tail=(vocab, words, logits.stride(0)), constexprs=dict(BLOCK=BLOCK),
        )  # fmt: skip
    launch.run((len(rows), launch.grid[1], 1), logits, rows, bits)
