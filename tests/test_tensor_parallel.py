"""Tensor parallelism on CPU: the parallel layers against unsplit ones (ranks as threads), each
rank reading only its slices, bad splits refused up front, and T = 2 (and T = 2 x P = 2)
worker processes talking gloo, token-equal to one process."""

from __future__ import annotations

import dataclasses
import multiprocessing
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from helpers import assert_killing_stops_the_engine, assert_stopped_for_good, make_hf_checkpoint
from oracle import oracle_prompts
from safetensors.torch import load_file

from ostinato import LLM, SamplingParams
from ostinato.config import EngineConfig
from ostinato.distributed.parallel import Rank, TPGroup, set_tp_group
from ostinato.graphs.explain import explain
from ostinato.layers.embedding import LMHead, VocabEmbedding
from ostinato.layers.linear import ColumnParallelLinear, RowParallelLinear
from ostinato.layers.norm import RMSNorm
from ostinato.layers.weights import loader_of
from ostinato.loader import LazyTensor, load_hf_config, load_model
from ostinato.models.llama import LlamaMLP
from ostinato.runner.model_runner import ModelRunner

# small steps: long prompts are chunked, several requests share each step
ENGINE = {"dtype": "float32", "device": "cpu", "max_num_batched_tokens": 24, "max_num_seqs": 8}
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)


# ---- the layers, with T ranks as T threads -----------------------------------------------
class ThreadGroup(TPGroup):
    """One of `size` ranks that are threads of this process: collectives meet at a barrier
    and every rank sums (or joins) the same tensors in rank order."""

    def __init__(self, rank: int, size: int, slots: list, barrier: threading.Barrier) -> None:
        super().__init__(rank, size)
        self.slots, self.barrier = slots, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[self.rank] = x.clone()
        self.barrier.wait()
        parts = list(self.slots)
        self.barrier.wait()  # nobody writes the next exchange before everyone read this one
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x.copy_(torch.stack(self._exchange(x)).sum(0))

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=dim)


@pytest.fixture
def on_ranks():
    """on_ranks(size, build) -> the module build() makes on each of `size` thread ranks."""

    def build_each(size: int, build):
        slots, barrier = [None] * size, threading.Barrier(size, timeout=10)
        modules = []
        for rank in range(size):
            set_tp_group(ThreadGroup(rank, size, slots, barrier))
            modules.append(build())
        set_tp_group(TPGroup())
        return modules

    yield build_each
    set_tp_group(TPGroup())


def run_ranks(modules, x: torch.Tensor | list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's module on x (or on its own entry of x), at the same time."""
    inputs = x if isinstance(x, list) else [x] * len(modules)
    with ThreadPoolExecutor(len(modules)) as pool:
        return list(pool.map(lambda m, x: m(x), modules, inputs))


def fill(module, tensors: dict[str, torch.Tensor]) -> None:
    """Each parameter from the whole tensor of its name, through its own loader."""
    for name, param in module.named_parameters():
        loader_of(param)(param, tensors[name])


def whole_tensors(module, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in module.named_parameters()}


@pytest.mark.parametrize("tp", [2, 4])
def test_column_parallel_qkv_holds_whole_heads_and_shares_kv_heads(on_ranks, tp):
    heads, kv_heads, dim, hidden = 4, 2, 8, 16
    build = lambda: ColumnParallelLinear(
        hidden, [heads * dim, kv_heads * dim, kv_heads * dim], bias=True, units=[dim] * 3
    )
    whole = build()
    tensors = whole_tensors(whole)
    fill(whole, tensors)
    ranks = on_ranks(tp, build)
    for rank in ranks:
        fill(rank, tensors)
    x = torch.randn(5, hidden)
    q, k, v = (t.unflatten(-1, (-1, dim)) for t in whole(x).split(whole.out_sizes, -1))
    for r, out in enumerate(run_ranks(ranks, x)):
        q_r, k_r, v_r = (t.unflatten(-1, (-1, dim)) for t in out.split(ranks[r].out_sizes, -1))
        own = slice(r * heads // tp, (r + 1) * heads // tp)
        kv = r * kv_heads // tp  # with 4 ranks, ranks 2h and 2h + 1 share KV head h
        kv_own = slice(kv, kv + max(1, kv_heads // tp))
        torch.testing.assert_close(q_r, q[:, own])
        torch.testing.assert_close(k_r, k[:, kv_own])
        torch.testing.assert_close(v_r, v[:, kv_own])


class _NormedMLP(torch.nn.Module):
    """An MLP as a decoder layer runs it: the residual stream normalised in, its output out."""

    def __init__(self, bias: bool) -> None:
        super().__init__()
        self.mlp = LlamaMLP(16, 24, bias)  # gate|up column-parallel, down row-parallel
        self.norm = RMSNorm(16, 1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, residual = self.mlp(x, None, self.norm)
        return out if residual is None else out + residual


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_mlp_split_over_ranks_equals_the_whole_mlp(on_ranks, tp, bias):
    build = lambda: _NormedMLP(bias)
    whole = build()
    tensors = whole_tensors(whole, seed=1)
    fill(whole, tensors)
    ranks = on_ranks(tp, build)
    for rank in ranks:
        fill(rank, tensors)
        assert rank.mlp.gate_up_proj.weight.shape == (2 * 24 // tp, 16)
        assert rank.mlp.down_proj.weight.shape == (16, 24 // tp)
    x = torch.randn(3, 16)
    want = whole(x)
    for out in run_ranks(ranks, x):  # the all-reduce leaves every rank the whole output
        torch.testing.assert_close(out, want)


def test_row_parallel_adds_its_bias_once(on_ranks):
    whole = RowParallelLinear(8, 4, bias=True)
    tensors = {"weight": torch.randn(4, 8), "bias": torch.full((4,), 10.0)}
    fill(whole, tensors)
    ranks = on_ranks(2, lambda: RowParallelLinear(8, 4, bias=True))
    for rank in ranks:
        fill(rank, tensors)
    x = torch.randn(2, 8)
    for out in run_ranks(ranks, [x[:, :4], x[:, 4:]]):  # each rank its half of the features
        torch.testing.assert_close(out, x @ tensors["weight"].T + 10.0)


@pytest.mark.parametrize("tp", [2, 4])
def test_vocab_parallel_embedding_and_lm_head_with_a_padded_vocab(on_ranks, tp):
    vocab, hidden = 11, 6  # 11 rows: with 4 ranks, 3 each and the last holds one padding row
    weight = torch.randn(vocab, hidden)
    embeddings = on_ranks(tp, lambda: VocabEmbedding(vocab, hidden))
    heads = on_ranks(tp, lambda: LMHead(vocab, hidden))
    for module in embeddings + heads:
        fill(module, {"weight": weight})
    assert embeddings[-1].weight.shape == (-(-vocab // tp), hidden)
    ids = torch.tensor([0, 10, 3, 5, 5, 9, 1])
    for out in run_ranks(embeddings, ids):
        assert torch.equal(out, weight[ids])  # one rank adds each row, the others zeros
    hidden_states = torch.randn(4, hidden)
    for out in run_ranks(heads, hidden_states):
        assert out.shape == (4, vocab)
        torch.testing.assert_close(out, hidden_states @ weight.T)


# ---- loading: each rank its slices --------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_hf_checkpoint("llama", tmp_path_factory.mktemp("llama"), num_hidden_layers=4)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """One KV head (two ranks share it), a tied head, and a vocabulary that 2 does not divide."""
    return make_hf_checkpoint(
        "qwen3",
        tmp_path_factory.mktemp("qwen3"),
        num_key_value_heads=1,
        tie_word_embeddings=True,
        vocab_size=317,
    )


def load_as_rank(model: str, rank: int, size: int):
    set_tp_group(TPGroup(rank, size))  # loading runs no collective: no real group needed
    try:
        config = EngineConfig(model=model, device="cpu", dtype="float32")
        return dict(load_model(config, load_hf_config(model)).named_parameters())
    finally:
        set_tp_group(TPGroup())


def test_a_rank_reads_only_its_slices_of_the_checkpoint(llama, monkeypatch):
    read = []  # elements of every read from the checkpoint
    lazy_read = LazyTensor.__getitem__

    def recording(self, index):
        out = lazy_read(self, index)
        read.append(out.numel())
        return out

    monkeypatch.setattr(LazyTensor, "__getitem__", recording)
    params = load_as_rank(str(llama), 1, 2)
    ckpt = load_file(llama / "model.safetensors")
    layer = "model.layers.3."
    q, k, v = (ckpt[f"{layer}self_attn.{p}_proj.weight"] for p in "qkv")
    # rank 1 of 2: query heads 2 and 3 of 4, KV head 1 of 2 (64 rows a head)
    want_qkv = torch.cat([q[128:], k[64:], v[64:]])
    assert torch.equal(params[f"{layer}self_attn.qkv_proj.weight"], want_qkv)
    assert torch.equal(
        params[f"{layer}self_attn.o_proj.weight"], ckpt[f"{layer}self_attn.o_proj.weight"][:, 128:]
    )
    gate, up = ckpt[f"{layer}mlp.gate_proj.weight"], ckpt[f"{layer}mlp.up_proj.weight"]
    assert torch.equal(params[f"{layer}mlp.gate_up_proj.weight"], torch.cat([gate[128:], up[128:]]))
    assert torch.equal(
        params[f"{layer}mlp.down_proj.weight"], ckpt[f"{layer}mlp.down_proj.weight"][:, 128:]
    )
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(params[name], ckpt[name][160:])
    assert torch.equal(params["model.norm.weight"], ckpt["model.norm.weight"])
    # every element read went into a parameter: about half the checkpoint, no whole tensor
    held = sum(p.numel() for p in params.values())
    assert sum(read) == held
    assert held < 0.55 * sum(t.numel() for t in ckpt.values())


def test_random_weights_of_each_rank_are_its_slices_of_the_whole_model():
    whole = load_as_rank("tiny", 0, 1)
    dim, inter = 64, 384  # tiny: 4 query heads, 2 KV heads, vocab 384
    for r in range(4):  # 4 ranks: one query head each, ranks 2h and 2h + 1 share KV head h
        part = load_as_rank("tiny", r, 4)
        layer = "model.layers.2."
        qkv = whole[f"{layer}self_attn.qkv_proj.weight"]
        q, k, v = qkv[: 4 * dim], qkv[4 * dim : 6 * dim], qkv[6 * dim :]
        kv = slice(r // 2 * dim, (r // 2 + 1) * dim)
        own = slice(r * dim, (r + 1) * dim)
        assert torch.equal(
            part[f"{layer}self_attn.qkv_proj.weight"], torch.cat([q[own], k[kv], v[kv]])
        )
        assert torch.equal(
            part[f"{layer}self_attn.o_proj.weight"],
            whole[f"{layer}self_attn.o_proj.weight"][:, own],
        )
        gate_up = whole[f"{layer}mlp.gate_up_proj.weight"]
        cols = slice(r * inter // 4, (r + 1) * inter // 4)
        want = torch.cat([gate_up[:inter][cols], gate_up[inter:][cols]])
        assert torch.equal(part[f"{layer}mlp.gate_up_proj.weight"], want)
        assert torch.equal(
            part[f"{layer}mlp.down_proj.weight"], whole[f"{layer}mlp.down_proj.weight"][:, cols]
        )
        rows = slice(r * 96, (r + 1) * 96)
        assert torch.equal(
            part["model.embed_tokens.weight"], whole["model.embed_tokens.weight"][rows]
        )
        assert "lm_head.weight" not in part  # tied: one parameter


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_caches_only_its_kv_heads_and_sizes_its_cache_for_them(tp):
    """tiny has 2 KV heads: with 2 ranks each caches one, with 4 ranks pairs share one. A
    rank's blocks are half the bytes of one process's, so the same memory holds twice as many."""
    hf_config = load_hf_config("tiny")
    config = EngineConfig(device="cpu", tensor_parallel_size=tp, kv_cache_memory=2**22)
    config = config.for_model(hf_config)
    whole = ModelRunner(dataclasses.replace(config, tensor_parallel_size=1), hf_config)
    for rank in range(tp):
        set_tp_group(TPGroup(rank, tp))  # building and sizing run no collective
        try:
            runner = ModelRunner(config, hf_config, Rank(rank, tp, 1))
        finally:
            set_tp_group(TPGroup())
        assert runner.kv_block_bytes * 2 == whole.kv_block_bytes
        assert runner.num_blocks == 2 * whole.num_blocks
        runner.start()
        for layer in range(hf_config.num_hidden_layers):
            for cache in runner.kv_caches[layer]:
                assert cache.shape == (runner.num_blocks, config.block_size, 1, 64)
        assert runner.model.model.layers["0"].self_attn.attn.num_kv_heads == 1


# ---- settings that cannot split ------------------------------------------------------------
@pytest.mark.parametrize(
    ("heads", "kv_heads", "intermediate", "tp", "message"),
    [
        (4, 2, 384, 3, "does not divide its 4 attention heads or its 2 KV heads"),
        (12, 4, 96, 6, "its 4 KV heads (nor is it a multiple of them): every tensor rank"),
        (8, 8, 100, 8, "its intermediate_size 100"),
    ],
)
def test_splits_the_model_cannot_take_are_named_with_the_sizes_that_fit(
    heads, kv_heads, intermediate, tp, message
):
    hf_config = load_hf_config("tiny")
    hf_config.num_attention_heads, hf_config.num_key_value_heads = heads, kv_heads
    hf_config.intermediate_size = intermediate
    with pytest.raises(ValueError, match=re.escape(message)):
        EngineConfig(device="cpu", tensor_parallel_size=tp).for_model(hf_config)
    fits = EngineConfig(device="cpu", tensor_parallel_size=2).for_model(hf_config)
    assert fits.tensor_parallel_size == 2


@pytest.mark.parametrize(
    ("kwargs", "env", "message"),
    [
        ({"tensor_parallel_size": 3}, {}, r"choose tensor_parallel_size in \[1, 2, 4\]"),
        ({"tensor_parallel_size": 2, "device": "cuda"}, {}, "processes need 2 GPUs"),
        (
            {"tensor_parallel_size": 2, "pipeline_parallel_size": 2},
            {"RANK": "0", "WORLD_SIZE": "2"},
            "torchrun started 2 processes but .* = 2 \\* 2 = 4",
        ),
    ],
)
def test_bad_tensor_settings_are_refused_before_any_process_starts(
    kwargs, env, message, monkeypatch
):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    before = len(multiprocessing.active_children())
    with pytest.raises(ValueError, match=message):
        LLM("tiny", **{"device": "cpu", **kwargs})
    assert len(multiprocessing.active_children()) == before


def test_explain_shows_each_tensor_rank_its_share():
    hf_config = load_hf_config("tiny")
    config = EngineConfig(device="cuda", tensor_parallel_size=4, pipeline_parallel_size=2)
    report = explain(config.for_model(hf_config), hf_config)
    assert [s["ranks"] for s in report["stages"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert report["tensor_parallel"] == {
        "size": 4,
        "attention_heads_per_rank": 1,
        "kv_heads_per_rank": 1,
        "ranks_per_kv_head": 2,  # 2 KV heads over 4 ranks
        "vocab_rows_per_rank": 96,
    }


# ---- engines: T worker processes against one ----------------------------------------------
@pytest.fixture(scope="module")
def prompts():
    return oracle_prompts(300)  # different lengths, chunked; a shared prefix


def run(model: str, prompts, **kwargs) -> tuple[list[list[int]], list[tuple]]:
    """Tokens per prompt (the last one sampled with a seed, the others greedy), and each
    rank's (pipeline stage, tensor rank, layers)."""
    llm = LLM(model, **ENGINE, **kwargs)
    try:
        params = [GREEDY] * (len(prompts) - 1) + [SEEDED]
        tokens = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        report = llm.graph_report()
    finally:
        llm.engine.shutdown()
    ranks = [(s["pp_rank"], s["tp_rank"], s["layers"]) for s in report.get("stages", [])]
    return tokens, ranks


@pytest.mark.parametrize("model", ["tiny", "llama", "qwen3"])
def test_two_tensor_ranks_generate_what_one_process_does(model, prompts, request):
    path = model if model == "tiny" else str(request.getfixturevalue(model))
    want, _ = run(path, prompts)
    got, ranks = run(path, prompts, tensor_parallel_size=2)
    assert got == want
    layers = [0, 4] if model != "qwen3" else [0, 2]
    assert ranks == [(0, 0, layers), (0, 1, layers)]


def test_two_tensor_ranks_times_two_stages_generate_what_one_process_does(llama, prompts):
    want, _ = run(str(llama), prompts)
    got, ranks = run(str(llama), prompts, tensor_parallel_size=2, pipeline_parallel_size=2)
    assert got == want
    assert ranks == [(0, 0, [0, 2]), (0, 1, [0, 2]), (1, 0, [2, 4]), (1, 1, [2, 4])]


def test_a_tensor_rank_killed_mid_generation_stops_the_engine_naming_it(prompts):
    """Rank 0 waits in an all-reduce with the rank that died: the engine stops with an error
    naming it, within seconds, and no worker is left."""
    llm = LLM("tiny", tensor_parallel_size=2, **ENGINE)
    engine = llm.engine
    try:
        for prompt in prompts:
            engine.add_request(prompt, GREEDY)
        for _ in range(3):
            engine.step()
        worker = engine.executor.workers.procs[1]
        # the signal when this process could read the exit status (a full suite run once
        # found it collected elsewhere): the rank is named either way
        error = r"stage 0, tensor rank 1 \(rank 1\) (was killed by SIGKILL|exited)"
        assert_killing_stops_the_engine(engine, worker.pid, error)
        assert_stopped_for_good(llm, [worker])
    finally:
        engine.shutdown()
