"""On the GPU: the fused MoE kernel against float64 math, and both MoE models (reduced sizes) in
every graph mode against eager, the graph checker on."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES, engine, mixed_workload
from test_moe_kernels import problem, reference

from ostinato.kernels.moe import align, align_torch, fused_moe, route, route_torch

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


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 128, 8), (32, 128, 8), (5, 8, 2)])
def test_the_one_program_align_equals_the_torch_one(tokens, experts, top_k):
    ids = torch.rand(tokens, experts).topk(top_k, -1).indices.to(torch.int32).cuda()
    ids[-1, :] = -1
    blocks = -(-ids.numel() // 16) + min(experts, ids.numel())
    want = align_torch(ids, experts, 16, blocks)
    got = align(ids, experts)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


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
