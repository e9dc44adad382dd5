"""Multi-LoRA on the CPU: tokens equal transformers + peft, mixed batches equal requests run
alone, slots swapped when adapters outnumber them, prefix caching keyed by adapter, clear errors
for bad adapters that leave every other request alone, and pipeline stages loading their own
layers' share of each adapter."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import numpy as np
import peft
import pytest
from helpers import make_hf_checkpoint, make_peft_adapter
from oracle import hf_greedy, hf_model, oracle_prompts
from safetensors.torch import load_file, save_file

from ostinato import LLM, LoRARequest, SamplingParams
from ostinato.config import EngineConfig
from ostinato.engine.block_manager import BlockManager
from ostinato.engine.scheduler import ScheduledBatch, Scheduler
from ostinato.engine.sequence import Sequence
from ostinato.graphs.modes import BatchDescriptor, CudaGraphMode
from ostinato.loader import load_hf_config
from ostinato.lora import layer as lora_layer
from ostinato.lora.adapter import BaseShapes
from ostinato.lora.slots import AdapterSlots, LoRALoad
from ostinato.runner.step import build_step

MAX_NEW = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
ENGINE = {"max_num_batched_tokens": 32, "max_num_seqs": 4, "max_lora_rank": 16, "num_kv_blocks": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Checkpoints and adapters: `a` targets every projection; `b` a few, with rsLoRA and
    another rank."""
    root = tmp_path_factory.mktemp("lora")
    llama = make_hf_checkpoint("llama", root / "llama")
    qwen3 = make_hf_checkpoint("qwen3", root / "qwen3")
    return {
        "llama": llama,
        "qwen3": qwen3,
        "llama_a": make_peft_adapter(llama, root / "llama_a", seed=1),
        "llama_b": make_peft_adapter(
            llama,
            root / "llama_b",
            seed=2,
            r=4,
            lora_alpha=8,
            target_modules=("q_proj", "v_proj", "down_proj"),
            use_rslora=True,
        ),
        "qwen3_a": make_peft_adapter(qwen3, root / "qwen3_a", seed=3),
    }


def lora_llm(path, **kw) -> LLM:
    return LLM(str(path), enable_lora=True, **{"max_loras": 2, **ENGINE, **kw})


def tokens(llm: LLM, prompts, lora=None) -> list[list[int]]:
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=lora)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize(("arch", "adapter"), [("llama", "a"), ("llama", "b"), ("qwen3", "a")])
def test_tokens_equal_transformers_with_peft(models, arch, adapter):
    path, adapter_dir = models[arch], models[f"{arch}_{adapter}"]
    prompts = oracle_prompts(300)
    llm = lora_llm(path)
    ours = tokens(llm, prompts, LoRARequest(adapter, str(adapter_dir)))
    with_peft = peft.PeftModel.from_pretrained(hf_model(path), str(adapter_dir)).eval()
    assert ours == hf_greedy(with_peft, prompts, MAX_NEW)
    assert ours != tokens(llm, prompts)  # the adapter changes what the model says


def test_base_requests_run_no_lora_code(models, monkeypatch):
    """Steps without adapters take the base path (and, on a GPU, the base graphs)."""
    llm = lora_llm(models["llama"])

    def fail(*args):
        raise AssertionError("a LoRA kernel ran in a step without adapters")

    monkeypatch.setattr(lora_layer, "lora_shrink", fail)
    prompts = oracle_prompts(300)[:3]
    assert tokens(llm, prompts) == tokens(LLM(str(models["llama"]), **ENGINE), prompts)


def record_steps(llm: LLM) -> list:
    """Every StepInput the driver builds from now on."""
    steps, build = [], llm.engine.runner.build_step

    def recording(*args):
        steps.append(build(*args))
        return steps[-1]

    llm.engine.runner.build_step = recording
    return steps


@pytest.mark.parametrize(("max_loras", "overlap"), [(2, False), (1, False), (1, True)])
def test_mixed_batch_equals_each_request_alone(models, max_loras, overlap):
    """Base requests and two adapters in one batch; with one slot the adapters take turns in
    it, and batches hold one adapter each. With async scheduling an adapter may be copied into
    the slot while the step in flight still reads the one before (the copy waits on the
    device)."""
    a = LoRARequest("a", str(models["llama_a"]))
    b = LoRARequest("b", str(models["llama_b"]))
    prompts = oracle_prompts(300, seed=5)
    loras = [None, a, b, None, a, b, a]
    llm = lora_llm(models["llama"], max_loras=max_loras, async_scheduling=overlap)
    steps = record_steps(llm)
    mixed = tokens(llm, prompts, loras)
    assert max(s.desc.num_active_loras for s in steps) == max_loras
    loads = [load for s in steps for load in s.lora_loads]
    assert {load.slot for load in loads} == set(range(max_loras))
    if max_loras == 1:
        assert len(loads) > 2  # swapped back and forth
    alone = [tokens(llm, [p], lora)[0] for p, lora in zip(prompts, loras, strict=True)]
    assert mixed == alone
    base = [p for p, lora in zip(prompts, loras, strict=True) if lora is None]
    assert tokens(LLM(str(models["llama"]), **ENGINE), base) == [mixed[0], mixed[3]]


def test_speculative_decoding_with_adapters_gives_the_same_tokens(models):
    a = LoRARequest("a", str(models["llama_a"]))
    b = LoRARequest("b", str(models["llama_b"]))
    prompts = oracle_prompts(300, seed=5)
    loras = [None, a, b, None, a, b, a]
    want = tokens(lora_llm(models["llama"]), prompts, loras)
    llm = lora_llm(models["llama"], speculative_method="ngram", num_speculative_tokens=3)
    assert tokens(llm, prompts, loras) == want
    assert llm.stats()["spec_draft_tokens"] > 0


def test_prefix_cache_never_crosses_adapters(models):
    a = LoRARequest("a", str(models["llama_a"]))
    b = LoRARequest("b", str(models["llama_b"]))
    prompt = list(range(2, 52))  # three full blocks of 16, then two tokens
    llm = lora_llm(models["llama"])

    def run(lora):
        out = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        return out.token_ids, out.num_cached_tokens

    first_a, cached = run(a)
    assert cached == 0
    assert run(None)[1] == 0 and run(b)[1] == 0  # a's blocks are there, but not theirs
    assert run(a) == (first_a, 48)
    fresh = lora_llm(models["llama"], enable_prefix_caching=False)
    assert run(b)[0] == tokens(fresh, [prompt], b)[0]


def eager(num_tokens, num_reqs, q, num_loras):
    return CudaGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, q, num_loras)


def adapter_slots(models, max_loras: int = 2) -> AdapterSlots:
    base = BaseShapes.of(load_hf_config(str(models["llama"])))
    return AdapterSlots(base, max_loras=max_loras, max_rank=64)


def test_steps_carry_slots_and_loads_that_survive_pickling(models):
    slots = adapter_slots(models)
    paths = {n: str(models[f"llama_{n}"]) for n in "ab"}
    for name, path in paths.items():
        slots.register(LoRARequest(name, path))
    seqs = [Sequence(f"r{i}", [1, 2, 3], GREEDY, lora) for i, lora in enumerate(["a", None, "b"])]
    for s in seqs:
        s.block_ids = [0]
    built = build_step(ScheduledBatch(seqs, [3, 3, 3]), 16, eager, lora=slots)
    step = pickle.loads(pickle.dumps(built))
    assert step.lora_slots.tolist() == [0, -1, 1]
    assert step.desc == BatchDescriptor(9, 3, None, 2)
    assert step.lora_loads == (LoRALoad(0, "a", paths["a"]), LoRALoad(1, "b", paths["b"]))
    again = build_step(ScheduledBatch(seqs[:1], [3]), 16, eager, lora=slots)
    assert again.lora_loads == () and again.lora_slots.tolist() == [0]  # still resident
    base = build_step(ScheduledBatch(seqs[1:2], [3]), 16, eager, lora=slots)
    assert base.lora_slots is None and base.desc.num_active_loras == 0


def test_slots_evict_the_least_recently_used_adapter_not_in_the_batch(models):
    slots = adapter_slots(models)
    slots.paths = {n: f"/{n}" for n in "abc"}  # as if registered
    assert slots.assign(["a", "b"])[0].tolist() == [0, 1]
    slots.assign(["a"])  # b is now the least recently used
    ids, loads = slots.assign(["c", "a", None])
    assert ids.tolist() == [1, 0, -1] and loads == (LoRALoad(1, "c", "/c"),)
    slots.forget(loads)  # the step failed: slot 1 holds nothing usable
    assert slots.assign(["c"])[1] == (LoRALoad(1, "c", "/c"),)


def test_scheduler_limits_adapters_per_batch_and_keeps_adapter_requests_in_order():
    config = EngineConfig(device="cpu", block_size=4, enable_lora=True, max_loras=2)
    scheduler = Scheduler(config, BlockManager(64, 4))
    names = ["a", "b", "c", None, "a", None]
    for i, name in enumerate(names):
        scheduler.add(Sequence(f"r{i}", [1] * 5, GREEDY, name))
    batch = scheduler.schedule()
    # c does not fit; the base requests behind it go ahead, the adapter request keeps its place
    assert [s.request_id for s in batch.seqs] == ["r0", "r1", "r3", "r5"]
    assert [s.request_id for s in scheduler.waiting] == ["r2", "r4"]


# ---- errors --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_adapters(models, tmp_path_factory):
    """name -> (adapter directory, words the error must contain)."""
    root = tmp_path_factory.mktemp("bad")
    llama, good = models["llama"], models["llama_a"]

    def copy(name):
        return shutil.copytree(good, root / name)

    no_config = copy("no_config")
    (no_config / "adapter_config.json").unlink()
    bad_json = copy("bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    no_weights = copy("bin_only")
    (no_weights / "adapter_model.safetensors").rename(no_weights / "adapter_model.bin")
    damaged = copy("damaged")
    data = (damaged / "adapter_model.safetensors").read_bytes()
    (damaged / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    dora = copy("dora")
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    nan = copy("nan")
    weights = load_file(nan / "adapter_model.safetensors")
    next(iter(weights.values()))[0, 0] = float("nan")
    save_file(weights, nan / "adapter_model.safetensors")
    other = make_hf_checkpoint("llama", root / "other_model", intermediate_size=192)
    return {
        "missing": (root / "nowhere", "not a directory"),
        "no_config": (no_config, "no adapter_config.json"),
        "bad_json": (bad_json, "cannot read"),
        "bin_only": (no_weights, "save it as safetensors"),
        "damaged": (damaged, "cannot read"),
        "dora": (dora, "use_dora"),
        "nan": (nan, "non-finite"),
        "rank": (make_peft_adapter(llama, root / "rank32", r=32), "above max_lora_rank=16"),
        "shapes": (make_peft_adapter(other, root / "shapes"), "do not fit the base model"),
        "lm_head": (
            make_peft_adapter(llama, root / "lm_head", target_modules=("q_proj", "lm_head")),
            "lm_head",
        ),
    }


@pytest.fixture(scope="module")
def shared_llm(models):
    return lora_llm(models["llama"])


@pytest.mark.parametrize(
    "case", ["missing", "no_config", "bad_json", "bin_only", "damaged", "dora", "nan", "rank",
             "shapes", "lm_head"],
)  # fmt: skip
def test_bad_adapter_is_refused_and_disturbs_nothing(models, bad_adapters, shared_llm, case):
    path, words = bad_adapters[case]
    good = LoRARequest("a", str(models["llama_a"]))
    engine = shared_llm.engine
    running = engine.add_request([5, 6, 7], GREEDY, lora_request=good)
    with pytest.raises(ValueError, match=words) as error:
        bad = LoRARequest(case, str(path))
        shared_llm.generate([[1, 2], [3, 4]], GREEDY, lora_request=[good, bad])
    assert "prompt 1" in str(error.value) and repr(case) in str(error.value)
    assert case not in engine.lora.paths  # nothing of it stays, so it takes no slot
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.token_ids for o in engine.step() if o.finished}
    assert list(done) == [running]  # only the request added before: the call queued nothing
    assert done[running] == tokens(shared_llm, [[5, 6, 7]], good)[0]


def test_lora_requests_need_enable_lora(models):
    llm = LLM(str(models["llama"]), **ENGINE)
    with pytest.raises(ValueError, match="enable_lora=True"):
        llm.generate([[1, 2]], GREEDY, lora_request=LoRARequest("a", str(models["llama_a"])))


def test_one_name_one_directory(models, shared_llm):
    shared_llm.generate([[1, 2]], GREEDY, lora_request=LoRARequest("x", str(models["llama_a"])))
    with pytest.raises(ValueError, match="already loaded from"):
        shared_llm.generate([[1]], GREEDY, lora_request=LoRARequest("x", str(models["llama_b"])))


def test_lora_request_list_must_match_the_prompts(models, shared_llm):
    with pytest.raises(ValueError, match="got 1 LoRA requests for 2 prompts"):
        shared_llm.generate([[1], [2]], GREEDY, lora_request=[None])
    with pytest.raises(ValueError, match="must be a LoRARequest"):
        shared_llm.generate([[1]], GREEDY, lora_request=["a"])


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"max_loras": 0}, "max_loras must be at least 1"),
        ({"max_lora_rank": 0}, "max_lora_rank must be in"),
        ({"max_lora_rank": 512}, "max_lora_rank must be in"),
        ({"enable_lora": True, "tensor_parallel_size": 2}, "tensor_parallel_size > 1"),
    ],
)
def test_bad_lora_config(kwargs, words):
    with pytest.raises(ValueError, match=words):
        EngineConfig(device="cpu", **kwargs)


def test_lora_request_fields():
    with pytest.raises(ValueError, match="non-empty"):
        LoRARequest("", "/x")
    assert LoRARequest("a", Path("/x")).path == "/x"


# ---- pipeline stages -----------------------------------------------------------------------


def test_pipeline_stages_load_their_own_layers_and_equal_one_process(models, tmp_path):
    """Two stage processes, one slot for two adapters: every stage copies its layers' share of
    each adapter into the slot as the steps come, batches in flight included."""
    path = make_hf_checkpoint("llama", tmp_path / "four", num_hidden_layers=4)
    a = LoRARequest("a", str(make_peft_adapter(path, tmp_path / "a", seed=4)))
    b = LoRARequest("b", str(make_peft_adapter(path, tmp_path / "b", seed=5, r=4)))
    prompts = [p[:20] for p in oracle_prompts(300, seed=7)[:5]]  # short: steps, not chunks
    loras = [a, None, b, a, b]
    engine = {"device": "cpu", "dtype": "float32", "max_loras": 1, **ENGINE}
    want = tokens(lora_llm(path, **engine), prompts, loras)
    llm = lora_llm(path, pipeline_parallel_size=2, **engine)
    try:
        assert tokens(llm, prompts, loras) == want
        ranges = [s["layers"] for s in llm.graph_report()["stages"]]
        assert ranges == [[0, 2], [2, 4]]
        own = llm.engine.runner.lora.layers
        assert sorted({name.split(".")[2] for name in own}) == ["0", "1"]
        assert np.count_nonzero(own["model.layers.1.mlp.down_proj"].lora_a.numpy()) > 0
    finally:
        llm.engine.shutdown()
