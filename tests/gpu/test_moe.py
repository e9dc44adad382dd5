"""On the GPU: the fused MoE kernel against float64 math, and both MoE models (reduced sizes) in
every graph mode against eager, the graph checker on."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES, engine, mixed_workload
from test_moe_kernels import crowded, problem, reference

from ostinato.kernels.moe import (
    MoeConfig,
    align,
    align_torch,
    fused_moe,
    num_blocks,
    route,
    route_torch,
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
