"""Engines that give everything back: LLM.shutdown(), `with LLM(...)`, the async engine, the
executors, and the messages the engine-core process exchanges with the HTTP process."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import weakref

import pytest
import torch.distributed as dist
import zmq
from helpers import FakeEngine

from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.engine import messages as m
from ostinato.engine.async_engine import AsyncEngine, EngineClosedError
from ostinato.engine.core import EngineCore
from ostinato.engine.engine import EngineShutdownError
from ostinato.sampling_params import StructuredOutputsParams

CONFIG = {"model": "tiny", "device": "cpu", "max_model_len": 128, "max_num_seqs": 4}
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_with_block_gives_back_weights_kv_cache_and_refuses_more_work():
    with LLM(**CONFIG) as llm:
        first = llm.generate(["Hello"], PARAMS, use_tqdm=False)[0].token_ids
        runner = llm.engine.runner
        weight = weakref.ref(next(runner.model.parameters()))
        kv = weakref.ref(runner.kv_caches[0][0])
        ids = weakref.ref(runner.buffers.device["input_ids"])
    assert weight() is None and kv() is None and ids() is None  # freed now, not at some gc
    with pytest.raises(EngineShutdownError, match="shut down"):
        llm.generate(["Hello"], PARAMS, use_tqdm=False)
    llm.shutdown()  # a second time: nothing happens
    with LLM(**CONFIG) as again:  # a new engine, the same answer
        assert again.generate(["Hello"], PARAMS, use_tqdm=False)[0].token_ids == first


@pytest.mark.parametrize("shape", [{"pipeline_parallel_size": 2}, {"tensor_parallel_size": 2}])
def test_shutdown_ends_every_worker_and_leaves_the_group(shape):
    llm = LLM(**CONFIG, **shape)
    workers = list(llm.engine.executor.workers.procs.values())
    assert llm.generate(["Hello"], PARAMS, use_tqdm=False)[0].token_ids
    llm.shutdown()
    assert not any(p.is_alive() for p in workers)
    assert not dist.is_initialized()  # the next multi-process engine may start
    llm.shutdown()
    with pytest.raises(EngineShutdownError):
        llm.generate(["Hello"], PARAMS, use_tqdm=False)


def test_async_engine_shutdown_twice_and_refuses_after():
    llm = LLM(**CONFIG)

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        outs = [o async for o in engine.generate("Hello", PARAMS)]
        assert outs[-1].finished
        await engine.shutdown()
        await engine.shutdown()
        with pytest.raises(EngineClosedError):
            await engine.add([("Hello", PARAMS)])

    asyncio.run(main())
    assert llm.engine.closed and llm.engine.runner.model is None


def test_every_sampling_field_crosses_to_the_engine_process():
    """Requests travel as the dataclasses they are: every field of SamplingParams (set off its
    default here) arrives, with no code naming the fields."""
    changed = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3,
               "max_tokens": 9, "min_tokens": 2, "stop": ["x"], "stop_token_ids": [5],
               "ignore_eos": True, "presence_penalty": 0.5, "frequency_penalty": -0.5,
               "repetition_penalty": 1.2, "logit_bias": {7: -3.0}, "logprobs": 2,
               "structured_outputs": StructuredOutputsParams(json={"type": "object"}),
               "prompt_logprobs": 1}  # fmt: skip
    params = SamplingParams(**changed)
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):  # a new field needs a value above
        assert getattr(params, f.name) != getattr(defaults, f.name), f.name
    add = m.Add(7, [m.NewRequest("r", [1, 2], params)], LoRARequest("a", "/adapter"))
    assert m.input_decoder().decode(m.encoder().encode(add)) == add
    step = m.Step([m.Delta("r", [4, 5], [{4: -0.5}, {5: -1.0}], "stop", 3, [None, {2: -0.1}])])
    assert m.output_decoder().decode(m.encoder().encode(step)) == step


class _Core:
    """An EngineCore over a fake engine on a thread, and the HTTP process's two sockets."""

    def __init__(self, engine) -> None:
        self.context = zmq.Context()
        self.send_socket = self.context.socket(zmq.PUSH)
        self.send_socket.bind("inproc://input")
        self.recv_socket = self.context.socket(zmq.PULL)
        self.recv_socket.bind("inproc://output")
        inputs, outputs = self.context.socket(zmq.PULL), self.context.socket(zmq.PUSH)
        inputs.connect("inproc://input")
        outputs.connect("inproc://output")
        self.core = EngineCore(engine, inputs, outputs)
        self.code: list[int] = []
        self.thread = threading.Thread(
            target=lambda: self.code.append(self.core.run()), daemon=True
        )
        self.thread.start()

    def send(self, msg) -> None:
        self.send_socket.send(m.encoder().encode(msg))

    def recv(self):
        assert self.recv_socket.poll(10_000), "the core sent nothing"
        return m.output_decoder().decode(self.recv_socket.recv())

    def close(self) -> int:
        self.thread.join(10)
        assert not self.thread.is_alive()
        self.context.destroy(linger=0)
        return self.code[0]


def test_engine_core_streams_deltas_and_dies_saying_why_when_a_step_fails():
    engine = FakeEngine()
    core = _Core(engine)
    core.send(m.Add(1, [m.NewRequest("a", [104, 105], SamplingParams(max_tokens=3))]))
    assert core.recv() == m.Reply(1)
    tokens = []
    while not tokens or tokens[-1].finish_reason is None:
        (delta,) = core.recv().outputs
        tokens.append(delta)
    assert [d.new_token_ids for d in tokens] == [[97], [98], [99]]
    assert tokens[-1].finish_reason == "length"
    core.send(m.Add(2, [m.NewRequest("b", [1], SamplingParams(max_tokens=10**6))]))
    assert core.recv() == m.Reply(2)
    engine.fail_step = True
    while not isinstance(msg := core.recv(), m.Dead):
        pass
    assert msg.reason == "engine error: RuntimeError: boom"
    assert core.close() == 1


def test_engine_core_reports_a_dead_worker_while_idle_and_stops_on_shutdown():
    engine = FakeEngine()
    core = _Core(engine)
    core.send(m.Add(1, [m.NewRequest("a", [1] * 100, SamplingParams())]))
    assert core.recv().error_kind == "invalid"  # over max_model_len: a 400, the core runs on
    engine.failed = "pipeline stage 1 was killed by SIGKILL"
    assert core.recv() == m.Dead("pipeline stage 1 was killed by SIGKILL")
    assert core.close() == 1
    core = _Core(FakeEngine())
    core.send(m.Shutdown())
    assert core.close() == 0
