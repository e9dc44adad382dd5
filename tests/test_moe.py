"""Mixture-of-experts models on the CPU: greedy tokens equal transformers' on random Qwen3-MoE
and Mixtral checkpoints, alone and mixed in batches with chunked prefill; the router as each
model defines it; experts split over tensor ranks equal the whole layer."""

import pytest
import torch
from helpers import make_hf_checkpoint
from oracle import hf_greedy, hf_model, oracle_prompts, run_ostinato
from test_tensor_parallel import fill, on_ranks, run, run_ranks  # noqa: F401 (a fixture)

from ostinato import LLM, SamplingParams
from ostinato.config import EngineConfig
from ostinato.kernels.moe import route
from ostinato.layers.moe import SparseMoeBlock
from ostinato.loader import load_hf_config, load_model

MAX_NEW = 6


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_checkpoint(request, tmp_path_factory):
    return make_hf_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "m")


def test_greedy_tokens_equal_transformers_alone_and_batched(moe_checkpoint):
    prompts = oracle_prompts(300)
    want = hf_greedy(hf_model(moe_checkpoint), prompts, MAX_NEW)
    # batched: max_num_batched_tokens=32 chunks the long prompts and mixes them with decodes
    _, batched = run_ostinato(moe_checkpoint, prompts, MAX_NEW, device="cpu", dtype="float32")
    assert batched == want
    alone = LLM(str(moe_checkpoint), device="cpu", dtype="float32", max_num_seqs=1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    for prompt, tokens in zip(prompts[:2], want[:2], strict=True):
        assert alone.generate([prompt], params, use_tqdm=False)[0].token_ids == tokens


@pytest.mark.parametrize("renormalize", [False, True])
@pytest.mark.parametrize("kernel", ["triton", "torch"])
def test_route_is_softmax_top_k_renormalised_as_asked(monkeypatch, kernel, renormalize):
    if kernel == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0, 0.5], [3.0, 0.0, 0.0, 3.5, -2.0],
                           [1.0, 1.5, 0.0, 0.0, 0.0]])  # fmt: skip
    slots = torch.tensor([7, 8, -1])  # the last token is a graph's padding
    weights, ids = route(logits, 2, renormalize, slots)
    e = logits.double().exp()
    p = e / e.sum(-1, keepdim=True)
    assert ids.tolist() == [[1, 2], [3, 0], [-1, -1]]
    want = torch.stack([p[0, [1, 2]], p[1, [3, 0]]])
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    torch.testing.assert_close(weights[:2].double(), want)


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_split_over_ranks_equal_the_whole_layer(on_ranks, tp):  # noqa: F811
    build = lambda: SparseMoeBlock(16, num_experts=6, top_k=2, intermediate_size=24,
                                   renormalize=True)  # fmt: skip
    whole = build()
    g = torch.Generator().manual_seed(3)
    tensors = {
        "gate.weight": torch.randn(6, 16, generator=g),
        "experts.w13": torch.randn(6, 48, 16, generator=g),
        "experts.w2": torch.randn(6, 16, 24, generator=g),
    }
    fill(whole, tensors)
    ranks = on_ranks(tp, build)
    for rank in ranks:
        fill(rank, tensors)
        assert rank.experts.w13.shape == (6, 2 * 24 // tp, 16)
        assert rank.experts.w2.shape == (6, 16, 24 // tp)
    x = torch.randn(5, 16)
    want = whole(x)
    for out in run_ranks(ranks, x):
        torch.testing.assert_close(out, want)


def test_the_checkpoint_names_every_missing_expert(moe_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = load_hf_config(str(moe_checkpoint))
    arch = hf.architectures[0]
    tensors = load_file(moe_checkpoint / "model.safetensors")
    gone = ("model.layers.0.block_sparse_moe.experts.1.w3.weight" if arch.startswith("Mixtral")
            else "model.layers.0.mlp.experts.1.up_proj.weight")  # fmt: skip
    del tensors[gone]
    save_file(tensors, tmp_path / "model.safetensors")
    model = load_model(EngineConfig(model=str(moe_checkpoint), device="cpu"), hf, None)
    with pytest.raises(ValueError, match=f"lacks weights: {gone}"):
        from ostinato.loader import iter_checkpoint

        model.load_weights(iter_checkpoint(tmp_path))


def test_two_tensor_ranks_over_gloo_generate_what_one_process_does(moe_checkpoint):
    prompts = oracle_prompts(300)[:4]
    want, _ = run(str(moe_checkpoint), prompts)
    got, ranks = run(str(moe_checkpoint), prompts, tensor_parallel_size=2)
    assert got == want
    assert [r[1] for r in ranks] == [0, 1]


def test_padded_tokens_route_to_no_expert_and_add_nothing():
    from ostinato.context import AttentionMetadata, ForwardContext, forward_context

    torch.manual_seed(0)
    block = SparseMoeBlock(16, num_experts=4, top_k=2, intermediate_size=8, renormalize=False)
    for p in block.parameters():
        p.normal_()
    x = torch.randn(5, 16)
    slots = torch.tensor([3, 4, 9, -1, -1])  # two padded tokens
    meta = AttentionMetadata(5, 1, *(torch.zeros(1, dtype=torch.int32),) * 3, slots,
                             torch.zeros(1), torch.zeros(1))  # fmt: skip

    class Backend:
        def plan(self, meta):
            return None

    with forward_context(ForwardContext(meta, [], Backend())):
        out = block(x)
    assert out[3:].abs().max() == 0
    torch.testing.assert_close(out[:3], block(x[:3]))  # outside a step: every token routes


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_router_that_normalises_for_the_experts_equals_the_norm_kernel_first(
    monkeypatch, tokens, with_residual
):
    """In a decoder layer the block's input norm runs inside the router's small-batch kernel,
    which stores the normalised input for the experts (the CPU interpreter stands in for the
    GPU the kernel takes): the output and the residual stream equal the norm, then the block;
    without the fusions (linear.FUSE off) the block runs the norm itself."""
    from ostinato.kernels import gemv as gemv_module
    from ostinato.layers import linear
    from ostinato.layers import moe as moe_layer
    from ostinato.layers.norm import RMSNorm

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused = []
    pays = lambda x, w, normed=False: (  # the router is asked with its norm prologue
        fused.append((*x.shape, normed)) or gemv_module.rows_pay(x.shape[0], *w.shape, normed)
    )
    monkeypatch.setattr(moe_layer, "gemv_pays", pays)
    torch.manual_seed(0)
    block = SparseMoeBlock(48, num_experts=6, top_k=2, intermediate_size=32, renormalize=True)
    norm = RMSNorm(48, 1e-6)
    for p in (*block.parameters(), *norm.parameters()):
        p.normal_()
    x = torch.randn(tokens, 48)
    residual = torch.randn(tokens, 48) if with_residual else None
    out, stream = block(x, residual, norm)
    assert fused == [(tokens, 48, True)]
    expected_stream = x if residual is None else x + residual
    torch.testing.assert_close(stream, expected_stream)
    torch.testing.assert_close(out, block(norm(expected_stream)), rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(linear, "FUSE", False)
    unfused, unfused_stream = block(x, residual, norm)
    assert len(fused) == 1  # the router was not asked
    torch.testing.assert_close(unfused, out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(unfused_stream, expected_stream)
