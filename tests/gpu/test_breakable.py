"""Breakable capture and the graph runner on a toy model, against eager, bit for bit."""

import pytest
import torch
from torch import nn

from ostinato.config import EngineConfig
from ostinato.graphs.breakable import BreakableGraph, run_outside_graph
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode

pytestmark = pytest.mark.gpu

HIDDEN, MAX_TOKENS, LAYERS = 64, 64, 4


class Toy(nn.Module):
    """Linear layers with an eager op between them, in the place attention takes in a model.

    The op reads live metadata: a device tensor, and with `host_limit` a Python int that
    decides the shape of the work (the kind of host-side length a graph cannot capture).
    It writes its result in place into `out`, allocated before the call.
    """

    def __init__(self, host_limit: bool = True) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.scale = torch.ones(MAX_TOKENS, device="cuda")  # live metadata on the device
        self.limit = MAX_TOKENS if host_limit else None  # live metadata on the host

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for layer in self.layers[:-1]:
            h = layer(h)
            h = run_outside_graph(self._mix, h, out=torch.empty_like(h))
        return self.layers[-1](h)

    def _mix(self, h: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(torch.relu(h) * self.scale[: h.shape[0], None])
        if self.limit is not None:
            out[self.limit :] = 0.0


def make(host_limit: bool = True) -> tuple[Toy, torch.Tensor]:
    torch.manual_seed(0)
    return Toy(host_limit).cuda(), torch.zeros(MAX_TOKENS, HIDDEN, device="cuda")


def new_inputs(model: Toy, x: torch.Tensor, n: int, gen: torch.Generator) -> None:
    """Copy a fresh batch into the persistent buffers, as a runner does before replay."""
    x.copy_(torch.randn(x.shape, generator=gen).cuda())
    model.scale.copy_(torch.rand(MAX_TOKENS, generator=gen).cuda())
    if model.limit is not None:
        model.limit = int(torch.randint(1, n + 1, (1,), generator=gen))


def capture(model: Toy, x: torch.Tensor, n: int, pool, stream, breaks: bool = True):
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(x[:n])  # warm-up
    torch.cuda.synchronize()
    graph = BreakableGraph(pool, stream)
    graph.capture(lambda: model(x[:n]), breaks=breaks)
    torch.cuda.current_stream().wait_stream(stream)
    return graph


@torch.inference_mode()
def test_breakable_replays_equal_eager():
    model, x = make()
    graph = capture(model, x, 32, torch.cuda.graph_pool_handle(), torch.cuda.Stream())
    assert graph.num_breaks == LAYERS - 1
    gen = torch.Generator().manual_seed(1)
    outputs = set()
    for _ in range(20):
        new_inputs(model, x, 32, gen)
        got = graph.replay().clone()
        assert torch.equal(got, model(x[:32]))
        outputs.add(got.sum().item())
    assert len(outputs) == 20  # every replay saw its own inputs and metadata


@torch.inference_mode()
def test_two_sizes_share_one_pool():
    model, x = make()
    pool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
    big = capture(model, x, 48, pool, stream)  # largest first, as the runner does
    small = capture(model, x, 8, pool, stream)
    gen = torch.Generator().manual_seed(2)
    for i in range(10):
        n, graph = (48, big) if i % 2 else (8, small)
        new_inputs(model, x, n, gen)
        assert torch.equal(graph.replay(), model(x[:n]))
    new_inputs(model, x, 48, gen)
    want = model(x[:48])
    big_out = big.replay()
    small.replay()  # must not overwrite the other graph's output
    assert torch.equal(big_out, want)


@torch.inference_mode()
def test_full_graph_captures_the_op_inline():
    model, x = make(host_limit=False)
    graph = capture(model, x, 16, torch.cuda.graph_pool_handle(), torch.cuda.Stream(), False)
    assert graph.num_breaks == 0
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        new_inputs(model, x, 16, gen)
        assert torch.equal(graph.replay(), model(x[:16]))


def runner(mode: str = "full_and_piecewise", **kw) -> GraphRunner:
    config = EngineConfig(
        device="cuda",
        attention_backend="triton",
        cuda_graph_mode=mode,
        capture_sizes=[1, 4, 16],
        max_num_seqs=16,
        max_num_batched_tokens=MAX_TOKENS,
        **kw,
    )
    return GraphRunner(config)


@torch.inference_mode()
def test_graph_runner_captures_and_replays_both_modes():
    model, x = make(host_limit=False)  # device-only metadata: FULL graphs may hold the op
    graphs, prepared = runner(), []
    graphs.capture(lambda desc: model(x[: desc.num_tokens]), prepare=prepared.append)
    assert [d.num_tokens for d in prepared] == [16, 16, 4, 4, 1, 1]  # largest first
    report = graphs.report()
    assert [len(report["captured"][m]) for m in ("full", "piecewise")] == [3, 3]
    assert report["capture_seconds"] > 0 and report["graph_memory_bytes"] >= 0
    gen = torch.Generator().manual_seed(4)
    for num_tokens, num_reqs, q, mode in [(3, 3, 1, "full"), (10, 2, None, "piecewise")]:
        runtime, desc = graphs.dispatch(num_tokens, num_reqs, q)
        assert runtime.value == mode and desc.num_tokens == {3: 4, 10: 16}[num_tokens]
        new_inputs(model, x, desc.num_tokens, gen)
        replayed = graphs.run(runtime, desc, num_tokens, lambda: pytest.fail("not captured"))
        assert torch.equal(replayed, model(x[: desc.num_tokens]))
    assert graphs.report()["steps"] == {"none": 0, "piecewise": 1, "full": 1}
    assert graphs.report()["padded_tokens"] == 1 + 6


@torch.inference_mode()
def test_debug_graph_addresses_catches_a_moved_buffer():
    model, _ = make(host_limit=False)
    buffers = {"x": torch.zeros(MAX_TOKENS, HIDDEN, device="cuda")}
    graphs = runner("full_decode_only", debug_graph_addresses=True)
    graphs.capture(lambda desc: model(buffers["x"][: desc.num_tokens]), buffers=lambda: buffers)
    mode, desc = graphs.dispatch(4, 4, 1)
    graphs.run(mode, desc, 4, lambda: pytest.fail("not captured"))
    buffers["x"] = torch.zeros_like(buffers["x"])  # a runner that reallocated instead of copying
    with pytest.raises(RuntimeError, match="'x' moved since capture"):
        graphs.run(mode, desc, 4, lambda: pytest.fail("not captured"))


@torch.inference_mode()
def test_out_of_memory_drops_the_size_and_carries_on():
    model, x = make(host_limit=False)

    def forward(desc: BatchDescriptor) -> torch.Tensor:
        if desc.num_tokens == 16:
            raise torch.cuda.OutOfMemoryError("simulated")
        return model(x[: desc.num_tokens])

    graphs = runner()
    graphs.capture(forward)
    assert {d["num_tokens"] for d in graphs.report()["dropped"]} == {16}
    assert graphs.dispatch(10, 10, 1) == (CudaGraphMode.NONE, BatchDescriptor(10, 10, 1))
    assert graphs.dispatch(4, 4, 1)[0] is CudaGraphMode.FULL
