"""Kernel benchmarks on one GPU, printed as a markdown table and written to --out.

    python benchmarks/bench_kernels.py --out benchmarks/kernels-h100.md [--sections ...]

Measures the device-to-device copy bandwidth and the bf16 matmul rate (the two ceilings),
decode and prefill paged attention in a Llama-3.1-8B layer shape against them, the fused
norm / RoPE + KV store / activation kernels against the torch sequences they replace, the
small-batch projection kernel against cuBLAS, (`gemv-rows`) that kernel at 1-32 rows with its
fusions against cuBLAS and the kernels the unfused path launches around it, (`fp8`) the FP8
small-batch kernel against the one it replaced, bf16 cuBLAS and the copy floor, (`moe`)
qwen3-30b-a3b's fused MoE GEMMs at decode sizes against their launch before and the copy floor,
and (`moe-block`) its whole MoE block, router to output, against the kernel sequence before.
Kernels are timed inside CUDA graphs, as the engine runs them: no launch overhead, and each
captured call reads its own KV blocks or weights so the L2 cache cannot serve repeats. The
`sweep`, `fp8-sweep` and `moe-sweep` sections also time other launch configurations, to tune
`choose_config`, `gemv_config` and `moe_config`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import statistics
import subprocess
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
import triton
from triton.testing import do_bench

from ostinato.context import LoRAMetadata
from ostinato.kernels import fp8, fused_add_rms_norm, moe, rms_norm, rope_and_store, silu_and_mul
from ostinato.kernels import gemv as gemv_module
from ostinato.kernels import lora as lora_module
from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.gemv import gemv, gemv_normed
from ostinato.kernels.lora import lora_expand, lora_shrink
from ostinato.kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from ostinato.kernels.rope_store import rotary_torch
from ostinato.layers.linear import project

attention = importlib.import_module("ostinato.kernels.paged_attention")
fp8_gemv_before = importlib.import_module("fp8_gemv_before")  # benchmarks/, beside this file

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Llama-3.1-8B
HIDDEN, INTERMEDIATE = 4096, 14336
DECODE_TARGET = 0.70
# issue 17: fractions of the matmul rate, per (prompts, length)
PREFILL_TARGETS = {(1, 4096): 0.55, (8, 512): 0.40}
L2_FLUSH_BYTES = 256 << 20  # a captured ring of calls spans this much, several times the L2


def graph_seconds(calls: list[Callable[[], object]], replays: int = 5, trials: int = 5) -> float:
    """Seconds per call, the calls captured back to back in one CUDA graph (median of trials)."""
    calls[0]()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    times = []
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / (replays * len(calls)))
    del graph
    return statistics.median(times)


# ---- ceilings ----------------------------------------------------------------------------


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    return 2 * src.numel() / seconds


def matmul_flops() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    seconds = do_bench(lambda: a @ b, return_mode="median") / 1e3
    return 2 * 8192**3 / seconds


# ---- attention ---------------------------------------------------------------------------


class KVPool:
    """One large random KV cache; each captured call gets disjoint shuffled blocks of it."""

    def __init__(self, blocks: int, heads: int = HEADS, kv_heads: int = KV_HEADS) -> None:
        self.heads, self.kv_heads = heads, kv_heads
        shape = (blocks, BLOCK, kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        self.v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)

    def calls(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        config=None,
        merge: bool = False,
        new_kv: bool = False,
    ) -> list[Callable]:
        """As many calls as make the ring span L2_FLUSH_BYTES, each on its own blocks; merge:
        eager steps' launch (the split KV merged in the attention kernel, no combine); new_kv:
        the engine's launch, given the step's k and v (views of one qkv buffer), which a
        long-query launch reads for the new tokens' tiles."""
        width = -(-max(seq_lens) // BLOCK)
        blocks = len(seq_lens) * width
        heads, kv_heads = self.heads, self.kv_heads
        per_call = sum(seq_lens) * kv_heads * HEAD_DIM * 2 * 2
        count = max(1, min(128, -(-L2_FLUSH_BYTES // per_call), self.k.shape[0] // blocks))
        order = torch.randperm(self.k.shape[0], device="cuda", dtype=torch.int32)
        starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        query_start_loc = starts.cuda()
        lens = torch.tensor(seq_lens, dtype=torch.int32, device="cuda")
        q = torch.randn(sum(q_lens), heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        qkv = torch.randn(sum(q_lens), heads + 2 * kv_heads, HEAD_DIM, device="cuda",
                          dtype=torch.bfloat16) if new_kv else None  # fmt: skip
        new = (qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]) if new_kv else None
        calls = []
        for i in range(count):
            table = order[i * blocks : (i + 1) * blocks].view(len(seq_lens), width)
            args = (q, self.k, self.v, out, query_start_loc, lens, table, HEAD_DIM**-0.5, config,
                    merge, new)  # fmt: skip
            calls.append(lambda args=args: _attend(*args))
        return calls


def _attend(q, k, v, out, query_start_loc, lens, table, scale, config, merge, new) -> None:
    new_k, new_v = new or (None, None)
    attention.PagedAttention(
        q, out, k, query_start_loc, lens, table, scale, config, merge, new_kv=new_k
    )(q, k, v, out, new_k, new_v)


def decode_rows(pool: KVPool, copy_bw: float) -> list[list[str]]:
    rows = []
    for batch in (1, 8, 32, 128):
        for context in (512, 2048, 8192):
            seconds = graph_seconds(pool.calls([1] * batch, [context] * batch))
            kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * 2
            fraction = kv_bytes / seconds / copy_bw
            target = batch >= 8 and context >= 2048
            rows.append([
                str(batch), str(context), f"{seconds * 1e6:.1f}", f"{kv_bytes / 1e6:.1f}",
                f"{kv_bytes / seconds / 1e12:.2f}", f"{fraction:.2f}",
                *(_vs_target(fraction, DECODE_TARGET) if target else ["—", "—"]),
            ])  # fmt: skip
    return rows


def prefill_flops(q_lens: list[int], heads: int = HEADS) -> int:
    """Causal attention, fresh prompts: QK^T and PV over the q(q+1)/2 visible pairs."""
    return sum(4 * heads * HEAD_DIM * q * (q + 1) // 2 for q in q_lens)


def prefill_rows(pool: KVPool, matmul: float) -> list[list[str]]:
    """Fresh prompts as the engine launches them (the new tokens' KV read from k and v), and
    the cache-only launch beside it."""
    rows = []
    for (batch, length), target in PREFILL_TARGETS.items():
        q_lens = [length] * batch
        cached = graph_seconds(pool.calls(q_lens, q_lens))
        seconds = graph_seconds(pool.calls(q_lens, q_lens, new_kv=True))
        flops = prefill_flops(q_lens) / seconds
        rows.append([
            f"{batch} x {length}", f"{cached * 1e3:.3f}", f"{seconds * 1e3:.3f}",
            f"{flops / 1e12:.0f}", f"{flops / matmul:.2f}",
            *_vs_target(flops / matmul, target),
        ])  # fmt: skip
    return rows


def _vs_target(value: float, target: float) -> list[str]:
    return [f"{target:.2f}", f"{(value / target - 1) * 100:+.0f}%"]


# ---- fused small kernels -----------------------------------------------------------------


def fused_cases(tokens: int) -> list[tuple[str, Callable, Callable]]:
    dev, bf16 = "cuda", torch.bfloat16
    x = torch.randn(tokens, HIDDEN, device=dev, dtype=bf16)
    residual = torch.randn_like(x)
    weight = torch.rand(HIDDEN, device=dev, dtype=bf16) + 0.5
    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, device=dev, dtype=bf16)
    q, k, v = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=1)
    q, k, v = (t.view(tokens, -1, HEAD_DIM) for t in (q, k, v))
    positions = torch.randint(0, 8192, (tokens,), device=dev)
    cache = torch.randn(8192, HEAD_DIM, device=dev)
    blocks = 2 * tokens // BLOCK
    kv_cache = [
        torch.zeros(blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=bf16) for _ in "kv"
    ]
    slots = torch.randperm(blocks * BLOCK, device=dev)[:tokens]
    rope_args = (q, k, v, positions, cache, *kv_cache, slots)
    gate_up = torch.randn(tokens, 2 * INTERMEDIATE, device=dev, dtype=bf16)
    return [
        ("rms_norm", lambda: rms_norm(x, weight, 1e-6), lambda: rms_norm_torch(x, weight, 1e-6)),
        (
            "residual add + rms_norm",
            lambda: fused_add_rms_norm(x, residual, weight, 1e-6),
            lambda: fused_add_rms_norm_torch(x, residual, weight, 1e-6),
        ),
        (
            "rotary (q and k) + KV store",
            lambda: rope_and_store(*rope_args),
            lambda: _rope_then_store_torch(*rope_args),
        ),
        ("silu_and_mul", lambda: silu_and_mul(gate_up), lambda: silu_and_mul_torch(gate_up)),
    ]


def _rope_then_store_torch(q, k, v, positions, cache, k_cache, v_cache, slots) -> None:
    """The unfused torch sequence, capturable (every slot valid)."""
    rotary_torch(q, k, positions, cache)
    k_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, k)
    v_cache.view(-1, KV_HEADS, HEAD_DIM).index_copy_(0, slots, v)


def fused_rows() -> list[list[str]]:
    rows = []
    for tokens in (32, 4096):
        for name, ours, theirs in fused_cases(tokens):
            graph = [graph_seconds([fn] * 20) * 1e6 for fn in (ours, theirs)]
            eager = [do_bench(fn, return_mode="median") * 1e3 for fn in (ours, theirs)]
            rows.append([
                name, str(tokens), f"{graph[0]:.1f}", f"{graph[1]:.1f}",
                f"{graph[1] / graph[0]:.1f}x", f"{eager[0]:.1f}", f"{eager[1]:.1f}",
            ])  # fmt: skip
    return rows


# ---- sweep -------------------------------------------------------------------------------


def sweep_rows(pool: KVPool) -> list[list[str]]:
    """Other launch configurations of the attention kernel on a few cases, fastest first."""
    Config = attention.Config
    rows = []
    for batch, context in ((1, 8192), (8, 2048), (32, 8192)):
        q_lens, seq_lens = [1] * batch, [context] * batch
        base = _config_for(q_lens, seq_lens, pool)
        variants = [base] + [
            base._replace(**change)
            for change in (
                dict(block_n=16),
                dict(block_n=64),
                dict(num_stages=3),
                dict(num_stages=4),
                dict(num_warps=8),
                dict(splits=max(1, base.splits // 2)),
                dict(splits=base.splits * 2),
                dict(block_n=64, num_stages=3),
            )  # fmt: skip
        ]
        rows += _time_variants(pool, f"decode {batch} x {context}", q_lens, seq_lens, variants)
    for batch, length in ((1, 4096), (8, 512)):
        q_lens = [length] * batch
        variants = [
            Config(32, 128, 64, 1, 8, 5), Config(32, 128, 64, 1, 8, 3),
            Config(32, 128, 32, 1, 8, 5), Config(32, 128, 128, 1, 8, 4),
            Config(16, 64, 64, 1, 4, 5), Config(16, 64, 32, 1, 4, 4), Config(32, 128, 64, 1, 4, 5),
        ]  # fmt: skip
        rows += _time_variants(pool, f"prefill {batch} x {length}", q_lens, q_lens, variants)
    return rows


def decode_sweep_rows(pool: KVPool) -> list[list[str]]:
    """Decode at the short contexts of a small model's decode (a 512-token prompt and its
    first tokens), where the launch more than the KV bytes sets the time: other splits, KV
    tiles, stages and warps, fastest first."""
    rows = []
    for batch in (1, 8, 32):
        for context in (576, 1088):
            q_lens, seq_lens = [1] * batch, [context] * batch
            base = _config_for(q_lens, seq_lens, pool)
            variants = [base] + [
                base._replace(**change)
                for change in (
                    dict(splits=max(1, base.splits // 2)),
                    dict(splits=base.splits * 2),
                    dict(splits=base.splits * 4),
                    dict(block_n=16),
                    dict(block_n=64),
                    dict(block_n=64, splits=base.splits * 2),
                    dict(num_stages=3),
                    dict(num_warps=2),
                )  # fmt: skip
            ]
            case = f"decode {batch} x {context}"
            rows += _time_variants(pool, case, q_lens, seq_lens, variants)
            merged = graph_seconds(pool.calls(q_lens, seq_lens, base, merge=True))
            rows.append([case, _short(base) + " merged (eager steps)", f"{merged * 1e6:.1f}"])
    return rows


# (name, query heads, KV heads): the decode layers merge_rows compares, all head_dim 128
MERGE_SHAPES = (("llama-3.1-8b", 32, 8), ("qwen3-0.6b", 16, 8), ("qwen3-30b-a3b", 32, 4))


def merge_rows() -> list[list[str]]:
    """A split KV's two ways to finish, in each decode layer shape at small batches and
    short to long contexts: the combine kernel launched after the attention kernel, or the
    tile's last part merging the others' partials itself (MERGE, one launch)."""
    rows = []
    for name, heads, kv_heads in MERGE_SHAPES:
        pool = KVPool(blocks=32 * 8192 // BLOCK, heads=heads, kv_heads=kv_heads)
        for batch in (1, 8, 32):
            for context in (192, 576, 1088, 4096):
                q_lens, seq_lens = [1] * batch, [context] * batch
                config = _config_for(q_lens, seq_lens, pool)
                combined = graph_seconds(pool.calls(q_lens, seq_lens, config))
                merged = graph_seconds(pool.calls(q_lens, seq_lens, config, merge=True))
                rows.append([name, str(batch), str(context), str(config.splits),
                             f"{combined * 1e6:.1f}", f"{merged * 1e6:.1f}",
                             f"{merged / combined:.3f}"])  # fmt: skip
        del pool
    return rows


# (name, query heads, KV heads, (prompts, length) cases): the layer shapes the prefill
# sweep and the SDPA comparison run, all head_dim 128. qwen3-0.6b's GQA group of 2 packs half
# as many heads per tile as Llama's 4, and its one-prompt steps are issue 17's TTFT cases.
PREFILL_SHAPES = (
    ("llama-3.1-8b", 32, 8, ((8, 512), (1, 2048), (1, 4096))),
    ("qwen3-0.6b", 16, 8, ((1, 512), (1, 1024), (1, 2048), (4, 512))),
)
# (name, query heads, KV heads, (prompts, chunk, context before it) cases): a long prompt's
# later chunk, which reads its whole KV range from the cache (the sweep's second half)
CHUNK_SHAPES = (
    ("llama-3.1-8b", 32, 8, ((1, 2048, 2048), (1, 4096, 4096))),
    ("qwen3-0.6b", 16, 8, ((1, 2048, 2048), (1, 4096, 4096))),
)


def prefill_variants(group: int) -> list:
    """Launch configurations of a fresh prefill for a GQA group: 64 or 128 rows a tile (the
    tile's tokens follow from the group), KV tiles of 32-128, 4 or 8 warps, 2-3 stages."""
    kinds = ((64, 4, 2), (64, 4, 3), (128, 4, 2), (32, 4, 3), (64, 8, 2), (64, 8, 3), (128, 8, 2))
    return [
        attention.Config(block_m // group, block_m, block_n, 1, warps, stages)
        for block_m in (64, 128)
        for block_n, warps, stages in kinds
    ]


def prefill_sweep_rows(matmul: float) -> list[list[str]]:
    """Prefill launch configurations, fastest first, each as a fraction of the matmul rate, in
    each layer shape: fresh prompts as the engine launches them (PREFILL_SHAPES: the new
    tokens' KV read from k and v), then later chunks of a long prompt (CHUNK_SHAPES: the KV
    read through the block table)."""
    rows = []
    for shapes, fresh in ((PREFILL_SHAPES, True), (CHUNK_SHAPES, False)):
        for name, heads, kv_heads, cases in shapes:
            pool = KVPool(blocks=32 * 8192 // BLOCK, heads=heads, kv_heads=kv_heads)
            for batch, length, *context in cases:
                q_lens = [length] * batch
                seq_lens = [length + sum(context)] * batch
                # the chunk's queries see the context whole and the chunk causally
                flops = prefill_flops(q_lens, heads) + 4 * heads * HEAD_DIM * sum(
                    q * (s - q) for q, s in zip(q_lens, seq_lens, strict=True)
                )
                case = f"{name} {batch} x {length}" + (f" after {context[0]}" if context else "")
                variants = prefill_variants(heads // kv_heads)
                timed = _time_variants(pool, case, q_lens, seq_lens, variants, new_kv=fresh)
                rows += [[*row, f"{flops / (float(row[2]) / 1e6) / matmul:.2f}"] for row in timed]
            del pool
    return rows


SDPA_BACKENDS = ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION")


def sdpa_rows(matmul: float) -> list[list[str]]:
    """Fresh causal prefill through torch's SDPA backends against our paged kernel, in each
    PREFILL_SHAPES layer shape: q, k and v are strided views of one fused qkv buffer, as the
    model leaves them, and each call copies its result into the layer's output, so the row is
    what the engine would pay."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = []
    for name, heads, kv_heads, cases in PREFILL_SHAPES:
        pool = KVPool(blocks=32 * 8192 // BLOCK, heads=heads, kv_heads=kv_heads)
        for batch, length in cases:
            q_lens = [length] * batch
            flops = prefill_flops(q_lens, heads)
            timed = {"ours (paged)": graph_seconds(pool.calls(q_lens, q_lens, new_kv=True))}
            qkv = torch.randn(batch * length, (heads + 2 * kv_heads) * HEAD_DIM, device="cuda",
                              dtype=torch.bfloat16)  # fmt: skip
            q, k, v = (
                t.view(batch, length, -1, HEAD_DIM).transpose(1, 2)
                for t in qkv.split([heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM], 1)
            )
            out = torch.empty(batch, length, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)

            def call(q=q, k=k, v=v, out=out):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                out.copy_(o.transpose(1, 2))

            for backend in SDPA_BACKENDS:
                try:
                    with sdpa_kernel(getattr(SDPBackend, backend)):
                        timed[backend.lower()] = graph_seconds([call] * 4)
                except Exception as error:  # a backend that rejects the shape or the GPU
                    print(f"sdpa {backend} {name} {batch} x {length}: {error!r}"[:300])
            for kernel, seconds in timed.items():
                rate = flops / seconds
                rows.append([name, f"{batch} x {length}", kernel, f"{seconds * 1e3:.3f}",
                             f"{rate / 1e12:.0f}", f"{rate / matmul:.2f}"])  # fmt: skip
        del pool
    return rows


def _config_for(q_lens, seq_lens, pool):
    q = torch.empty(sum(q_lens), pool.heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    table = torch.empty(len(seq_lens), -(-max(seq_lens) // BLOCK), device="cuda")
    return attention.choose_config(q, pool.k, table, len(seq_lens))


def _time_variants(pool, case, q_lens, seq_lens, variants, new_kv=False) -> list[list[str]]:
    timed = []
    for config in dict.fromkeys(variants):  # drop duplicates, keep order
        try:
            calls = pool.calls(q_lens, seq_lens, config, new_kv=new_kv)
            timed.append((graph_seconds(calls), config))
        except Exception as error:  # a configuration the compiler rejects (shared memory)
            print(f"{case} {config}: {type(error).__name__}")
    timed.sort(key=lambda pair: pair[0])
    default = _config_for(q_lens, seq_lens, pool)
    return [
        [case, _short(config) + (" (default)" if config == default else ""), f"{s * 1e6:.1f}"]
        for s, config in timed
    ]


def _short(config) -> str:
    return ", ".join(f"{name}={value}" for name, value in config._asdict().items())


# ---- FP8 weights ---------------------------------------------------------------------------

FP8_SHAPES = {  # llama-3.1-8b's projections: (weight rows, K)
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate|up": (28672, 4096),
    "down": (4096, 14336),
}


def _ring(n: int, k: int, fp8_weights: bool) -> list:
    """Weights for back-to-back calls, together larger than L2: FP8 (weight, per-row scale)
    pairs, or bfloat16 weights."""
    count = max(4, min(64, L2_FLUSH_BYTES // (n * k * (1 if fp8_weights else 2))))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
    return [fp8.quantize_rows(w) for w in weights] if fp8_weights else weights


def _ring_seconds(ring: list, call: Callable) -> float:
    return graph_seconds([lambda pair=pair: call(*pair) for pair in ring])


def fp8_rows(copy_bw: float) -> list[list[str]]:
    """Llama-3.1-8B's projections on FP8 weights (per-row scales, bfloat16 x): our kernel in
    its chosen configuration, and from 8 rows its two tl.dot paths in their gemv_config
    launches (weight-only: x bfloat16, the weights widened; FP8 dot: x quantised per group of
    128 columns); the kernel it replaced (up to its 8 rows; above them the _scaled_mm path
    fp8_linear took, x quantised per token), a bfloat16 cuBLAS matmul of the same shape, and
    the floor: the FP8 weights and scales read at copy bandwidth."""
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for name, (n, k) in FP8_SHAPES.items():
        ring, bf16 = _ring(n, k, True), _ring(n, k, False)
        weight_bytes = n * k + 4 * n
        floor = weight_bytes / copy_bw
        for m in (1, 8, 16, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            small = m <= fp8_gemv_before.ROWS
            before = fp8_gemv_before.gemv_before if small else fp8._scaled_mm
            config = fp8.gemv_config(m, n, k, None, sms)
            paths = {}  # fp8_dot -> seconds of gemv_config's launch with the FP8 dot or not
            for fp8_dot in (False, True) if m > 1 else ():
                launch = _fp8_config(m, n, k, sms, fp8_dot)
                paths[fp8_dot] = _ring_seconds(
                    ring, lambda w, s, x=x, c=launch: fp8.fp8_gemv(x, w, s, config=c)
                )
            if config.fp8_x in paths:
                ours = paths[config.fp8_x]
            else:
                ours = _ring_seconds(ring, lambda w, s, x=x: fp8.fp8_gemv(x, w, s))
            old = _ring_seconds(ring, lambda w, s, x=x, before=before: before(x, w, s))
            cublas = graph_seconds([lambda w=w, x=x: F.linear(x, w) for w in bf16])
            rows.append([
                name, str(m), f"{weight_bytes / 1e6:.1f}", f"{ours * 1e6:.2f}",
                _fp8_short(config),
                *(f"{paths[p] * 1e6:.2f}" if p in paths else "-" for p in (False, True)),
                f"{old * 1e6:.2f}", f"{cublas * 1e6:.2f}",
                f"{floor * 1e6:.2f}", f"{weight_bytes / ours / copy_bw:.2f}",
                f"{old / ours:.2f}x", f"{cublas / ours:.2f}x",
            ])  # fmt: skip
        del ring, bf16
        torch.cuda.empty_cache()
    return rows


def _fp8_config(m: int, n: int, k: int, sms: int, fp8_dot: bool):
    """gemv_config's launch with the FP8 dot at every row count (fp8_dot) or at none."""
    saved, fp8.FP8_DOT_ROWS = fp8.FP8_DOT_ROWS, fp8.GEMV_ROWS if fp8_dot else 0
    try:
        return fp8.gemv_config(m, n, k, None, sms)
    finally:
        fp8.FP8_DOT_ROWS = saved


def fp8_sweep_rows(copy_bw: float) -> list[list[str]]:
    """Launch configurations of the FP8 small-batch kernel's FP8 x FP8 dot on Llama-3.1-8B's
    projections at 8 and 32 rows, to tune gemv_config (of copy: the weight bytes a second
    over the copy rate). First tile widths, warps and chunk widths at 4 stages, K split as
    gemv_config would for that width; then the best two at 3 and 5 stages, and at half and
    twice the split. The five fastest of each case, gemv_config's launch, and the weight-only
    dot's launch for reference."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        ring = _ring(n, k, True)
        for m in (8, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            default = fp8.gemv_config(m, n, k, None, sms)
            weight_only = _fp8_config(m, n, k, sms, False)
            timed = {}  # config -> seconds
            for config in [default, weight_only, *_fp8_tiles(m, n, k, sms)]:
                _fp8_time(timed, ring, x, config)
            dots = sorted((c for c in timed if c.fp8_x), key=timed.get)
            for config in dots[:2]:
                for variant in _fp8_neighbours(config, k):
                    _fp8_time(timed, ring, x, variant)
            ranked = sorted(timed, key=timed.get)
            shown = ranked[:5] + [c for c in ranked[5:] if c in (default, weight_only)]
            for config in shown:
                mark = " (default)" if config == default else ""
                mark += " (weight-only)" if config == weight_only and config != default else ""
                rows.append([
                    f"{name} x {m}", _fp8_short(config) + mark, f"{timed[config] * 1e6:.2f}",
                    f"{(n * k + 4 * n) / timed[config] / copy_bw:.2f}",
                ])  # fmt: skip
        del ring
        torch.cuda.empty_cache()
    return rows


FP8_SMEM = 227 << 10  # an H100 SM's shared memory for one program


def _fp8_time(timed: dict, ring: list, x: torch.Tensor, config) -> None:
    """timed[config] = seconds per call, unless timed or over the shared memory."""
    if config in timed or _fp8_smem(config) > FP8_SMEM:
        return
    try:
        timed[config] = _ring_seconds(
            ring, lambda w, s, x=x, c=config: fp8.fp8_gemv(x, w, s, config=c)
        )
    except Exception as error:  # a configuration the compiler rejects
        print(f"fp8 {tuple(x.shape)} {config}: {type(error).__name__}")


def _fp8_smem(config) -> int:
    """Shared memory the pipelined loop stages: FP8 weight tiles and x's rows per stage."""
    return config.num_stages * config.block_k * (config.block_n + 2 * config.rows)


def _fp8_dot_config(m, k, block_n, block_k, split, warps, stages):
    span = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    rows = max(16, triton.next_power_of_2(m))
    return fp8.GemvConfig(rows, block_n, block_k, span, triton.cdiv(k, span), warps, stages, True)


def _fp8_tiles(m: int, n: int, k: int, sms: int) -> list:
    """FP8 dot launches of other tile widths, warps and chunk widths, split as gemv_config
    splits for the width."""
    out = []
    for block_n, warps, block_k in ((64, 4, 128), (128, 4, 128), (128, 8, 128), (256, 8, 128),
                                    (128, 4, 256)):  # fmt: skip
        split = max(1, min(2 * sms // triton.cdiv(n, block_n), k // (4 * block_k)))
        out.append(_fp8_dot_config(m, k, block_n, block_k, split, warps, 4))
    return out


def _fp8_neighbours(config, k: int) -> list:
    """config at 3 and 5 stages, and at half and twice its split."""
    m, block_n, block_k = config.rows, config.block_n, config.block_k
    warps, stages, split = config.num_warps, config.num_stages, config.split
    return [
        *(config._replace(num_stages=s) for s in (3, 5) if s != stages),
        *(_fp8_dot_config(m, k, block_n, block_k, s, warps, stages)
          for s in {max(1, split // 2), split * 2} - {split}),
    ]  # fmt: skip


def _fp8_short(config) -> str:
    dot = "fp8 x fp8" if config.fp8_x else "weight-only"
    kind = "fma" if config.rows == 1 else f"{dot} dot {config.rows} rows"
    return (f"{kind}, {config.block_n} x {config.block_k}, split {config.split}, "
            f"{config.num_warps} warps, {config.num_stages} stages")  # fmt: skip


# ---- mixture of experts --------------------------------------------------------------------

MOE_EXPERTS, MOE_TOP_K, MOE_HIDDEN, MOE_INTER = 128, 8, 2048, 768  # qwen3-30b-a3b
MOE_TOKENS = (1, 8, 32)
MOE_CALLS = 16  # captured back to back, each with its own routing
MOE_BEFORE = moe.MoeConfig(16, 64, 64, 1, 4, 3)  # every batch's launch before issue 21
MOE_GEMMS = {  # name: (output columns, K, active bytes of one expert)
    "gate|up": (MOE_INTER, MOE_HIDDEN, 2 * MOE_INTER * MOE_HIDDEN * 2),
    "down": (MOE_HIDDEN, MOE_INTER, MOE_HIDDEN * MOE_INTER * 2),
}
MOE_VARIANTS = [
    # FMAs, a block per pair: weight rows, K step, splits, warps; 1 stage (the span unrolled)
    moe.MoeConfig(1, 8, 256, 1, 4, 1), moe.MoeConfig(1, 16, 256, 1, 4, 1),
    moe.MoeConfig(1, 4, 256, 1, 4, 1), moe.MoeConfig(1, 8, 512, 1, 4, 1),
    moe.MoeConfig(1, 16, 256, 2, 4, 1), moe.MoeConfig(1, 8, 256, 2, 4, 1),
    moe.MoeConfig(1, 4, 256, 2, 4, 1), moe.MoeConfig(1, 16, 256, 1, 8, 1),
    moe.MoeConfig(1, 32, 256, 2, 8, 1), moe.MoeConfig(1, 2, 1024, 1, 4, 1),
    moe.MoeConfig(1, 4, 1024, 1, 4, 1), moe.MoeConfig(1, 4, 1024, 1, 8, 1),
    moe.MoeConfig(1, 8, 1024, 1, 8, 1), moe.MoeConfig(1, 2, 2048, 1, 8, 1),
    moe.MoeConfig(1, 4, 2048, 1, 8, 1), moe.MoeConfig(1, 8, 2048, 1, 8, 1),
    # tl.dot on 16 pairs a block: columns, K step, splits, warps, stages
    MOE_BEFORE, moe.MoeConfig(16, 64, 128, 1, 4, 4), moe.MoeConfig(16, 64, 128, 2, 4, 4),
    moe.MoeConfig(16, 64, 128, 4, 4, 4), moe.MoeConfig(16, 32, 128, 2, 4, 4),
    moe.MoeConfig(16, 32, 256, 1, 4, 3), moe.MoeConfig(16, 16, 256, 2, 4, 3),
    moe.MoeConfig(16, 128, 128, 1, 8, 3), moe.MoeConfig(16, 64, 256, 2, 8, 3),
]  # fmt: skip


class MoeCall:
    """One captured call's inputs: a layer's experts and router, a token batch, its top-8
    routing from random logits (renormalised, as qwen3-30b-a3b's), its pairs aligned for each
    block size."""

    def __init__(self, layer: tuple[torch.Tensor, ...], tokens: int) -> None:
        dev, bf16 = "cuda", torch.bfloat16
        self.w13, self.w2, self.gate = layer
        self.x = torch.randn(tokens, MOE_HIDDEN, device=dev, dtype=bf16)
        self.slots = torch.arange(tokens, device=dev)
        logits = torch.randn(tokens, MOE_EXPERTS, device=dev)
        self.weights, self.ids = moe.route(logits, MOE_TOP_K, True)
        pairs = tokens * MOE_TOP_K
        self.flat_weights = self.weights.reshape(-1).contiguous()
        self.h = torch.randn(pairs, MOE_INTER, device=dev, dtype=bf16)  # down's input
        self.outs = {"gate|up": torch.empty_like(self.h),
                     "down": torch.empty(pairs, MOE_HIDDEN, device=dev, dtype=bf16)}  # fmt: skip
        self.experts = self.ids.unique().numel()
        # aligned before any capture, so a timed GEMM is the GEMM alone
        self.aligned = {m: moe.align(self.ids, MOE_EXPERTS, m) for m in (1, moe.DOT_BLOCK_M)}

    def gemm(self, name: str, config: moe.MoeConfig) -> None:
        aligned = self.aligned[config.block_m]
        if name == "gate|up":
            args = (self.x, self.w13, self.outs[name], *aligned, None, MOE_TOP_K, True)
        else:
            args = (self.h, self.w2, self.outs[name], *aligned, self.flat_weights, 1, False)
        moe.moe_gemm(*args, config)

    def layer(self, configs: tuple[moe.MoeConfig, moe.MoeConfig] | None) -> None:
        moe.fused_moe(self.x, self.w13, self.w2, self.ids, self.weights, configs)

    def block(self) -> None:
        """The MoE block from its input (normed) to its output, as the engine runs it."""
        logits = project(self.x, self.gate)
        moe.routed_moe(self.x, logits, self.w13, self.w2, MOE_TOP_K, True, self.slots)

    def block_before(self) -> None:
        """The same before issue 21's block fusions (with moe.SUM_PAIRS 0): the router through
        cuBLAS, route, align, gate|up, down into a zeroed [pairs, H], the sum over choices."""
        weights, ids = moe.route(F.linear(self.x, self.gate), MOE_TOP_K, True, self.slots)
        moe.fused_moe(self.x, self.w13, self.w2, ids, weights)


def moe_rings() -> dict[int, list[MoeCall]]:
    """Per token count, MOE_CALLS calls over two layers' experts in turn (2.4 GB), so no call
    finds the one before it's weights in L2."""
    layers = [
        tuple(
            torch.randn(shape, device="cuda", dtype=torch.bfloat16).mul_(0.02)
            for shape in ((MOE_EXPERTS, 2 * MOE_INTER, MOE_HIDDEN),
                          (MOE_EXPERTS, MOE_HIDDEN, MOE_INTER), (MOE_EXPERTS, MOE_HIDDEN))
        )
        for _ in range(2)
    ]  # fmt: skip
    return {
        tokens: [MoeCall(layers[i % 2], tokens) for i in range(MOE_CALLS)] for tokens in MOE_TOKENS
    }


def _moe_bytes(ring: list[MoeCall], names: tuple[str, ...]) -> float:
    """The active experts' bytes a call reads, on average over the ring."""
    per_expert = sum(MOE_GEMMS[name][2] for name in names)
    return statistics.mean(call.experts for call in ring) * per_expert


def _moe_default(name: str, tokens: int) -> moe.MoeConfig:
    n, k, _ = MOE_GEMMS[name]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return moe.moe_config(tokens * MOE_TOP_K, n, k, name == "gate|up", 2, MOE_EXPERTS, sms)


def moe_rows(rings: dict[int, list[MoeCall]], copy_bw: float) -> list[list[str]]:
    """Each grouped GEMM and the whole layer (align, both GEMMs, the sum over choices) in
    moe_config's launches and in the launch before issue 21; the floor: the active experts'
    weights read at copy bandwidth."""
    rows = []
    for name in (*MOE_GEMMS, "layer"):
        for tokens, ring in rings.items():
            if name == "layer":
                names = tuple(MOE_GEMMS)
                ours = _moe_seconds(ring, name, None)
                before = _moe_seconds(ring, name, (MOE_BEFORE,) * 2)
                launch = " / ".join(_moe_short(_moe_default(g, tokens)) for g in names)
            else:
                names, config = (name,), _moe_default(name, tokens)
                ours = _moe_seconds(ring, name, config)
                before = _moe_seconds(ring, name, MOE_BEFORE)
                launch = _moe_short(config)
            active = _moe_bytes(ring, names)
            rows.append([
                name, str(tokens), f"{active / 1e6:.1f}", f"{ours * 1e6:.2f}", launch,
                f"{before * 1e6:.2f}", f"{active / copy_bw * 1e6:.2f}",
                f"{active / ours / copy_bw:.2f}", f"{active / before / copy_bw:.2f}",
                f"{before / ours:.2f}x",
            ])  # fmt: skip
    return rows


def moe_block_rows(rings: dict[int, list[MoeCall]], copy_bw: float) -> list[list[str]]:
    """The whole MoE block (router, routing, both GEMMs, the sum) at each token count, as the
    engine runs it now and the kernel sequence before; the floor: the router's and the active
    experts' weights read at copy bandwidth."""
    rows = []
    for tokens, ring in rings.items():
        ours = graph_seconds([c.block for c in ring])
        saved, moe.SUM_PAIRS = moe.SUM_PAIRS, 0  # read while the calls are captured
        try:
            before = graph_seconds([c.block_before for c in ring])
        finally:
            moe.SUM_PAIRS = saved
        active = _moe_bytes(ring, tuple(MOE_GEMMS)) + MOE_EXPERTS * MOE_HIDDEN * 2
        rows.append([
            str(tokens), f"{active / 1e6:.1f}", f"{ours * 1e6:.2f}", f"{before * 1e6:.2f}",
            f"{active / copy_bw * 1e6:.2f}", f"{active / ours / copy_bw:.2f}",
            f"{active / before / copy_bw:.2f}", f"{before / ours:.2f}x",
        ])  # fmt: skip
    return rows


ROUTE_WARPS = (1, 2, 4, 8)


def moe_route_rows() -> list[list[str]]:
    """route_and_align alone (the router's logits to aligned blocks; qwen3-30b-a3b's 128
    experts, top 8) at each token count in each warp count, to choose moe.route_warps."""
    rows, route = [], moe.route_and_align
    for tokens in MOE_TOKENS:
        inputs = [
            (torch.randn(tokens, MOE_EXPERTS, device="cuda", dtype=torch.bfloat16),
             torch.arange(tokens, device="cuda"))
            for _ in range(MOE_CALLS)
        ]  # fmt: skip
        block_m = _moe_default("gate|up", tokens).block_m
        for warps in ROUTE_WARPS:
            calls = [partial(route, lg, MOE_TOP_K, True, s, block_m, warps) for lg, s in inputs]
            mark = " (default)" if warps == moe.route_warps(tokens) else ""
            rows.append([str(tokens), f"{warps}{mark}", f"{graph_seconds(calls) * 1e6:.2f}"])
    return rows


def moe_sweep_rows(rings: dict[int, list[MoeCall]], copy_bw: float) -> list[list[str]]:
    """MOE_VARIANTS of each grouped GEMM at each token count, the five fastest first (then
    moe_config's choice and the launch before, if slower), to tune moe_config."""
    rows = []
    for name in MOE_GEMMS:
        for tokens, ring in rings.items():
            active = _moe_bytes(ring, (name,))
            default = _moe_default(name, tokens)
            timed = []
            for config in dict.fromkeys([default, *MOE_VARIANTS]):
                try:
                    timed.append((_moe_seconds(ring, name, config), config))
                except Exception as error:  # a configuration the compiler rejects
                    print(f"moe {name} {tokens} {config}: {type(error).__name__}: {error}"[:300])
            timed.sort(key=lambda pair: pair[0])
            marked = (default, MOE_BEFORE)
            for seconds, config in timed[:5] + [t for t in timed[5:] if t[1] in marked]:
                mark = {default: " (default)", MOE_BEFORE: " (before)"}.get(config, "")
                if config == default == MOE_BEFORE:
                    mark = " (default, before)"
                rows.append([
                    f"{name} x {tokens}", _moe_short(config) + mark, f"{seconds * 1e6:.2f}",
                    f"{active / seconds / copy_bw:.2f}",
                ])  # fmt: skip
    return rows


def _moe_seconds(ring: list[MoeCall], name: str, config) -> float:
    """Seconds per call of one GEMM in one launch, or ("layer") fused_moe in the launches given
    (None: moe_config's)."""
    if name == "layer":
        return graph_seconds([lambda c=c: c.layer(config) for c in ring])
    return graph_seconds([lambda c=c: c.gemm(name, config) for c in ring])


def _moe_short(config: moe.MoeConfig) -> str:
    kind = "fma" if config.block_m == 1 else "dot"
    return (f"{kind}, {config.block_n} x {config.block_k}, split {config.split}, "
            f"{config.num_warps} warps, {config.num_stages} stages")  # fmt: skip


# ---- report ------------------------------------------------------------------------------


# ---- LoRA ----------------------------------------------------------------------------------

LORA_SHAPES = {  # llama-3.1-8b's projections: (shard widths, K)
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate|up": ([14336, 14336], 4096),
    "down": ([4096], 14336),
}
LORA_LAYERS, LORA_RANK, LORA_SLOTS = 32, 16, 4


def _lora_metadata(tokens: int, adapters: int) -> LoRAMetadata:
    """tokens split evenly over `adapters` groups, group g in slot g."""
    per = tokens // adapters
    as_cuda = lambda values: torch.tensor(values, dtype=torch.int32, device="cuda")  # noqa: E731
    return LoRAMetadata(
        adapters, as_cuda(range(tokens)), as_cuda(range(adapters)),
        as_cuda([g * per for g in range(adapters)]), as_cuda([per] * adapters),
    )  # fmt: skip


def _lora_calls(tokens: int, adapters: int) -> list[Callable]:
    """Every projection's shrink and expand for LORA_LAYERS layers of llama-3.1-8b, each layer
    on its own slot buffers (more than the L2 holds), all slots at LORA_RANK."""
    meta = _lora_metadata(tokens, adapters)
    calls = []
    for _ in range(LORA_LAYERS):
        for shards, k in LORA_SHAPES.values():
            like = dict(device="cuda", dtype=torch.bfloat16)
            a = torch.randn(LORA_SLOTS, len(shards) * LORA_RANK, k, **like) / k**0.5
            b = torch.randn(LORA_SLOTS, sum(shards), LORA_RANK, **like)
            ranks = torch.full((LORA_SLOTS, len(shards)), LORA_RANK, dtype=torch.int32,
                               device="cuda")  # fmt: skip
            offsets = tuple(sum(shards[:i]) for i in range(len(shards) + 1))
            x = torch.randn(tokens, k, **like)
            y = torch.randn(tokens, sum(shards), **like)

            def call(x=x, a=a, b=b, ranks=ranks, offsets=offsets, y=y):
                lora_expand(lora_shrink(x, a, ranks, meta), b, ranks, offsets, y, meta)

            calls.append(call)
    return calls


def lora_rows() -> list[list[str]]:
    """µs per layer (shrink and expand of all four projections) in a CUDA graph, each variant:
    the shrink summing its splits (lora.SUM_SPLITS) or expand summing them, at the default
    split of K and chunk of K per step, and at fixed ones (splits beyond K's chunks idle)."""
    rows = []
    default_splits, default_block_k = lora_module._splits, lora_module._block_k
    variants = [(False, None, None), (True, None, None)] + [
        (True, split, block_k) for split in (8, 16, 32, 64) for block_k in (32, 64, 128)
    ]
    for tokens, adapters in ((1, 1), (8, 1), (32, 4)):
        timed = {}
        for summed, split, block_k in variants:
            lora_module.SUM_SPLITS = summed
            if split:
                lora_module._splits = lambda *a, split=split: split
            if block_k:
                lora_module._block_k = lambda *a, block_k=block_k: block_k
            try:
                seconds = graph_seconds(_lora_calls(tokens, adapters), replays=3, trials=3)
            finally:
                lora_module.SUM_SPLITS = True
                lora_module._splits, lora_module._block_k = default_splits, default_block_k
            timed[(summed, split or "default", block_k or "default")] = seconds * 4 * 1e6
        base = timed[(False, "default", "default")]
        for (summed, split, block_k), us in sorted(timed.items(), key=lambda kv: kv[1]):
            rows.append([
                f"{tokens} x {adapters}", "shrink" if summed else "expand", str(split),
                str(block_k), f"{us:.1f}", f"{base / us:.2f}",
            ])  # fmt: skip
    return rows


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def gemv_rows(copy_bw: float) -> list[list[str]]:
    """Small-batch projections: our kernel against cuBLAS (and, for gate|up, cuBLAS plus our
    silu_and_mul), each call on its own weights from a ring larger than L2."""
    rows = []
    for name, (n, k, silu) in GEMV_SHAPES.items():
        count = max(4, min(64, L2_FLUSH_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)

            def ours(w, x=x, silu=silu):
                return gemv(x, w, silu_and_mul=silu)

            def cublas(w, x=x, silu=silu):
                y = F.linear(x, w)
                return silu_and_mul(y) if silu else y

            times = [
                graph_seconds([lambda w=w, f=f: f(w) for w in weights]) for f in (ours, cublas)
            ]
            rate = [n * k * 2 / t / 1e12 for t in times]
            rows.append([
                name, str(m), f"{n * k * 2 / 1e6:.1f}", f"{times[0] * 1e6:.2f}",
                f"{times[1] * 1e6:.2f}", f"{rate[0]:.2f}", f"{rate[1]:.2f}",
                f"{times[1] / times[0]:.2f}x",
            ])  # fmt: skip
    return rows


# ---- small-batch projections at 1-32 rows ---------------------------------------------------

GEMV_ROWS = (1, 2, 4, 8, 16, 32)
LAYER_PROJECTIONS = {  # model: projection -> (weight rows, K, its fusion in a fused layer)
    "qwen3-0.6b": {
        "qkv": (4096, 1024, "norm"),
        "o": (1024, 2048, "add"),
        "gate|up": (6144, 1024, "norm+silu"),
        "down": (1024, 3072, "add"),
    },
    "llama-3.1-8b": {
        "qkv": (6144, 4096, "norm"),
        "o": (4096, 4096, "add"),
        "gate|up": (28672, 4096, "norm+silu"),
        "down": (4096, 14336, "add"),
    },
}


# tl.dot tiles timed beside gemv_config's: (weight rows a program, K chunk, swapped)
GEMV_DOT_TILES = ((64, 128, True), (128, 128, True), (64, 64, False), (32, 64, False))


def _gemv_configs(m: int, n_out: int, k: int, silu: bool, normed: bool, sms: int) -> list:
    """gemv_config's choice first, then the GEMV_DOT_TILES (each with its own split); at one
    row they are what the 2-16 row launches compile. One row of a weight that one_row_pays
    refuses: tl.dot only (the engine never runs FMAs there)."""
    dot = [gemv_module.dot_config(m, n_out, k, *tile, 2, sms) for tile in GEMV_DOT_TILES]
    fma = m > 1 or gemv_module.one_row_pays(n_out * 2 if silu else n_out, k)
    first = [gemv_module.gemv_config(m, n_out, k, 2, sms, normed)] if fma else []
    return list(dict.fromkeys([*first, *dot]))


def gemv_by_rows(copy_bw: float) -> tuple[list[list[str]], list[list[str]]]:
    """Each projection of a qwen3-0.6b and a llama-3.1-8b decoder layer at 1-32 rows, with
    the fusion the engine gives it (qkv: the input norm in its prologue; o and down: the
    residual add in their epilogues; gate|up: the norm and SiLU-and-mul), in a few launch
    configurations, against cuBLAS alone and against what the unfused path launches for the
    same work: qkv the fused add + norm kernel, then cuBLAS; o and down cuBLAS (their add
    goes to the next norm); gate|up the add + norm, cuBLAS, then our SiLU-and-mul. From 2
    rows a normed projection is also timed norm first: the add + norm kernel, then the
    swapped tl.dot without a prologue (DOT_TILE; SiLU in its epilogue). Each call on its own
    weights from a ring larger than L2. -> (projection rows, layer rows: the four summed)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, layers = [], {}
    for model, projections in LAYER_PROJECTIONS.items():
        for name, (n, k, fusion) in projections.items():
            silu, normed = "silu" in fusion, "norm" in fusion
            n_out = n // 2 if silu else n
            count = max(4, min(64, L2_FLUSH_BYTES // (n * k * 2)))
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.03
                       for _ in range(count)]  # fmt: skip
            norm_w = torch.rand(k, device="cuda", dtype=torch.bfloat16) + 0.5
            for m in GEMV_ROWS:
                case = _ProjectionCase(m, n, k, silu, normed, weights, norm_w)
                timed = []
                for config in _gemv_configs(m, n_out, k, silu, normed, sms):
                    try:
                        seconds = graph_seconds(case.ours(config))
                    except Exception as error:  # a configuration the compiler rejects
                        print(f"gemv {model} {name} {m} {config}: {type(error).__name__}")
                        continue
                    timed.append((seconds, config))
                cublas, alone = graph_seconds(case.cublas()), graph_seconds(case.unfused())
                default, best = timed[0][0], min(timed)
                first = None
                if normed and m >= gemv_module.DOT_ROWS:
                    plain = gemv_module.gemv_config(m, n_out, k, 2, sms)  # no prologue: swapped
                    first = graph_seconds(case.norm_first(plain))
                total = layers.setdefault((model, m), [0.0, 0.0, 0.0, 0.0])
                for i, seconds in enumerate((default, best[0], alone, first or default)):
                    total[i] += seconds
                rows.append([
                    model, f"{name} ({fusion})", str(m), f"{n * k * 2 / 1e6:.1f}",
                    f"{n * k * 2 / copy_bw * 1e6:.2f}", f"{default * 1e6:.2f}",
                    _gemv_short(timed[0][1]), f"{best[0] * 1e6:.2f}", _gemv_short(best[1]),
                    f"{cublas * 1e6:.2f}",
                    f"{alone * 1e6:.2f}", f"{alone / default:.2f}x", f"{alone / best[0]:.2f}x",
                    "-" if first is None else f"{first * 1e6:.2f}",
                    "-" if first is None else f"{alone / first:.2f}x",
                ])  # fmt: skip
            del weights
            torch.cuda.empty_cache()
    layer_rows = [
        [model, str(m), f"{ours * 1e6:.2f}", f"{best * 1e6:.2f}", f"{alone * 1e6:.2f}",
         f"{alone / ours:.2f}x", f"{alone / best:.2f}x", f"{first * 1e6:.2f}",
         f"{alone / first:.2f}x"]
        for (model, m), (ours, best, alone, first) in layers.items()
    ]  # fmt: skip
    return rows, layer_rows


class _ProjectionCase:
    """Calls of one projection at m rows, one per weight of the ring: ours (normed: the norm in
    the prologue, + SiLU with silu; else the residual add in the epilogue), cuBLAS alone, and
    the unfused sequence."""

    def __init__(self, m, n, k, silu, normed, weights, norm_w) -> None:
        self.silu, self.normed, self.weights, self.norm_w = silu, normed, weights, norm_w
        self.x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        width = k if normed else n // 2 if silu else n  # the norm's residual, or the output's
        self.residual = torch.randn(m, width, device="cuda", dtype=torch.bfloat16)

    def ours(self, config) -> list[Callable]:
        return [lambda w=w: self._ours(w, config) for w in self.weights]

    def cublas(self) -> list[Callable]:
        return [lambda w=w: F.linear(self.x, w) for w in self.weights]

    def unfused(self) -> list[Callable]:
        return [lambda w=w: self._unfused(w) for w in self.weights]

    def norm_first(self, config) -> list[Callable]:
        return [lambda w=w: self._norm_first(w, config) for w in self.weights]

    def _ours(self, w, config):
        if self.normed:
            return gemv_normed(self.x, None, self.norm_w, 1e-6, w, silu_and_mul=self.silu,
                               config=config)  # fmt: skip
        return gemv(self.x, w, add=self.residual, config=config)

    def _norm_first(self, w, config):
        fused_add_rms_norm(self.x, self.residual, self.norm_w, 1e-6)
        return gemv(self.x, w, silu_and_mul=self.silu, config=config)

    def _unfused(self, w):
        if self.normed:
            fused_add_rms_norm(self.x, self.residual, self.norm_w, 1e-6)
        y = F.linear(self.x, w)
        return silu_and_mul(y) if self.silu else y


ROW_SWEEP_SHAPES = {  # one row: name -> (weight rows, K, silu, normed)
    "qwen3-30b-a3b qkv (norm)": (5120, 2048, False, True),
    "qwen3-30b-a3b o (add)": (2048, 4096, False, False),
    "qwen3-30b-a3b router (norm)": (128, 2048, False, True),
    "qwen3-0.6b qkv (norm)": (4096, 1024, False, True),
    "qwen3-0.6b gate|up (norm+silu)": (6144, 1024, True, True),
    "qwen3-0.6b down (add)": (1024, 3072, False, False),
    "llama-3.1-8b o (add)": (4096, 4096, False, False),
}


ROW_SWEEP_HEADER = [
    "projection",
    "MB",
    "floor µs",
    "ours µs",
    "ours config",
    "best µs",
    "best config",
    "ours / best",
    "the eight fastest (rows x columns / warps: µs)",
]


def gemv_row_sweep_rows(copy_bw: float) -> list[list[str]]:
    """The one-row kernel with its fusion, in gemv_config's launch and a grid of others
    (weight rows a program, columns a chunk, warps), each call on its own weights from a ring
    larger than L2."""
    rows = []
    for name, (n, k, silu, normed) in ROW_SWEEP_SHAPES.items():
        count = max(4, min(64, L2_FLUSH_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        norm_w = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        case = _ProjectionCase(1, n, k, silu, normed, weights, norm_w)
        n_out = n // 2 if silu else n
        default = gemv_module.gemv_config(1, n_out, k, 2, 132)
        configs = [default, *_row_grid(k, (2, 4, 8, 16, 32), (512, 1024, 2048), 16384)]
        times = {c: graph_seconds(case.ours(c)) for c in dict.fromkeys(configs)}
        best = min(times, key=times.get)
        floor = n * k * 2 / copy_bw
        rows.append([
            name, f"{n * k * 2 / 1e6:.1f}", f"{floor * 1e6:.2f}", f"{times[default] * 1e6:.2f}",
            _gemv_short(default) + f", {default.num_warps} warps", f"{times[best] * 1e6:.2f}",
            _gemv_short(best) + f", {best.num_warps} warps", f"{times[default] / times[best]:.2f}x",
            _fastest(times, 8),
        ])  # fmt: skip
    return rows


def _row_grid(k: int, block_ns: tuple, block_ks: tuple, most: int) -> list:
    """One-row launches over the whole K: each (weight rows, chunk columns) of at most `most`
    weights a chunk, in 4 and 8 warps."""
    return [
        gemv_module.GemvConfig(1, block_n, block_k, triton.cdiv(k, block_k) * block_k, 1, w, 1)
        for block_n in block_ns
        for block_k in block_ks
        for w in (4, 8)
        if block_n * block_k <= most
    ]


def _row_label(config) -> str:
    """A one-row launch as weight rows x chunk columns / warps."""
    return f"{config.block_n}x{config.block_k}/{config.num_warps}w"


def _fastest(times: dict, count: int) -> str:
    """The `count` fastest launches of a sweep (launch -> seconds), each label:µs."""
    return " ".join(
        f"{_row_label(c)}:{times[c] * 1e6:.2f}" for c in sorted(times, key=times.get)[:count]
    )


def fp8_row_sweep_rows(copy_bw: float) -> list[list[str]]:
    """The FP8 kernel at one row (per-row scales, as --quantization fp8) on llama-3.1-8b's
    projections: gemv_config's launch and others (weight rows a program, columns a chunk,
    warps; K split as gemv_config splits it)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        ring = _ring(n, k, True)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        default = fp8.gemv_config(1, n, k, None, sms)
        timed: dict = {}
        for config in [default] + [
            default._replace(block_n=block_n, block_k=block_k, num_warps=warps)
            for block_n in (4, 8, 16, 32)
            for block_k in (512, 1024, 2048)
            for warps in (4, 8)
            if default.span % block_k == 0 and block_n * block_k <= 32768
        ]:
            _fp8_time(timed, ring, x, config)
        ranked = sorted(timed, key=timed.get)
        rows.append([
            name, f"{n * k / 1e6:.1f}", f"{n * k / copy_bw * 1e6:.2f}",
            f"{timed[default] * 1e6:.2f}", _fp8_short(default),
            f"{timed[ranked[0]] * 1e6:.2f}", _fp8_short(ranked[0]),
            f"{timed[default] / timed[ranked[0]]:.2f}x", _fastest(timed, 8),
        ])  # fmt: skip
        del ring
        torch.cuda.empty_cache()
    return rows


def fp8_fused_row_rows(copy_bw: float) -> list[list[str]]:
    """FP8 weights (per-row scales) at one row through gemv.py's one-row kernel, the engine's
    path: gemv_config's launch and a grid of others, against fp8.py's kernel in its launch."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for name, (n, k) in FP8_SHAPES.items():
        ring = _ring(n, k, True)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        floor = (n * k + 4 * n) / copy_bw
        old = _ring_seconds(ring, lambda w, s, x=x: fp8.fp8_gemv(x, w, s))
        default = gemv_module.gemv_config(1, n, k, 2, sms, fp8=True)
        configs = [default, *_row_grid(k, (4, 8, 16), (2048, 4096), 32768)]
        times = {
            c: _ring_seconds(ring, lambda w, s, c=c, x=x: gemv_module.gemv(x, w, config=c, scale=s))
            for c in dict.fromkeys(configs)
        }
        best = min(times, key=times.get)
        rows.append([
            name, f"{floor * 1e6:.2f}", f"{old * 1e6:.2f}", f"{times[default] * 1e6:.2f}",
            f"{floor / times[default]:.2f}", f"{old / times[default]:.2f}x",
            f"{times[best] * 1e6:.2f}", _row_label(best), _fastest(times, 6),
        ])  # fmt: skip
        del ring
        torch.cuda.empty_cache()
    return rows


FP8_FUSED_ROW_HEADER = [
    "weight", "floor µs", "fp8.py µs", "gemv.py µs", "of copy", "fp8.py / gemv.py", "best µs",
    "best", "the six fastest",
]  # fmt: skip


def _gemv_short(config) -> str:
    if config.rows == 1:
        return f"fma, {config.block_n} x {config.block_k}"
    kind = "swapped dot" if config.swap else "dot"
    return f"{kind} {config.rows} rows, {config.block_n} x {config.block_k}, split {config.split}"


GEMV_SHAPES = {  # name: (weight rows, K, gate|up with SiLU)
    "qwen3-0.6b qkv": (4096, 1024, False),
    "qwen3-0.6b o": (1024, 2048, False),
    "qwen3-0.6b gate|up + silu": (6144, 1024, True),
    "qwen3-0.6b down": (1024, 3072, False),
    "qwen3-1.7b gate|up + silu": (12288, 2048, True),
    "llama-3.2-1b down": (2048, 8192, False),
    "llama-3.1-8b o": (4096, 4096, False),
    "llama-3.1-8b qkv": (6144, 4096, False),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the markdown report here")
    parser.add_argument(
        "--sections",
        default="decode,prefill,fused,gemv",
        help="comma-separated: decode, prefill, fused, gemv, gemv-rows (the small-batch "
        "projection kernel at 1-32 rows with its fusions, against cuBLAS and the unfused "
        "kernels: sets gemv.ROW_LIMITS), gemv-row-sweep (the one-row kernel's launch "
        "configurations for qwen3-30b-a3b's, qwen3-0.6b's and llama-3.1-8b's projections), "
        "fp8-row-sweep (the FP8 kernel's launches at one row, llama-3.1-8b), fp8-row (FP8 "
        "weights at one row through the fused one-row kernel, against the FP8 kernel), "
        "sweep (launch configurations), decode-sweep (decode "
        "attention's launch configurations at 576 and 1088 tokens of context), "
        "decode-merge (a split KV's combine launch against the merge in the attention "
        "kernel, in three layer shapes), prefill-sweep (prefill launch configurations, fresh "
        "prompts and a long prompt's later chunks, in llama-3.1-8b's and qwen3-0.6b's layer "
        "shapes), sdpa (fresh prefill: torch's SDPA "
        "backends against ours, in the same shapes), fp8 (the FP8 small-batch kernel "
        "against the one it replaced, "
        "bf16 cuBLAS and copy bandwidth), fp8-sweep (its launch configurations), moe "
        "(qwen3-30b-a3b's MoE GEMMs at 1, 8 and 32 tokens against their launch before and "
        "copy bandwidth), moe-sweep (their launch configurations), moe-block (its whole MoE "
        "block, router to output, against the kernel sequence before issue 21's fusions), "
        "moe-route (its routing kernel alone, in each warp count), "
        "lora (llama-3.1-8b's LoRA shrink and expand per layer: who sums the split-K "
        "partials, the split and chunk of K)",
    )
    args = parser.parse_args()
    chosen = set(args.sections.split(","))
    torch.manual_seed(0)
    copy_bw, matmul = copy_bandwidth(), matmul_flops()
    attention_sections = {"decode", "prefill", "sweep", "decode-sweep"}
    pool = KVPool(blocks=128 * 8192 // BLOCK) if chosen & attention_sections else None
    sections = [
        f"# Kernel benchmarks: {torch.cuda.get_device_name()}\n\n"
        f"commit {commit()}, {datetime.date.today()}, torch {torch.__version__}, "
        f"triton {triton.__version__}; kernels timed inside CUDA graphs, bf16\n",
        f"Ceilings: device-to-device copy {copy_bw / 1e12:.2f} TB/s (read + written), "
        f"torch bf16 matmul 8192^3 {matmul / 1e12:.0f} TFLOP/s\n",
    ]
    if "decode" in chosen:
        sections.append(
            f"## Decode attention (query length 1; {HEADS} heads, {KV_HEADS} KV heads, head_dim "
            f"{HEAD_DIM}; target: KV read at >= {DECODE_TARGET:.0%} of copy bandwidth at batch "
            ">= 8, context >= 2k)\n\n"
            + table(
                ["batch", "context", "µs", "KV MB", "TB/s", "of copy", "target", "vs target"],
                decode_rows(pool, copy_bw),
            )
        )
    if "prefill" in chosen:
        sections.append(
            "## Prefill attention (causal, fresh prompts; targets as fractions of the matmul "
            "rate)\n\n"
            + table(
                ["tokens", "ms (cache only)", "ms", "TFLOP/s", "of matmul", "target", "vs"],
                prefill_rows(pool, matmul),
            )
        )
    if "fused" in chosen:
        sections.append(
            "## Fused kernels against the torch sequences they replace (Llama-3.1-8B sizes; µs "
            "per call in a CUDA graph, and eager by do_bench)\n\n"
            + table(
                [
                    "op",
                    "tokens",
                    "triton graph",
                    "torch graph",
                    "speedup",
                    "triton eager",
                    "torch eager",
                ],
                fused_rows(),
            )  # fmt: skip
        )
    if "gemv" in chosen:
        sections.append(
            "## Small-batch projections: gemv against cuBLAS (µs per call in a CUDA graph; TB/s "
            "of weight read)\n\n"
            + table(
                [
                    "weight",
                    "rows",
                    "MB",
                    "gemv µs",
                    "cuBLAS µs",
                    "gemv TB/s",
                    "cuBLAS TB/s",
                    "speedup",
                ],
                gemv_rows(copy_bw),
            )  # fmt: skip
        )
    if "gemv-row-sweep" in chosen:
        sections.append(
            "## The one-row projection kernel's launches (µs per call in a CUDA graph; floor: "
            "the weights read at copy bandwidth)\n\n"
            + table(ROW_SWEEP_HEADER, gemv_row_sweep_rows(copy_bw))
        )
    if "fp8-row-sweep" in chosen:
        sections.append(
            "## The FP8 kernel at one row: its launches (µs per call in a CUDA graph; floor: "
            "the FP8 weights read at copy bandwidth)\n\n"
            + table(ROW_SWEEP_HEADER, fp8_row_sweep_rows(copy_bw))
        )
    if "fp8-row" in chosen:
        sections.append(
            "## FP8 weights at one row through the fused one-row kernel (µs per call in a CUDA "
            "graph; floor: the FP8 weights and scales read at copy bandwidth)\n\n"
            + table(FP8_FUSED_ROW_HEADER, fp8_fused_row_rows(copy_bw))
        )
    if "gemv-rows" in chosen:
        projection_rows, layer_rows = gemv_by_rows(copy_bw)
        sections.append(
            "## Small-batch projections at 1-32 rows: ours with its fusions against cuBLAS "
            "and the unfused kernels (µs per call in a CUDA graph; floor: the weights read at "
            "copy bandwidth)\n\n"
            + table(
                [
                    "model",
                    "projection (fusion)",
                    "rows",
                    "MB",
                    "floor µs",
                    "ours µs",
                    "ours config",
                    "best µs",
                    "best config",
                    "cuBLAS µs",
                    "unfused µs",
                    "ours vs unfused",
                    "best vs unfused",
                    "norm first µs",
                    "norm first vs unfused",
                ],
                projection_rows,
            )  # fmt: skip
            + "\n\nours: gemv_config's launch; best: the fastest of it and the other tl.dot "
            "tiles. unfused: what the engine launches without the kernel (qkv: add + norm, "
            "cuBLAS; o, down: cuBLAS; gate|up: add + norm, cuBLAS, SiLU-and-mul). norm first "
            "(a normed projection from 2 rows): add + norm, then the swapped tl.dot without a "
            "prologue (SiLU in its epilogue); in the layer sums, with ours for o and down.\n\n"
            "### A decoder layer's four projections, summed\n\n"
            + table(
                [
                    "model",
                    "rows",
                    "ours µs",
                    "best µs",
                    "unfused µs",
                    "ours vs unfused",
                    "best vs unfused",
                    "norm first µs",
                    "norm first vs unfused",
                ],
                layer_rows,
            )  # fmt: skip
        )
    if "fp8" in chosen:
        sections.append(
            "## FP8 weights, small batches (Llama-3.1-8B projections, per-row scales, bf16 x; "
            "µs per call in a CUDA graph; floor: the FP8 weights read at copy bandwidth)\n\n"
            + table(
                [
                    "weight",
                    "rows",
                    "FP8 MB",
                    "ours µs",
                    "ours: launch",
                    "weight-only dot µs",
                    "FP8 dot µs",
                    "before µs",
                    "bf16 cuBLAS µs",
                    "floor µs",
                    "ours of copy",
                    "vs before",
                    "vs bf16",
                ],
                fp8_rows(copy_bw),
            )  # fmt: skip
            + "\n\nweight-only dot / FP8 dot: the kernel's tl.dot rows in gemv_config's launch "
            "with the FP8 dot off (x bfloat16, the weights widened) and on (x quantised to FP8 "
            "per group of 128 columns). before: the kernel this one replaced "
            "(`benchmarks/fp8_gemv_before.py`) up to 8 rows; above, `_scaled_mm` (x quantised "
            "per token, cuBLAS FP8), which fp8_linear took there."
        )
    if "fp8-sweep" in chosen:
        sections.append(
            "## FP8 small-batch kernel launch configurations (fastest first)\n\n"
            + table(["case", "config", "µs", "of copy"], fp8_sweep_rows(copy_bw))
        )
    rings = moe_rings() if chosen & {"moe", "moe-sweep", "moe-block"} else None
    if "moe" in chosen:
        sections.append(
            f"## Mixture of experts, decode sizes (qwen3-30b-a3b: {MOE_EXPERTS} experts, top "
            f"{MOE_TOP_K}, hidden {MOE_HIDDEN}, expert intermediate {MOE_INTER}; bf16; routing "
            "from random logits; µs per call in a CUDA graph; floor: the active experts' weights "
            "read at copy bandwidth)\n\n"
            + table(
                [
                    "GEMM",
                    "tokens",
                    "active MB",
                    "ours µs",
                    "ours: launch",
                    "before µs",
                    "floor µs",
                    "ours of copy",
                    "before of copy",
                    "vs before",
                ],
                moe_rows(rings, copy_bw),
            )  # fmt: skip
            + "\n\nbefore: every batch's launch before issue 21 (tl.dot on blocks of 16 pairs, "
            "64 x 64 tiles, no split, 4 warps, 3 stages). layer: align, both GEMMs, the sum "
            "over a token's choices (gate|up / down launches)."
        )
    if "moe-block" in chosen:
        sections.append(
            "## Mixture of experts, the whole block (qwen3-30b-a3b; from the router to the "
            "layer's output, the norm before it excluded; µs per call in a CUDA graph; floor: "
            "the router's and the active experts' weights read at copy bandwidth)\n\n"
            + table(
                [
                    "tokens",
                    "active MB",
                    "ours µs",
                    "before µs",
                    "floor µs",
                    "ours of copy",
                    "before of copy",
                    "vs before",
                ],
                moe_block_rows(rings, copy_bw),
            )  # fmt: skip
            + "\n\nours: the router by the small-batch kernel where it pays, route and align in "
            "one program (up to 256 pairs), gate|up, down summing each token's choices (up to "
            f"{moe.SUM_PAIRS} pairs). before: the router through cuBLAS, route, align, gate|up, "
            "a zeroed [pairs, hidden] output, down, the sum over choices."
        )
    if "moe-route" in chosen:
        sections.append(
            "## MoE routing alone (route_and_align; µs per call in a CUDA graph)\n\n"
            + table(["tokens", "warps", "µs"], moe_route_rows())
        )
    if "moe-sweep" in chosen:
        sections.append(
            "## MoE grouped GEMM launch configurations (fastest first)\n\n"
            + table(["case", "config", "µs", "of copy"], moe_sweep_rows(rings, copy_bw))
        )
    if "sweep" in chosen:
        sections.append(
            "## Attention launch configurations (µs, fastest first)\n\n"
            + table(["case", "config", "µs"], sweep_rows(pool))
        )
    if "decode-sweep" in chosen:
        sections.append(
            "## Decode attention launch configurations at short contexts (µs, fastest first)\n\n"
            + table(["case", "config", "µs"], decode_sweep_rows(pool))
        )
    if "decode-merge" in chosen:
        sections.append(
            "## Decode attention with a split KV: combine launch against the merge in the "
            "attention kernel (µs per call in a CUDA graph)\n\n"
            + table(
                ["layer", "batch", "context", "splits", "combine µs", "merged µs", "ratio"],
                merge_rows(),
            )
        )
    if "lora" in chosen:
        sections.append(
            "## LoRA shrink + expand (llama-3.1-8b, rank 16; µs per layer of four projections "
            "in a CUDA graph; who sums the split-K partials; splits and chunk of K)\n\n"
            + table(
                ["tokens x adapters", "sums", "split", "block_k", "µs per layer", "vs before"],
                lora_rows(),
            )
        )
    if "prefill-sweep" in chosen:
        sections.append(
            "## Prefill attention launch configurations, per layer shape (fastest first)\n\n"
            + table(["case", "config", "µs", "of matmul"], prefill_sweep_rows(matmul))
        )
    if "sdpa" in chosen:
        sections.append(
            "## Fresh causal prefill: torch SDPA backends against our paged kernel\n\n"
            + table(["layer", "tokens", "kernel", "ms", "TFLOP/s", "of matmul"], sdpa_rows(matmul))
        )
    report = "\n\n".join(sections) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)


if __name__ == "__main__":
    main()
