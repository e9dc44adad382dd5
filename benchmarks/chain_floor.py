"""The fastest a decode step can be as a chain of kernels: the weight bytes a step reads, read
by N kernels a decoder layer in one CUDA graph, each after the one before (PDL, every weight
load issued before the wait), against one read of all of them and the copy floor.

    PYTHONPATH=. python3 benchmarks/chain_floor.py --model random:qwen3-0.6b [--rows 1,32]
        [--weight-bytes 2] [--json FILE]

Chains, one CUDA graph each, timed over back-to-back replays:
- one: a read kernel over the whole step's bytes;
- layer: a read kernel a decoder layer, and the LM head's;
- weight: a read kernel a weight (qkv, o, gate|up, down; a MoE layer's router and its active
  experts' gate|up and down in place of the MLP's), and the LM head's;
- weight+3: the same with three one-program kernels a layer, standing for the small kernels
  of ostinato's batch-1 step (RoPE and the KV store, attention, the split KV's combine);
- cublas R: F.linear of R rows over every dense weight in the same order (torch._scaled_mm
  with row-wise scales and an FP8 x at --weight-bytes 1): the projections of an engine built
  on cuBLAS, nothing else;
- ours R: every dense weight as ostinato's decode step projects R rows (the small-batch
  kernel where it pays, else cuBLAS; FP8: fp8_linear).
The floor is the same bytes at the copy bandwidth, as `bench latency`'s (which adds the KV).
What a step does besides reading weights (attention's KV, norms, sampling) only adds to
these times, so a target below a chain's time is out of reach of a step of that many kernels.
"""

from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from bench_kernels import graph_seconds  # a sibling script: benchmarks/ is the script's path
from graph_launch import _bump_kernel

from ostinato.bench import copy_bandwidth
from ostinato.footprint import active_experts
from ostinato.kernels.fp8 import fp8_linear
from ostinato.kernels.gemv import gemv, gemv_pays
from ostinato.loader import load_hf_config

BLOCK = 1024  # int32 words a load: 16 bytes a thread of 8 warps
LOADS = 4  # loads a program, all issued before its wait


@triton.jit
def _read_kernel(w_ptr, out_ptr, n, BLOCK: tl.constexpr, LOADS: tl.constexpr):
    """Sums (so nothing is dropped) BLOCK * LOADS int32 words from its program's offset; the
    loads go out before the wait for the kernel before, as ostinato's GEMV's first chunk."""
    base = tl.program_id(0).to(tl.int64) * BLOCK * LOADS
    i = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.int32)
    for c in tl.static_range(LOADS):
        offs = base + c * BLOCK + i
        acc += tl.load(w_ptr + offs, mask=offs < n, other=0)
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit
def _dot_kernel(x_ptr, w_ptr, out_ptr, M, N, K, span, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, SWAP: tl.constexpr):  # fmt: skip
    """x [M, K] (M <= ROWS) @ w[tile's BLOCK_N rows].T over K span `span` of split
    program_id(1), in fp32 to out[split] (the splits' sum is left out: a probe of the weight
    stream). SWAP: w_tile @ x.T (the weight rows fill the tensor cores' M side), else
    x @ w_tile.T (x's few rows padded to ROWS there)."""
    tile, split = tl.program_id(0), tl.program_id(1)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    r = tl.arange(0, ROWS)
    k = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    x_rows = x_ptr + r[:, None] * K
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N, ROWS], tl.float32) if SWAP else tl.zeros([ROWS, BLOCK_N], tl.float32)
    k_lo = split * span
    for k0 in range(k_lo, k_lo + span, BLOCK_K):
        w = tl.load(w_rows + (k0 + k)[None, :]).to(tl.bfloat16)
        x = tl.load(x_rows + (k0 + k)[None, :], mask=(r < M)[:, None], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc) if SWAP else tl.dot(x, tl.trans(w), acc)
    out = out_ptr + split * M * N
    if SWAP:
        tl.store(out + r[None, :] * N + n[:, None], acc, mask=(r < M)[None, :])
    else:
        tl.store(out + r[:, None] * N + n[None, :], acc, mask=(r < M)[:, None])


def dot_probe(swap: bool, block_n: int, block_k: int = 128, stages: int = 4, warps: int = 4):
    """A projection by _dot_kernel: K split until about two programs an SM."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count

    def project(x, w, scale):
        (m, k), n = x.shape, w.shape[0]
        tiles, chunks = n // block_n, k // block_k
        split = 1
        while tiles * split * 2 <= 2 * sms and chunks % (split * 2) == 0 and chunks // split >= 8:
            split *= 2
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
        _dot_kernel[(tiles, split)](x, w, out, m, n, k, k // split, ROWS=max(16, m),
                                    BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, num_warps=warps,
                                    num_stages=stages, launch_pdl=True)  # fmt: skip
        return out

    return project


def read(words: torch.Tensor, out: torch.Tensor) -> None:
    grid = (triton.cdiv(words.numel(), BLOCK * LOADS),)
    _read_kernel[grid](words, out, words.numel(), BLOCK=BLOCK, LOADS=LOADS, num_warps=8,
                       launch_pdl=True)  # fmt: skip


def num_experts(c) -> int:
    """A MoE model's experts a layer; 0 for a dense model."""
    return getattr(c, "num_experts", None) or getattr(c, "num_local_experts", None) or 0


def layer_weights(c, rows: int) -> list[tuple[str, int, int, int]]:
    """(name, output rows N, K, copies) of what one decoder layer's decode step reads, in order;
    a MoE layer's experts as `copies` matrices (its active experts at `rows` tokens)."""
    hidden, head = (
        c.hidden_size,
        getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
    )
    q, kv = c.num_attention_heads * head, c.num_key_value_heads * head
    attention = [("qkv", q + 2 * kv, hidden, 1), ("o", hidden, q, 1)]
    experts = num_experts(c)
    if not experts:
        return attention + [("gate|up", 2 * c.intermediate_size, hidden, 1),
                            ("down", hidden, c.intermediate_size, 1)]  # fmt: skip
    inner = getattr(c, "moe_intermediate_size", None) or c.intermediate_size
    active = math.ceil(active_experts(experts, c.num_experts_per_tok, rows))
    routed = [
        ("experts gate|up", 2 * inner, hidden, active),
        ("experts down", hidden, inner, active),
    ]
    return attention + [("router", experts, hidden, 1)] + routed


def step_reads(c, weight_bytes: int, rows: int) -> tuple[list[int], int]:
    """(bytes of each weight one decoder layer reads, in order; the LM head's bytes) of a decode
    step of `rows` tokens. The LM head stays bf16, as ostinato's FP8 models keep it."""
    sizes = [n * k * copies * weight_bytes for _, n, k, copies in layer_weights(c, rows)]
    return sizes, c.vocab_size * c.hidden_size * 2


def chains(c, weight_bytes: int, rows: int, reads: bool):
    """The step's weights as views of one byte buffer -> (bytes, {chain: (kernels, fn)});
    reads: with the read chains."""
    sizes, head_bytes = step_reads(c, weight_bytes, rows)
    layer_bytes = sum(sizes)
    total = c.num_hidden_layers * layer_bytes + head_bytes
    buffer = torch.randint(-(2**31), 2**31 - 1, (total // 4 + 1,), dtype=torch.int32, device="cuda")
    out = torch.empty(triton.cdiv(total // 4 + 1, BLOCK * LOADS), dtype=torch.int32, device="cuda")
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    words = lambda start, size: buffer[start // 4 : (start + size) // 4]  # noqa: E731

    def per_weight(small: int):
        def step():
            at = 0
            for _ in range(c.num_hidden_layers):
                for size in sizes:
                    read(words(at, size), out)
                    at += size
                for _ in range(small):
                    _bump_kernel[(1,)](flag, PDL=True, launch_pdl=True)
            read(words(at, head_bytes), out)

        return step

    def per_layer():
        for i in range(c.num_hidden_layers):
            read(words(i * layer_bytes, layer_bytes), out)
        read(words(c.num_hidden_layers * layer_bytes, head_bytes), out)

    layers = c.num_hidden_layers
    found = {}
    if reads:
        found = {
            "one": (1, lambda: read(buffer, out)),
            "layer": (layers + 1, per_layer),
            "weight": (layers * len(sizes) + 1, per_weight(0)),
            "weight+3": (layers * (len(sizes) + 3) + 1, per_weight(3)),
        }
    if not num_experts(c):  # dense: the projections themselves
        matrices = [(n, k) for _, n, k, _ in layer_weights(c, rows)] * layers
        head = [(c.vocab_size, c.hidden_size)]
        weights = views(buffer, matrices, weight_bytes) + views(
            buffer, head, 2, at=total - head_bytes
        )
        found[f"cublas {rows}"] = (len(weights), projections(weights, rows, cublas))
        found[f"ours {rows}"] = (len(weights), projections(weights, rows, ours))
        if rows > 1:  # probes of a tl.dot kernel at these rows
            for swap, block_n in ((False, 64), (True, 64), (True, 128)):
                name = f"{'swap' if swap else 'dot'} {rows} ({block_n}x128)"
                found[name] = (len(weights), projections(weights, rows, dot_probe(swap, block_n)))
    return total, found


def views(buffer, matrices, weight_bytes: int, at: int = 0) -> list[torch.Tensor]:
    """The matrices [N, K] side by side in buffer from byte `at`, bf16 or FP8, made finite."""
    weights = []
    for n, k in matrices:
        flat = buffer.view(torch.uint8)[at : at + n * k * weight_bytes]
        w = flat.view(torch.bfloat16 if weight_bytes == 2 else torch.float8_e4m3fn).view(n, k)
        w.copy_(w.float().clamp(-1, 1).nan_to_num(0.0).to(w.dtype))  # random bits
        weights.append(w)
        at += n * k * weight_bytes
    return weights


def cublas(x: torch.Tensor, w: torch.Tensor, scale: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """bf16: F.linear; FP8: x quantised per row (not timed) into torch._scaled_mm."""
    if w.dtype == torch.bfloat16:
        return F.linear(x, w)
    return torch._scaled_mm(x, w.t(), scale_a=scale[0], scale_b=scale[1], out_dtype=torch.bfloat16)


def ours(x: torch.Tensor, w: torch.Tensor, scale: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The projection as ostinato's decode step runs it at these rows: bf16 through the
    small-batch kernel where it pays, else cuBLAS; FP8 through fp8_linear."""
    if w.dtype == torch.bfloat16:
        return gemv(x, w) if gemv_pays(x, w) else F.linear(x, w)
    return fp8_linear(x, w, scale[2])


def projections(weights: list[torch.Tensor], rows: int, project):
    """x of `rows` rows through every weight in turn (each its own x: only the reads count);
    for `cublas`, FP8 weights take an FP8 x (rows padded to 16, _scaled_mm's multiple)."""
    fp8_x = project is cublas
    padded = max(16, rows) if fp8_x else rows
    inputs = []
    for w in weights:
        fp8 = w.dtype != torch.bfloat16
        x = torch.randn(padded if fp8 else rows, w.shape[1], device="cuda", dtype=torch.bfloat16)
        n = w.shape[0]  # scales: x's rows, w's rows as _scaled_mm and as fp8_linear take them
        ones = torch.ones
        scale = (
            ones(padded, 1, device="cuda"),
            ones(1, n, device="cuda"),
            ones(n, 1, device="cuda"),
        )
        inputs.append((x.to(w.dtype) if fp8 and fp8_x else x, w, scale))
    return lambda: [project(*args) for args in inputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="random:qwen3-0.6b", help="a preset or HF directory")
    parser.add_argument("--rows", default="1,32", help="batch sizes, comma-separated")
    parser.add_argument("--weight-bytes", type=int, choices=(1, 2), default=2,
                        help="2: bf16; 1: FP8 (cuBLAS through torch._scaled_mm)")  # fmt: skip
    parser.add_argument("--json", help="append one JSON line per chain to this file")
    args = parser.parse_args()
    batches = args.rows.split(",")
    if not all(b.isdigit() and int(b) > 0 for b in batches):
        parser.error("--rows takes positive batch sizes, comma-separated, e.g. 1,32")
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device: it times CUDA graphs")
    try:
        c = load_hf_config(args.model)
    except ValueError as e:  # an unknown preset, a path that is no model
        parser.error(str(e))
    bandwidth = copy_bandwidth()
    print(f"{args.model}, {args.weight_bytes}-byte weights, copy {bandwidth / 1e12:.2f} TB/s")
    print("| rows | chain | kernels a step | ms a step | floor ms | x floor |")
    print("|---|---|---|---|---|---|")
    for i, rows in enumerate(map(int, batches)):
        # a dense model reads the same weights at every batch size: its read chains once
        total, found = chains(c, args.weight_bytes, rows, reads=i == 0 or num_experts(c) > 0)
        floor = total / bandwidth * 1e3
        for name, (kernels, fn) in found.items():
            try:
                ms = graph_seconds([fn], replays=20) * 1e3
            except Exception as e:  # one chain that fails to run leaves the others their numbers
                print(f"| {rows} | {name} | {kernels} | failed: {type(e).__name__}: {e} | | |")
                continue
            print(f"| {rows} | {name} | {kernels} | {ms:.3f} | {floor:.3f} | {ms / floor:.3f} |")
            if args.json:
                row = dict(model=args.model, weight_bytes=args.weight_bytes, rows=rows, chain=name,
                           kernels=kernels, ms=ms, floor_ms=floor, bytes=total)  # fmt: skip
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
        del found
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
