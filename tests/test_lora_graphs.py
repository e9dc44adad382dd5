"""Graph keys by active-adapter count: the ladder, dispatch in every mode, capture of every key,
dropped sizes, the compatibility note, the memory reserve, and the per-step adapter groups in
the persistent buffers."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ostinato.config import EngineConfig
from ostinato.graphs.capture import GraphRunner
from ostinato.graphs.compat import resolve
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.graphs.plan import CapturePlan, lora_ladder
from ostinato.runner.input_buffers import InputBuffers
from ostinato.runner.model_runner import ModelRunner
from ostinato.runner.step import dummy_step

M = CudaGraphMode
NONE, PIECEWISE, FULL = M.NONE, M.PIECEWISE, M.FULL


def lora_dispatcher(mode: CudaGraphMode, **kw) -> Dispatcher:
    config = EngineConfig(
        device="cuda", max_num_seqs=32, max_capture_size=128, enable_lora=True, max_loras=4, **kw
    )
    return Dispatcher(mode, CapturePlan.from_config(config))


@pytest.mark.parametrize(
    ("max_loras", "ladder"),
    [(1, (0, 1)), (2, (0, 1, 2)), (3, (0, 1, 2, 3)), (4, (0, 1, 2, 4)), (6, (0, 1, 2, 4, 6))],
)
def test_ladder_is_zero_powers_of_two_and_max_loras(max_loras, ladder):
    assert lora_ladder(max_loras) == ladder


def test_without_lora_the_keys_are_the_base_keys_only():
    plan = CapturePlan.from_config(EngineConfig(device="cuda", max_loras=8))
    assert plan.lora_counts == (0,)


@pytest.mark.parametrize(
    ("mode", "batch", "key"),
    [
        (M.FULL_AND_PIECEWISE, (5, 5, 1, 3), (FULL, BatchDescriptor(8, 8, 1, 4))),
        (M.FULL_AND_PIECEWISE, (5, 5, 1, 0), (FULL, BatchDescriptor(8, 8, 1, 0))),
        (M.FULL_AND_PIECEWISE, (5, 2, None, 1), (PIECEWISE, BatchDescriptor.piecewise(8, 1))),
        (M.PIECEWISE, (5, 5, 1, 2), (PIECEWISE, BatchDescriptor.piecewise(8, 2))),
        (M.FULL, (5, 2, None, 3), (FULL, BatchDescriptor(8, 8, None, 4))),
        (M.FULL_DECODE_ONLY, (5, 2, None, 3), (NONE, BatchDescriptor(5, 2, None, 3))),
        (M.FULL_AND_PIECEWISE, (129, 3, None, 3), (NONE, BatchDescriptor(129, 3, None, 3))),
    ],
)
def test_dispatch_pads_the_adapter_count_up_the_ladder(mode, batch, key):
    assert lora_dispatcher(mode).dispatch(*batch) == key


@pytest.mark.parametrize("mode", [M.PIECEWISE, M.FULL, M.FULL_DECODE_ONLY, M.FULL_AND_PIECEWISE])
def test_every_size_is_captured_once_per_count_and_every_dispatch_is_captured(mode):
    d = lora_dispatcher(mode)
    plain = EngineConfig(device="cuda", max_num_seqs=32, max_capture_size=128)
    base = Dispatcher(mode, CapturePlan.from_config(plain))
    keys = d.descriptors()
    for m in (FULL, PIECEWISE):
        assert len(keys[m]) == 4 * len(base.descriptors()[m])
        assert [k for k in keys[m] if k.num_active_loras == 0] == base.descriptors()[m]
    assert d.capture_sizes() == base.capture_sizes()
    captured = {(m, k) for m, ks in keys.items() for k in ks}
    for n in range(1, 40):
        for loras in range(5):
            runtime, key = d.dispatch(n, n, 1, loras)
            assert (runtime, key) in captured or runtime is NONE
            assert key.num_active_loras >= loras


def test_a_dropped_key_pads_its_adapter_count_past_it_and_leaves_the_others():
    d = lora_dispatcher(M.FULL_AND_PIECEWISE)
    smaller = d.without([BatchDescriptor(8, 8, 1, 2)])
    assert smaller.dispatch(5, 5, 1, 2) == (FULL, BatchDescriptor(16, 16, 1, 2))
    assert smaller.dispatch(5, 5, 1, 1) == (FULL, BatchDescriptor(8, 8, 1, 1))
    assert BatchDescriptor(8, 8, 1, 2) not in smaller.descriptors()[FULL]


def test_compat_notes_the_ladder_only_where_graphs_are_captured():
    config = EngineConfig(device="cuda", enable_lora=True, max_loras=2)
    reasons = {d.rule: d.reason for d in resolve(config).decisions}
    assert "(0, 1, 2)" in reasons["lora_graphs_per_adapter_count"]
    cpu = EngineConfig(device="cpu", enable_lora=True)
    assert "lora_graphs_per_adapter_count" not in {d.rule for d in resolve(cpu).decisions}


def test_buffers_group_tokens_by_slot_and_pad_groups_to_the_key():
    buffers = InputBuffers(16, 4, 2, torch.device("cpu"), max_loras=4)
    step = dummy_step(num_tokens=7, num_reqs=3, max_model_len=64, block_size=16, num_loras=2)
    step.lora_slots = np.array([3, -1, 3], dtype=np.int32)  # requests of 3, 2 and 2 tokens
    step.desc = BatchDescriptor(8, 8, None, 4)  # padded to 4 groups
    buffers.load(step)
    meta = buffers.lora_metadata(8, 4)
    assert meta.num_active == 4
    assert meta.token_indices[:5].tolist() == [0, 1, 2, 5, 6]
    assert meta.slots.tolist()[:1] == [3]
    assert (meta.starts.tolist(), meta.counts.tolist()) == ([0, 0, 0, 0], [5, 0, 0, 0])
    assert buffers.lora_metadata(8, 0) is None  # a base step: no LoRA code runs


def test_graph_memory_reserve_counts_every_adapter_count():
    def reserve(**kw) -> int:
        config = EngineConfig(
            device="cuda",
            max_num_seqs=32,
            max_capture_size=128,
            full_prefill_max_tokens=0,  # LoRA leaves them out: compare like with like
            **kw,
        )
        runner = SimpleNamespace(config=config, graphs=GraphRunner(config))
        return ModelRunner.graph_memory_reserve(runner, activation=2**30)

    base, lora = reserve(), reserve(enable_lora=True, max_loras=4)
    num_graphs = 6 + 12  # decode sizes 1..32, token sizes 1..128
    assert lora - base == 3 * num_graphs * 4 * 2**20
