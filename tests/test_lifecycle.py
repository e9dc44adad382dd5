"""Engines that give everything back: LLM.shutdown(), `with LLM(...)`, the async engine, the
executors, and the messages the engine-core process exchanges with the HTTP process."""

from __future__ import annotations

import asyncio
import dataclasses
import weakref

import pytest
import torch.distributed as dist

from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.engine import messages as m
from ostinato.engine.async_engine import AsyncEngine, EngineClosedError
from ostinato.engine.engine import EngineShutdownError

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
    changed = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 3, "max_tokens": 9,
               "stop": ["x"], "stop_token_ids": [5], "ignore_eos": True, "logprobs": 2}  # fmt: skip
    params = SamplingParams(**changed)
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):  # a new field needs a value above
        assert getattr(params, f.name) != getattr(defaults, f.name), f.name
    add = m.Add(7, [m.NewRequest("r", [1, 2], params)], LoRARequest("a", "/adapter"))
    assert m.input_decoder().decode(m.encoder().encode(add)) == add
    step = m.Step([m.Delta("r", [4, 5], [{4: -0.5}, {5: -1.0}], "stop", 3)])
    assert m.output_decoder().decode(m.encoder().encode(step)) == step
