"""On the GPU: LoRA in every graph mode equals eager with mixed adapters (checker on), graphs
keyed by the active-adapter count are replayed, float32 tokens equal transformers + peft, and
the Triton kernels match their torch versions in bfloat16 on Llama-3.1-8B shapes."""

import gc

import peft
import pytest
import torch
from helpers import make_hf_checkpoint, make_peft_adapter
from oracle import hf_greedy, hf_model, oracle_prompts

from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.context import ForwardContext, LoRAMetadata, forward_context
from ostinato.graphs.breakable import BreakableGraph
from ostinato.kernels import launch, variants
from ostinato.kernels import lora as lora_kernels
from ostinato.kernels.activation import silu_and_mul_torch
from ostinato.kernels.lora import (
    lora_expand,
    lora_expand_silu,
    lora_expand_torch,
    lora_shrink,
    lora_shrink_torch,
)
from ostinato.layers.linear import Linear
from ostinato.lora import layer as lora_layer
from ostinato.lora.layer import LoRALinear
from ostinato.runner.input_buffers import group_by_adapter

pytestmark = pytest.mark.gpu

MODES = ["none", "piecewise", "full", "full_decode_only", "full_and_piecewise"]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def lora_models(request, tmp_path_factory):
    """A checkpoint and three adapters (`b` on a few projections, rsLoRA, rank 4)."""
    root = tmp_path_factory.mktemp(request.param)
    path = make_hf_checkpoint(request.param, root / "model")
    b_options = {"r": 4, "target_modules": ("q_proj", "v_proj", "down_proj"), "use_rslora": True}
    adapters = [
        LoRARequest("a", str(make_peft_adapter(path, root / "a", seed=1))),
        LoRARequest("b", str(make_peft_adapter(path, root / "b", seed=2, **b_options))),
        LoRARequest("c", str(make_peft_adapter(path, root / "c", seed=3))),
    ]
    return path, adapters


def engine(path, mode: str, **kw) -> LLM:
    kw = {"dtype": "float32", "max_num_batched_tokens": 128, "max_num_seqs": 16, **kw}
    return LLM(
        str(path),
        cuda_graph_mode=mode,
        max_capture_size=128,
        enable_lora=True,
        max_loras=4,  # counts 0, 1, 2, 4: a step of three adapters replays a padded group
        max_lora_rank=16,
        gpu_memory_utilization=0.25,
        **kw,
    )


def workload(llm: LLM, adapters) -> list[list[int]]:
    """Long prompts (chunked), short ones, decode batches that need padding, and requests of
    the base model and of one, two or three adapters at once."""
    g = torch.Generator().manual_seed(0)
    lengths = [300, 3, 40, 7, 1, 129, 11, 5, 77, 2, 19, 33]
    prompts = [torch.randint(2, 300, (n,), generator=g).tolist() for n in lengths]
    loras = [None, adapters[0], adapters[1], adapters[2], adapters[0], None] * 2
    params = [
        SamplingParams(temperature=0.0, max_tokens=10 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return [o.token_ids for o in outs]


def test_every_mode_matches_eager_with_mixed_adapters(lora_models):
    path, adapters = lora_models
    torch.backends.cuda.matmul.allow_tf32 = False
    reference = workload(engine(path, "none"), adapters)
    for mode in MODES[1:]:
        llm = engine(path, mode, check_graphs=1)
        assert workload(llm, adapters) == reference, mode
        report = llm.graph_report()
        replays = report["replays_by_active_loras"]
        assert replays.get("0", 0) > 0 and replays.get("4", 0) > 0, (mode, replays)
        assert replays.get("1", 0) + replays.get("2", 0) > 0, (mode, replays)
        captured = [d for ds in report["captured"].values() for d in ds]
        assert {d["num_active_loras"] for d in captured} == {0, 1, 2, 4}
        if mode in ("piecewise", "full_and_piecewise"):
            assert report["steps"]["piecewise"] > 0, report["steps"]
        if mode in ("full", "full_decode_only", "full_and_piecewise"):
            assert report["steps"]["full"] > 0, report["steps"]
        del llm
        gc.collect()


def test_bfloat16_graph_checker_passes_with_adapters(lora_models):
    path, adapters = lora_models
    for mode in MODES[1:]:
        llm = engine(path, mode, dtype="bfloat16", check_graphs=1)
        workload(llm, adapters)  # raises if a graphed step leaves eager's outputs
        assert llm.graph_report()["replays_by_active_loras"].get("4", 0) > 0
        del llm
        gc.collect()


def test_float32_graphs_equal_transformers_with_peft(lora_models):
    path, adapters = lora_models
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = oracle_prompts(300)
    llm = engine(path, "full_and_piecewise")
    params = SamplingParams(temperature=0.0, max_tokens=12)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=adapters[1])
    with_peft = peft.PeftModel.from_pretrained(hf_model(path, "cuda"), adapters[1].path).eval()
    assert [o.token_ids for o in outs] == hf_greedy(with_peft, prompts, 12)
    assert llm.graph_report()["replays_by_active_loras"].get("1", 0) > 0


def test_one_request_at_a_time_equals_transformers_with_peft(lora_models):
    """Requests decoded alone (every decode step one row, where the base projections take the
    one-row kernel): float32 tokens equal transformers + peft eagerly and in graphs, for an
    adapter on every projection and one on a few (rank 4, rsLoRA); bfloat16 graphs pass the
    checker."""
    path, adapters = lora_models
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts, params = oracle_prompts(300)[:4], SamplingParams(temperature=0.0, max_tokens=12)
    for adapter in adapters[:2]:
        with_peft = peft.PeftModel.from_pretrained(hf_model(path, "cuda"), adapter.path).eval()
        want = hf_greedy(with_peft, prompts, 12)
        for mode in ("none", "full_and_piecewise"):
            llm = engine(path, mode, max_num_seqs=1)
            outs = [
                llm.generate([p], params, use_tqdm=False, lora_request=adapter) for p in prompts
            ]
            assert [o[0].token_ids for o in outs] == want, (adapter.name, mode)
            del llm
            gc.collect()
    llm = engine(path, "full_and_piecewise", dtype="bfloat16", check_graphs=1, max_num_seqs=1)
    for p in prompts:  # raises if a graphed step leaves eager's logits
        llm.generate([p], params, use_tqdm=False, lora_request=adapters[0])
    assert llm.graph_report()["replays_by_active_loras"].get("1", 0) > 0


@pytest.mark.parametrize("num_tokens", [1, 7, 32, 200, 512])
@pytest.mark.parametrize("shards", [[4096, 1024, 1024], [14336, 14336], [4096]])
def test_kernels_match_torch_on_8b_shapes(num_tokens, shards):
    torch.manual_seed(0)
    slots, rank_max, k = 4, 16, 4096
    dev, dtype = "cuda", torch.bfloat16
    a = torch.randn(slots, len(shards) * rank_max, k, device=dev).div(k**0.5).to(dtype)
    b = torch.randn(slots, sum(shards), rank_max, device=dev).to(dtype)
    ranks = torch.tensor([[16] * len(shards), [8] * len(shards), [16] * len(shards),
                          [0] * len(shards)], dtype=torch.int32, device=dev)  # fmt: skip
    a[1].view(len(shards), rank_max, k)[:, 8:] = 0  # rank 8: zero beyond it, as slots keep it
    b[1, :, 8:] = 0
    offsets = tuple(sum(shards[:i]) for i in range(len(shards) + 1))
    token_slots = torch.randint(-1, 3, (num_tokens,)).numpy()
    tokens, used, starts, counts = group_by_adapter(token_slots)
    pad = 4 - len(used)
    as_int = lambda v: torch.tensor([*v, *[0] * pad], dtype=torch.int32, device=dev)
    meta = LoRAMetadata(4, torch.tensor(tokens, dtype=torch.int32, device=dev), as_int(used),
                        as_int(starts), as_int(counts))  # fmt: skip
    x = torch.randn(num_tokens, k, device=dev).to(dtype)
    y = torch.randn(num_tokens, sum(shards), device=dev).to(dtype)
    want = y.clone()
    lora_expand_torch(lora_shrink_torch(x, a, ranks, meta), b, ranks, offsets, want, meta)
    got = y.clone()
    lora_expand(lora_shrink(x, a, ranks, meta), b, ranks, offsets, got, meta)
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)
    untouched = torch.from_numpy(token_slots < 0).to(dev)
    assert torch.equal(got[untouched], y[untouched])


@pytest.mark.parametrize("with_residual", [False, True])
def test_the_one_row_kernels_match_torch_on_8b_shapes(with_residual):
    """The LoRA kernels of a one-row step with an adapter (lora/layer.py: LoRALinear.plan) on
    llama-3.1-8b's gate|up: the shrink of the norm's input (its mean squares last), then the
    expand with the 1/rms and SiLU-and-mul, against their torch versions; an adapter that
    leaves gate alone too."""
    torch.manual_seed(0)
    rank_max, k, half = 16, 4096, 14336
    dev, dtype = "cuda", torch.bfloat16
    a = torch.randn(2, 2 * rank_max, k, device=dev).div(k**0.5).to(dtype)
    b = torch.randn(2, 2 * half, rank_max, device=dev).to(dtype)
    ranks = torch.tensor([[16, 16], [0, 16]], dtype=torch.int32, device=dev)
    a[1, :rank_max] = 0
    b[1, :half] = 0
    x = torch.randn(1, k, device=dev).to(dtype)
    residual = torch.randn(1, k, device=dev).to(dtype) if with_residual else None
    norm = (residual, torch.rand(k, device=dev).add(0.5).to(dtype), 1e-6)
    y = torch.randn(1, 2 * half, device=dev).to(dtype)
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    for slot in (0, 1):
        meta = LoRAMetadata(2, as_int([0]), as_int([slot, 0]), as_int([0, 1]), as_int([1, 0]))
        partials = lora_shrink(x, a, ranks, meta, norm)
        want = lora_shrink_torch(x, a, ranks, meta, norm)
        used = slice(rank_max if slot else 0, 2 * rank_max + 1)  # a shard of rank 0: unwritten
        torch.testing.assert_close(partials[0, :, used], want[0, :, used], rtol=2e-2, atol=2e-2)
        act = lora_expand_silu(partials, b, ranks, (0, half, 2 * half), y, meta, 1e-6)
        summed = y.clone()
        lora_expand_torch(want, b, ranks, (0, half, 2 * half), summed, meta, 1e-6)
        want_act = silu_and_mul_torch(summed)
        assert act.shape == (1, half)
        torch.testing.assert_close(act.float(), want_act.float(), rtol=2e-2, atol=2e-2)


def test_the_expand_waits_for_the_side_stream_shrink(monkeypatch):
    """LoRALinear runs its shrink on a side stream beside the base projection; the expand, on
    the step's stream, must wait for it. A shrink held back by a device sleep on its stream
    still gives the one-stream result (without the wait, the expand reads partials not yet
    written: whatever the allocator's block held, at best the warm-up's partials of another
    input). The warm-up compiles every kernel first, so no host-side compile outlasts the
    sleep."""
    torch.manual_seed(0)
    dev, dtype, k, n, rank = "cuda", torch.bfloat16, 4096, 6144, 16
    base = Linear(k, n).to(dev)
    base.weight.data = torch.randn(n, k, device=dev).div(k**0.5).to(dtype)
    layer = LoRALinear(base, num_slots=2, max_rank=rank)
    a = torch.randn(rank, k, device=dev).div(k**0.5).to(dtype)
    layer.set_shard(1, 0, a, torch.randn(n, rank, device=dev).to(dtype))
    warm, x = torch.randn(2, 8, k, device=dev).to(dtype)
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    meta = LoRAMetadata(1, as_int(range(8)), as_int([1]), as_int([0]), as_int([8]))
    with forward_context(ForwardContext(None, [], None, lora=meta)):
        layer(warm)
    want = base(x)
    lora_expand_torch(lora_shrink_torch(x, layer.lora_a, layer.lora_ranks, meta), layer.lora_b,
                      layer.lora_ranks, layer.offsets, want, meta)  # fmt: skip
    shrink = lora_layer.lora_shrink

    def late_shrink(*args):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of the side stream's time
        return shrink(*args)

    monkeypatch.setattr(lora_layer, "lora_shrink", late_shrink)
    with forward_context(ForwardContext(None, [], None, lora=meta)):
        got = layer(x)
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_cold_kernel_beside_the_shrink_leaves_the_capture_whole(monkeypatch):
    """A capture that meets a cold kernel variant in the base projection, once the shrink is
    launched on LoRALinear's side stream, raises ColdKernel and still ends, the side stream
    joined: the engine warms up and captures again in the same pool, which its earlier graphs
    hold. Without the join that capture failed with 'already recording to mempool_id', as the
    bfloat16 LoRA engines of session 38's first call did (their base projections' unfused
    variants were cold where steps without adapters took the fused paths)."""
    torch.manual_seed(0)
    dev, dtype, k, n, rank = "cuda", torch.bfloat16, 256, 512, 16
    base = Linear(k, n).to(dev)
    base.weight.data = torch.randn(n, k, device=dev).div(k**0.5).to(dtype)
    layer = LoRALinear(base, num_slots=2, max_rank=rank)
    layer.set_shard(
        1, 0, torch.randn(rank, k, device=dev).to(dtype), torch.randn(n, rank, device=dev).to(dtype)
    )
    x = torch.randn(8, k, device=dev).to(dtype)
    as_int = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)  # noqa: E731
    meta = LoRAMetadata(1, as_int(range(8)), as_int([1]), as_int([0]), as_int([8]))
    monkeypatch.setattr(variants, "_launched", set())
    monkeypatch.setattr(launch, "_compiled", {})  # every launch passes the capture guard
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    with forward_context(ForwardContext(None, [], None, lora=meta)):
        with variants.recording():
            want = layer(x)
        held = BreakableGraph(pool, stream)  # the pool stays in use, as the engine's graphs keep it
        held.capture(lambda: base(x), breaks=False)
        cold = {key for key in variants._launched if key[0] is not lora_kernels._shrink_kernel}
        assert cold and len(cold) < len(variants._launched)
        variants._launched -= cold  # the shrink launches, then the projection's kernel raises
        launch._compiled.clear()  # the warm-up's cached launches would skip the guard
        with variants.warm_only(), pytest.raises(variants.ColdKernel):
            BreakableGraph(pool, stream).capture(lambda: layer(x), breaks=False)
        variants._launched |= cold
        graph = BreakableGraph(pool, stream)
        with variants.warm_only():
            graph.capture(lambda: layer(x), breaks=False)
    torch.testing.assert_close(graph.replay(), want)
