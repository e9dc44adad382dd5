"""On the GPU: the fused MoE kernel against float64 math, and both MoE models (reduced sizes) in
every graph mode against eager, the graph checker on."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES, engine, mixed_workload
from test_moe_kernels import crowded, problem, reference, routing64

from ostinato.kernels import moe
from ostinato.kernels.moe import (
    MoeConfig,
    align,
    align_torch,
    fused_moe,
    fused_moe_torch,
    num_blocks,
    route,
    route_and_align,
    route_torch,
    routed_moe,
)

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens, padded", [(1, 0), (7, 3), (300, 10)])
def test_fused_moe_kernel_equals_float64_math(dtype, tol, tokens, padded):
    x, w13, w2, ids, weights = problem(tokens, 16, 4, 256, 96, padded=padded)
    want = reference(x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights)
    args = (t.cuda() for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), ids, weights))
    got = fused_moe(*args).double().cpu()
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("renormalize", [False, True])
def test_route_kernel_equals_softmax_top_k(renormalize):
    logits = torch.randn(300, 128, device="cuda") * 3  # float32: no ties
    slots = torch.arange(300, device="cuda")
    slots[-7:] = -1
    weights, ids = route(logits, 8, renormalize, slots)
    want_w, want_ids = route_torch(logits, 8, renormalize, slots)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w)


@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (32, 128, 8), (5, 8, 2)])
def test_the_one_program_align_equals_the_torch_one(tokens, experts, top_k, block_m):
    ids = torch.rand(tokens, experts).topk(top_k, -1).indices.to(torch.int32).cuda()
    ids[-1, :] = -1
    want = align_torch(ids, experts, block_m, num_blocks(ids.numel(), experts, block_m))
    got = align(ids, experts, block_m)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


LAUNCHES = [
    MoeConfig(1, 16, 256, 1, 4, 1),  # FMAs, the span unrolled
    MoeConfig(1, 8, 128, 2, 4, 1),  # FMAs, K split
    MoeConfig(1, 4, 64, 3, 4, 1),  # FMAs, K split in three (down: in two)
    MoeConfig(16, 32, 64, 3, 4, 4),  # tl.dot, K split
    MoeConfig(16, 64, 64, 1, 4, 3),  # the large-batch launch
]


@pytest.mark.parametrize("config", LAUNCHES)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("tokens, padded", [(1, 0), (7, 3), (40, 2)])
def test_every_launch_equals_float64_math(config, dtype, tol, tokens, padded):
    """Compiled: bfloat16 tl.dot, the FMA path and the split's atomic counts, which the
    interpreter runs one program at a time; twice, for the same bits."""
    x, w13, w2, ids, weights = problem(tokens, 16, 4, 256, 96, padded=padded)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    want = reference(x, w13, w2, ids, weights)
    args = [t.cuda() for t in (x, w13, w2, ids, weights)]
    got = fused_moe(*args, configs=(config, config))
    torch.testing.assert_close(got.double().cpu(), want, rtol=tol, atol=tol)
    assert torch.equal(fused_moe(*args, configs=(config, config)), got)


def test_crowded_routing_in_every_launch():
    """One expert in every token's choices, one unused, a padded token."""
    for config in LAUNCHES:
        x, w13, w2, ids, weights = crowded(torch.float32)
        got = fused_moe(*(t.cuda() for t in (x, w13, w2, ids, weights)), configs=(config, config))
        torch.testing.assert_close(got.double().cpu(), reference(x, w13, w2, ids, weights),
                                   rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_30b_experts():
    """One qwen3-30b-a3b MoE layer, bf16: router [128, 2048], w13 [128, 1536, 2048], w2
    [128, 2048, 768]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=g, device="cuda").mul_(0.02).bfloat16()
    return make(128, 2048), make(128, 1536, 2048), make(128, 2048, 768)


def _captured(fn, *inputs):
    """fn(*inputs) run once eagerly (allocations, compiles), then captured in a CUDA graph:
    -> (the graph, its outputs), to replay after new values are copied into inputs."""
    fn(*inputs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn(*inputs)
    return graph, outputs


@pytest.mark.parametrize("tokens", [1, 8, 32])
def test_decode_moe_kernels_in_a_cuda_graph_equal_their_references(qwen3_30b_experts, tokens):
    """qwen3-30b-a3b's decode sizes, replayed in a CUDA graph with inputs the capture never saw
    (a padded token among them; one token: padding in the second replay): route_and_align
    (one program; one warp for one token) equals float64 routing and align_torch; the layer
    (its down GEMM summing each token's choices) equals the torch twin in float32 and the
    zeroed output and sum kernel it replaced (SUM_PAIRS 0)."""
    gate, w13, w2 = qwen3_30b_experts
    x = torch.empty(tokens, 2048, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(tokens, device="cuda")
    block_m = moe.moe_configs(tokens * 8, w13, w2, x.device)[0].block_m
    logits = torch.empty(tokens, 128, device="cuda", dtype=torch.bfloat16)
    routing = _captured(lambda lg, s: route_and_align(lg, 8, True, s, block_m), logits, slots)
    layer = _captured(lambda x, lg, s: routed_moe(x, lg, w13, w2, 8, True, s), x, logits, slots)
    for seed in range(2):
        g = torch.Generator(device="cuda").manual_seed(seed + 1)
        x.copy_(torch.randn(tokens, 2048, generator=g, device="cuda"))
        logits.copy_(x @ gate.T)
        slots.copy_(torch.arange(tokens, device="cuda"))
        slots[-1] = -1 if tokens > 1 or seed == 1 else 0  # one token: padding on its 2nd
        for graph, _ in (routing, layer):
            graph.replay()
        weights, ids, (sorted_ids, block_experts) = routing[1]
        want_w, want_ids = routing64(logits, 8, True, slots)  # bf16 logits tie: lowest first
        assert torch.equal(ids, want_ids)
        live = slots >= 0
        torch.testing.assert_close(weights[live].double(), want_w[live], rtol=1e-5, atol=1e-6)
        blocks = num_blocks(tokens * 8, 128, block_m)
        want_sorted, want_experts = align_torch(want_ids, 128, block_m, blocks)
        assert torch.equal(sorted_ids, want_sorted) and torch.equal(block_experts, want_experts)
        got = layer[1].float()
        want_w = want_w.float()
        want = fused_moe_torch(x.float(), w13.float(), w2.float(), want_ids, want_w)
        size = want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=3e-2, atol=3e-2 * size)
        if slots[-1] < 0:
            assert got[-1].abs().max() == 0
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(moe, "SUM_PAIRS", 0)
            old = fused_moe(x, w13, w2, want_ids, want_w).float()
        torch.testing.assert_close(got, old, rtol=1e-2, atol=1e-2 * size)


def test_every_mode_matches_eager_token_for_token(checkpoint):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_tokens = mixed_workload(engine(checkpoint, "none"))
    for mode in MODES[1:]:
        llm = engine(checkpoint, mode, check_graphs=1)
        assert mixed_workload(llm) == reference_tokens, mode
        steps = llm.graph_report()["steps"]
        if mode in ("full", "full_decode_only", "full_and_piecewise"):
            assert steps["full"] > 0, steps
        del llm
        gc.collect()


def test_bfloat16_graph_checker_passes(checkpoint):
    llm = engine(checkpoint, "full_and_piecewise", dtype="bfloat16", check_graphs=1)
    mixed_workload(llm)  # raises if a graphed step's logits leave eager's
    steps = llm.graph_report()["steps"]
    assert steps["full"] > 0 and steps["piecewise"] > 0, steps
