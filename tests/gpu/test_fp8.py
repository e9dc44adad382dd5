"""On the GPU: the FP8 kernels (GEMV, tiled block GEMM, _scaled_mm) against float64 math, and FP8
models (at load and a block-wise checkpoint) in every graph mode against eager, checker on."""

import gc

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import MODES, engine, mixed_workload
from test_quantization import float64_linear, fp8_pair, quantize_blocks  # noqa: F401 (fixture)

from ostinato.kernels.fp8 import GEMV_ROWS, fp8_linear, quantize_rows, quantize_tokens

pytestmark = pytest.mark.gpu


def weights(rows: int, n: int = 1024, k: int = 512, blockwise: bool = False):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.05
    q, scale = quantize_blocks(w) if blockwise else quantize_rows(w)
    return x, q, scale


@pytest.mark.parametrize("rows, k", [(1, 512), (1, 8192), (3, 512), (8, 4096), (16, 512),
                                     (32, 4096), (40, 512), (300, 512)])  # fmt: skip
@pytest.mark.parametrize("blockwise", [False, True])
def test_fp8_linear_equals_float64_math(rows, k, blockwise):
    """K = 4096 and 8192: the small-batch kernel splits K."""
    x, q, scale = weights(rows, k=k, blockwise=blockwise)
    block = (128, 128) if blockwise else None
    want = float64_linear(x.bfloat16(), q, scale, 128 if blockwise else None)
    got = fp8_linear(x.bfloat16().cuda(), q.cuda(), scale.cuda(), block=block).double().cpu()
    size = want.abs().max().item()
    if blockwise or rows <= GEMV_ROWS:  # weight-only: within bfloat16 rounding of the output
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * size)
    else:  # _scaled_mm: activations rounded to FP8 per token as well
        torch.testing.assert_close(got, want, rtol=0.1, atol=0.03 * size)
        cos = torch.nn.functional.cosine_similarity(got.flatten(), want.flatten(), dim=0)
        assert cos > 0.998


def test_fp8_gemv_widens_every_fp8_value_exactly():
    """Weight row n holds every finite FP8 byte, rotated by n; x picks columns 0..15, the
    scales are 1: y[m, n] is byte (n + m) % 256 as a value, which bfloat16 holds exactly (the
    bit moves of _bf16_from_fp8 on tl.dot's path, subnormals included)."""
    codes = (torch.arange(256)[:, None] + torch.arange(256)[None, :]) % 256
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN bytes
    q = codes.to(torch.uint8).view(torch.float8_e4m3fn).cuda()
    x = torch.eye(16, 256, dtype=torch.bfloat16, device="cuda")
    y = fp8_linear(x, q, torch.ones(256, 1, device="cuda"))
    assert torch.equal(y.float(), q[:, :16].T.float())


def test_per_token_fp8_activations_in_one_kernel_equal_their_definition():
    """(On the GPU: the interpreter rounds float32 to FP8 wrongly at binade boundaries.)"""
    x = torch.randn(5, 14336) * torch.logspace(-3, 2, 5)[:, None]
    q, scale = quantize_tokens(x.bfloat16().cuda())
    want_scale = x.bfloat16().float().abs().amax(1, keepdim=True) / 448.0
    torch.testing.assert_close(scale.cpu(), want_scale)
    want = (x.bfloat16().float() / want_scale).to(torch.float8_e4m3fn)
    torch.testing.assert_close(q.float().cpu(), want.float(), rtol=0, atol=0)


def test_fp8_linear_is_capturable_and_replays_equal():
    for rows, k, blockwise in ((1, 512, False), (1, 8192, False), (4, 512, True),
                               (32, 4096, False), (64, 512, False), (64, 512, True)):  # fmt: skip
        x, q, scale = (t.cuda() for t in weights(rows, k=k, blockwise=blockwise))
        x = x.bfloat16()
        block = (128, 128) if blockwise else None
        want = fp8_linear(x, q, scale, block=block)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fp8_linear(x, q, scale, block=block)
        for _ in range(3):  # split launches leave their counts at 0 for the next replay
            out.zero_()
            graph.replay()
            torch.testing.assert_close(out, want, rtol=0, atol=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"))


def every_mode_equals_eager(model, exact: bool = True, **kw):
    """Tokens equal eager's (exact) and the checker passes in every graph mode; bfloat16's
    padded batches may round differently, so there the checker alone judges."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = mixed_workload(engine(model, "none", **kw))
    for mode in MODES[1:]:
        llm = engine(model, mode, check_graphs=1, **kw)
        tokens = mixed_workload(llm)  # raises if a graphed step's logits leave eager's
        assert tokens == reference or not exact, mode
        if mode in ("full", "full_decode_only", "full_and_piecewise"):
            assert llm.graph_report()["steps"]["full"] > 0
        del llm
        gc.collect()


def test_fp8_at_load_every_mode_passes_the_checker_in_bfloat16(checkpoint):
    """bfloat16: the GEMV, and _scaled_mm for the larger padded batches."""
    every_mode_equals_eager(checkpoint, exact=False, quantization="fp8", dtype="bfloat16")


def test_block_wise_fp8_checkpoint_every_mode_matches_eager(fp8_pair):  # noqa: F811
    """float32, tokens equal: the GEMV and the tiled block GEMM."""
    every_mode_equals_eager(fp8_pair[0])
