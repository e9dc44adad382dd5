"""Paged attention through the Triton kernels: every size is read on the device. A step of whole
fresh prompts of one length, large enough that the GPU and not the host sets its time, goes to
torch's SDPA instead (cuDNN's fused attention on Hopper): it needs no cache, and is 1.2-1.5x our
kernel's rate there (benchmarks/bench_kernels.py --sections sdpa). Smaller fresh prompts take
the paged kernel, which reads their KV from the step's k and v rather than the cache."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ostinato.attention.base import (
    AttentionBackend,
    AttentionPlan,
    GraphSupport,
    Rotation,
    register_attention_backend,
)
from ostinato.context import AttentionMetadata
from ostinato.graphs.breakable import replay_memo
from ostinato.kernels import PagedAttention, variants
from ostinato.kernels.paged_attention import LayerShape, Rope, attention_sms, launch_classes

# Measured on the H100 (qwen3-0.6b, one prompt, the same process): 2,048 tokens 7.55 ms with
# SDPA vs 7.41 without (the step is host-bound there), 4,096 13.9 vs 15.5, 8,192 33.5 vs 38.5.
SDPA_MIN_TOKENS = 4096
# A graphed decode step of one request keeps the separate RoPE + store kernel: its QKV
# projection is the one-row kernel (kernels/gemv.py), which lets the next kernel launch early
# (PDL), and a rotating attention launch waiting beside it cost qwen3-30b-a3b's batch 1 7-8%
# and llama-3.1-8b's 1.4%, while qwen3-0.6b's gain was unstable (benchmarks/
# h100-2026-11-27-s32.md and -s33.md: a later trigger moved the cost to qwen3-0.6b, a one-wave
# QKV launch changed nothing). The H200 agrees: rotating at one request cost FP8 llama-3.1-8b
# 1.9% and qwen3-30b-a3b 10%, and gained qwen3-0.6b 1.3% (h200-2026-11-28-s42.md, -s43.md).
# From two requests the projection is cuBLAS and rotating takes 3-5% off qwen3-0.6b's batch 32
# (-s31.md). An eager step of one request rotates too: it pays each launch in host time, not
# in a graph's device time.
ROTATE_MIN_REQS = 2
# cuDNN first; flash, then the memory-efficient kernel (float32) where cuDNN declines
_SDPA_ORDER = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


@register_attention_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    graph_support = GraphSupport.ALWAYS

    def __init__(self) -> None:
        self.eager = EagerLaunches()

    def plan(self, meta: AttentionMetadata) -> AttentionPlan:
        return TritonAttentionPlan(meta, self.eager)

    def warm_up_batches(
        self, num_heads: int, k_cache: torch.Tensor, width: int, max_reqs: int, max_tokens: int
    ) -> list[tuple[int, int]]:
        """A batch per compiled attention kernel (paged_attention.launch_classes). Graph
        warm-ups compile only what graphs launch; an eager step merges a split KV in its own
        kernel, which a step would otherwise compile on first use: about a second during which
        every request waits (the H100 host, benchmarks/h100-2026-11-26-s24.md)."""
        shape = LayerShape.of(num_heads, k_cache)
        return launch_classes(shape, width, attention_sms(k_cache.device), max_reqs, max_tokens)


class TritonAttentionPlan:
    """A PagedAttention per layer shape (every layer of a model has the same one), made at the
    first layer's call and launched by the rest; or, for a step of fresh prompts, SDPA.
    A step of one token per request rotates (`rotates`): its launch also applies RoPE (and
    Qwen3's norms) to q and k and stores k and v (kernels/paged_attention.py, ROPE), with the
    model's one cos|sin table, taken from the first layer's rotation."""

    def __init__(self, meta: AttentionMetadata, eager: EagerLaunches) -> None:
        self.meta = meta
        self.eager = eager
        self.launches: dict[tuple, PagedAttention] = {}
        self.fresh = fresh_prompts(meta)
        # the key's uniform length, not the counts: a FULL graph of n tokens and n requests
        # (mode full) replays chunks and verify steps too
        self.decode = meta.uniform_query_len == 1 and meta.num_tokens > 0 and self.fresh is None

    @property
    def rotates(self) -> bool:
        """A decode step of ROTATE_MIN_REQS requests or more, or any eager one. Asked at each
        call: lazy capture runs a live step's plan as a graph's warm-up and capture, which
        take the graph's kernels (variants watches both)."""
        return self.decode and (self.meta.num_reqs >= ROTATE_MIN_REQS or variants.mode is None)

    def __call__(
        self, q, k, v, out, k_cache, v_cache, scale: float, rotation: Rotation | None = None
    ) -> None:
        if self.fresh is not None and _eager(q):
            return causal_prefill(q, k, v, out, *self.fresh, scale)
        memo = replay_memo()
        if memo is not None:
            return self._replay(memo, q, k, v, out, k_cache, v_cache, scale)
        launch = self._get(q, k, out, k_cache, scale, rotation)
        if rotation is None:
            launch(q, k_cache, v_cache, out, k, v)
        else:
            launch(q, k_cache, v_cache, out, k, v, rotation.q_weight, rotation.k_weight)

    def _replay(self, memo: dict, q, k, v, out, k_cache, v_cache, scale: float) -> None:
        """A graph break's call (never rotating): its tensors are the same at every replay, so
        its key, and its launch's arguments while this step's instance and the layer's caches
        are the ones they were bound to, are kept in the break's memo. That halves the host
        time of a PIECEWISE decode step's breaks (benchmarks/h200-2026-11-28-s44.md). A
        binding is made at the second replay in a row with the same instance and caches: mixed
        steps whose request count changes from step to step take another instance each time,
        and would pay a binding every step."""
        # merge=False: the break's instance leaves a split KV to the combine launch, as graphs
        # do. Both launches are bound, so the second costs one launcher call of host time, and
        # the pair less device time than the merged kernel: qwen3-0.6b's PIECEWISE batch 1
        # 2.1% faster on the H200 (benchmarks/h200-2026-11-28-s44.md)
        key = memo.get("key") or memo.setdefault(
            "key", self._key(q, k, out, k_cache, scale, merge=False)
        )
        launch = self.launches.get(key) or self._get(q, k, out, k_cache, scale, None, key)
        held = memo.get("bound")
        again = held is not None and held[0] is launch and held[1] is k_cache and held[2] is v_cache
        if again and held[3] is not None:
            return held[3]()
        launch(q, k_cache, v_cache, out, k, v)
        bound = launch.bind(q, k_cache, v_cache, out, k, v) if again else None
        memo["bound"] = (launch, k_cache, v_cache, bound)  # held with what bound points into

    def _get(
        self, q, k, out, k_cache, scale: float, rotation: Rotation | None, key: tuple = ()
    ) -> PagedAttention:
        key = key or self._key(q, k, out, k_cache, scale, rotation)
        launch = self.launches.get(key)
        if launch is None:
            launch = self.launches[key] = self._launch(key, q, k, out, k_cache, scale, rotation)
        return launch

    @staticmethod
    def _key(
        q, k, out, k_cache, scale: float, rotation: Rotation | None = None, merge: bool = True
    ) -> tuple:
        """merge (last): whether an eager instance merges a split KV in the attention kernel"""
        norms = rotation is not None and (rotation.q_weight is not None, rotation.eps)
        return (q.shape, q.stride(), out.stride(), k.stride(), k_cache.stride(), q.dtype, scale,
                norms, merge)  # fmt: skip

    def _launch(self, key, q, k, out, k_cache, scale, rotation) -> PagedAttention:
        m = self.meta
        tensors = (m.query_start_loc, m.seq_lens, m.block_table)
        rope = None
        if rotation is not None:
            assert self.rotates, "rotation is for steps of one token per request"
            norm = rotation.q_weight is not None
            rope = Rope(rotation.cos_sin_cache, m.slot_mapping, norm, rotation.eps)
        if _eager(q):
            return self.eager.get(key, q, k, out, k_cache, tensors, scale, rope, merge=key[-1])
        return PagedAttention(q, out, k_cache, *tensors, scale, new_kv=k, rope=rope)


def _eager(q: torch.Tensor) -> bool:
    """Neither a graph's warm-up (variants recording) nor its capture: a capture must not bake
    one step's lengths into a graph (the paged kernel reads them), a warm-up must launch the
    kernels its capture will, and neither takes or fills the cache of eager steps."""
    return variants.mode is None and not _capturing(q)


class EagerLaunches:
    """PagedAttention instances kept across eager steps (building one costs about 160 µs on
    the build machine, 3-4% of an eager decode step's host time). An instance is fixed by
    shapes, strides, cache geometry, dtype, device and the addresses of the metadata tensors
    its launches hold (slices of the runner's persistent buffers, the same every step); it
    reads lengths on the device, so it serves any later step of that form. Graph captures
    never take one: a graph keeps using the scratch of the instance it captured, which must
    live in the graph's memory pool, not be freed when this cache drops it. Warm-ups neither
    (they run on the capture stream). An eager step's instance merges a split KV in the
    attention kernel (merge=True): one launch a layer fewer, which costs host time here and
    device time in a graph, so graphs keep the combine launch, and so do a PIECEWISE step's
    breaks, whose launches are bound (TritonAttentionPlan._replay)."""

    SIZE = 32  # kinds of step kept: decode batch sizes and prefill chunk lengths come and go

    def __init__(self) -> None:
        self.launches: dict[tuple, PagedAttention] = {}

    def get(
        self, key: tuple, q, k, out, k_cache, tensors: tuple, scale: float, rope: Rope | None,
        merge: bool = True,
    ) -> PagedAttention:  # fmt: skip
        """The instance for a step whose first layer passes these (`key`: the plan's)."""
        held = (*tensors, *rope[:2]) if rope else tensors
        where = ((t.data_ptr(), t.shape, t.stride()) for t in held)
        full = (*key, q.device, k_cache.shape, *where)
        launch = self.launches.pop(full, None)
        if launch is None:
            launch = PagedAttention(
                q, out, k_cache, *tensors, scale, merge=merge, new_kv=k, rope=rope
            )
            if len(self.launches) >= self.SIZE:  # the least recently used goes
                del self.launches[next(iter(self.launches))]
        self.launches[full] = launch  # (re)inserted last: the most recently used
        return launch


def _capturing(t: torch.Tensor) -> bool:
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def fresh_prompts(meta: AttentionMetadata) -> tuple[int, int] | None:
    """(prompts, length) when the step is that many whole prompts of one length with nothing
    cached before them (the first requests; the rest padding) and at least SDPA_MIN_TOKENS.
    Every step makes a plan, so a decode step must leave at the first line (plain ints)."""
    if meta.num_tokens < SDPA_MIN_TOKENS:  # the padded count: never below the real one
        return None
    starts, seq_lens = meta.query_start_loc_cpu.tolist(), meta.seq_lens_cpu.tolist()
    q_lens = [b - a for a, b in zip(starts[:-1], starts[1:], strict=True)]
    prompts = next((i for i, n in enumerate(q_lens) if n == 0), len(q_lens))
    if prompts == 0 or any(q_lens[prompts:]):
        return None
    length = q_lens[0]
    real = q_lens[:prompts]
    if (
        real != [length] * prompts
        or seq_lens[:prompts] != real
        or prompts * length < SDPA_MIN_TOKENS
    ):
        return None
    return prompts, length


def causal_prefill(q, k, v, out, prompts: int, length: int, scale: float) -> None:
    """out = causal attention of each prompt over its own k and v (this step's, rotated), by
    torch's SDPA on [prompts, heads, length, head_dim] views of the step's rows."""
    n = prompts * length

    def heads_first(t: torch.Tensor) -> torch.Tensor:
        return t[:n].view(prompts, length, t.shape[1], t.shape[2]).transpose(1, 2)

    with sdpa_kernel(_SDPA_ORDER, set_priority=True):
        o = F.scaled_dot_product_attention(
            heads_first(q), heads_first(k), heads_first(v), is_causal=True, scale=scale,
            enable_gqa=True,
        )  # fmt: skip
    heads_first(out).copy_(o)
