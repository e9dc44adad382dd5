"""Tiny random Hugging Face checkpoints for the oracle tests: a model and a tokenizer that both
transformers and ostinato load from the same directory."""

from __future__ import annotations

import importlib.util
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ostinato.config import EngineConfig
from ostinato.outputs import RequestOutput
from ostinato.sampling_params import SamplingParams

# Every shape small, head_dim 64 so the Triton kernels take it too; vocab above the tokenizer's.
_COMMON = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 320,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.2,  # well above 0.02, so the outputs depend on the context
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": None,
}
ARCHS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            # original length below the test lengths, so the scaling changes the outputs
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        },
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False}),
    # 8 experts, 2 per token; one dense layer (mlp_only_layers) beside the sparse ones
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "tie_word_embeddings": False,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
        },
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_local_experts": 6,
            "num_experts_per_tok": 2,
            "sliding_window": None,
            "intermediate_size": 96,
        },
    ),
}
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine.",
    "Hello world! Hello there, how are you today? I am fine, thank you.",
    "once upon a time there was a little model that generated text 0123456789",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def load_benchmark(name: str):
    """benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    path = Path(__file__).parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_tokenizer(vocab_size: int = 300) -> transformers.PreTrainedTokenizerFast:
    """Byte-level BPE trained on a fixed corpus (deterministic): any text round-trips. Ids
    0 and 1 are <s> (prepended by encode) and </s> (EOS)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def make_hf_config(arch: str, **overrides) -> transformers.PretrainedConfig:
    """arch: llama (llama3 rope scaling, untied), mistral, qwen2 (qkv bias, tied), qwen3
    (q/k norm, untied); overrides are config fields."""
    config_cls, model_arch, extra = ARCHS[arch]
    kwargs = {**_COMMON, **extra, "architectures": [model_arch], **overrides}
    return getattr(transformers, config_cls)(**kwargs)


def make_hf_checkpoint(arch: str, path: str | Path, seed: int = 0, **overrides) -> Path:
    """Writes a random float32 model (every parameter random, biases and norms included, so a
    weight loaded into the wrong place shows) and a tokenizer into `path`. Pass
    `max_shard_size="100KB"` to get a sharded checkpoint with an index file."""
    path = Path(path)
    shard_size = overrides.pop("max_shard_size", None)
    config = make_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, config.initializer_range)
    save_kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    make_tokenizer(min(300, config.vocab_size)).save_pretrained(path)
    return path


def make_peft_adapter(
    checkpoint: str | Path,
    path: str | Path,
    seed: int = 0,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: tuple[str, ...] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ),
    **lora_options,
) -> Path:
    """A PEFT LoRA adapter for the model at `checkpoint`, saved by peft itself into `path`, with
    random A and B (peft starts B at zero, which would change nothing)."""
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    config = LoraConfig(
        r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), **lora_options
    )
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.2)
    peft_model.save_pretrained(path)
    return Path(path)


def overlapped_submits(llm) -> list[int]:
    """Record, for every submitted step of llm (an LLM), how many steps were already in flight."""
    engine, seen = llm.engine, []
    submit = engine.executor.submit

    def counting(step):
        seen.append(len(engine.in_flight))
        return submit(step)

    engine.executor.submit = counting
    return seen


# ---- processes, from /proc (CI has no psutil) ---------------------------------------------
def child_pids(pid: int, command_part: str = "") -> list[int]:
    """The processes whose parent is pid (and whose command line holds command_part)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                command = f.read().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
        if ppid == pid and command_part in command:
            found.append(int(entry))
    return found


def descendants(pid: int) -> list[int]:
    """Every process below pid: its children, theirs, and so on."""
    found, todo = [], [pid]
    while todo:
        children = child_pids(todo.pop())
        found += children
        todo += children
    return found


def assert_all_gone(pids: list[int], timeout: float = 10.0) -> None:
    """Every one of pids ends within timeout seconds."""
    deadline = time.monotonic() + timeout
    while any(is_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if is_alive(p)], "processes left behind"


def shut_down_killing(engine, rank: int) -> tuple[float, int]:
    """engine.shutdown() with worker `rank` killed (SIGKILL) while shutdown waits for the
    workers to take their Shutdown message -> (the seconds shutdown took, the worker's pid)."""
    channel = engine.executor.world.channel
    victim = engine.executor.workers.procs[rank].pid
    flush = channel.flush

    def killing_flush(*args, **kwargs):
        os.kill(victim, signal.SIGKILL)
        time.sleep(0.5)  # the watchdog sees the death while shutdown is still here
        return flush(*args, **kwargs)

    channel.flush = killing_flush  # this engine's channel only, gone with it
    start = time.monotonic()
    engine.shutdown()
    return time.monotonic() - start, victim


def is_alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


# ---- faults of multi-process engines -------------------------------------------------------
def assert_killing_stops_the_engine(engine, pid: int, error: str) -> None:
    """SIGKILL the worker pid mid-generation: the engine's next steps raise WorkerError
    matching `error` within 30 s (timeouts on every collective: no hang)."""
    import pytest

    from ostinato.distributed.executor import WorkerError

    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match=error):
        while engine.has_unfinished_requests():
            engine.step()
    assert time.monotonic() - start < 30


def assert_stopped_for_good(llm, workers) -> None:
    """No worker is left, and the engine refuses later requests."""
    import pytest

    from ostinato import SamplingParams
    from ostinato.distributed.executor import WorkerError

    assert not any(p.is_alive() for p in workers)
    with pytest.raises(WorkerError, match="engine has stopped"):
        llm.generate(["again"], SamplingParams(max_tokens=2), use_tqdm=False)


def assert_a_stopped_driver_leaves_nothing(
    script: Path, sig: int, ready: str, start_s: float, stop_s: float = 15, children: int = 0
) -> None:
    """Run script (this checkout's ostinato) as a user would, wait up to start_s for it to
    print `ready`, then send it sig: it ends within stop_s, and every process it started
    (workers, multiprocessing's resource tracker; `children` of them where given, else at
    least one) within 10 s more. Its stderr goes to a file beside it, quoted when it does not
    start."""
    # this checkout first, then what the caller's path holds (packages installed beside it)
    path = os.pathsep.join(
        filter(None, [str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")])
    )
    log = script.with_suffix(".log")
    with open(log, "w") as err:
        driver = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, text=True,
            cwd=script.parent, env={**os.environ, "PYTHONPATH": path}, preexec_fn=_takes_sigint,
        )  # fmt: skip
    try:
        readable, _, _ = select.select([driver.stdout], [], [], start_s)
        line = driver.stdout.readline().strip() if readable else None
        assert line == ready, f"{script.name} printed {line!r}: {log.read_text()[-3000:]}"
        procs = child_pids(driver.pid)
        assert (len(procs) == children) if children else procs, procs
        driver.send_signal(sig)
        start = time.monotonic()
        driver.wait(timeout=stop_s + 60)
        assert time.monotonic() - start < stop_s
    finally:
        driver.kill()
        driver.wait()
    deadline = time.monotonic() + 10
    while any(is_alive(p) for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in procs if is_alive(p)]


def _takes_sigint() -> None:
    """A user's Ctrl-C reaches a process that takes SIGINT. A child inherits an ignored
    SIGINT (then Python installs no KeyboardInterrupt) and a blocked one, whatever ignored or
    blocked it in the test process: the driver starts with neither."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


# ---- a fake engine for the paths a real model cannot trigger ------------------------------
class ByteTokenizer:
    eos_token_id = 0
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages) + "<a>")


class FakeEngine:
    """Emits 'a', 'b', ... one token per step; the first max_num_seqs requests run, the rest wait.

    `fail_step` makes the next step raise; a prompt containing "FAIL" ends with an error output.
    """

    def __init__(self, **config) -> None:
        self.config = EngineConfig(device="cpu", max_model_len=64, **config)
        self.tokenizer = ByteTokenizer()
        self.requests: dict[str, tuple[list[int], SamplingParams, list[int]]] = {}
        self.fail_step = False
        self.failed: str | None = None  # set: the engine stopped for good
        self.shut_down = False

    def shutdown(self) -> None:
        self.shut_down = True

    def add_request(
        self, prompt, params: SamplingParams, request_id: str | None = None, lora_request=None
    ) -> str:
        assert lora_request is None  # the async engine passes it through
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if len(ids) > self.config.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens, over max_model_len")
        self.requests[request_id] = (ids, params, [])
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)
        if self.fail_step:
            self.fail_step = False
            raise RuntimeError("boom")
        running = list(self.requests.items())[: self.config.max_num_seqs]
        return [self._advance(rid, *req) for rid, req in running]

    def _advance(self, rid: str, ids: list[int], params: SamplingParams, toks: list[int]):
        toks.append(ord("a") + len(toks) % 26)
        failed = b"FAIL" in bytes(ids)
        done = failed or len(toks) >= params.max_tokens
        if done:
            del self.requests[rid]
        reason = ("error" if failed else "length") if done else None
        return RequestOutput(
            rid, ids, list(toks), self.tokenizer.decode(toks), [toks[-1]], done, reason,
            "cannot encode stop string" if failed else None,
        )  # fmt: skip

    def stats(self) -> dict:
        n = len(self.requests)
        running = min(n, self.config.max_num_seqs)
        return {"num_running": running, "num_waiting": n - running, "kv_blocks_total": 8}

    def graph_report(self) -> dict:
        return {}


# Kernel tests' tolerance per dtype, against float64 math written in the test.
KERNEL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """actual equals expected (float64) within dtype's kernel tolerance, times scale."""
    tol = KERNEL_TOL[dtype] * scale
    torch.testing.assert_close(actual.double(), expected.double(), rtol=tol, atol=tol)


FENCE = 256  # NaN elements on each side of a fenced tensor


def nan_fenced(t: torch.Tensor, row_stride: int | None = None) -> torch.Tensor:
    """A copy of t (floating point, FP8 included) in memory of NaNs: FENCE of them before its
    first element and after its last, and with row_stride (t 2-d) its rows that many elements
    apart, NaNs between them. A kernel that reads outside the tensor (past its end, before
    its start, past a row's last column) then gets NaN, and its output shows it wherever the
    value reaches it (times a zero weight included): the CPU interpreter reads the real memory
    there, where the GPU reads whatever lies there."""
    if row_stride is None:
        rows, width = 1, t.numel()
    else:
        assert t.dim() == 2 and row_stride >= t.shape[1]
        rows, width = t.shape[0], row_stride
    memory = torch.full((2 * FENCE + rows * width,), float("nan"), dtype=t.dtype)
    inside = memory[FENCE : FENCE + rows * width]
    if row_stride is None:
        inside = inside.view(t.shape)
    else:
        inside = inside.view(rows, width)[:, : t.shape[1]]
    inside.copy_(t)
    return inside


def fence_intact(t: torch.Tensor) -> bool:
    """Whether nothing was written outside a nan_fenced tensor: the rest of its memory (the
    fences, the gaps between rows) is still all NaN."""
    memory = t.new_empty(0).set_(t.untyped_storage())  # the whole allocation, flat
    outside = torch.ones(memory.shape, dtype=torch.bool)
    outside.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(False)
    return bool(memory.float()[outside].isnan().all())
