"""Engine configuration: one dataclass, validated once in __post_init__."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ostinato.layout import stage_layers
from ostinato.quantization import QUANTIZATIONS

DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
}
DEFAULT_MAX_MODEL_LEN = 4096
MAX_LORA_RANK = 256
CUDA_GRAPH_MODES = ("none", "piecewise", "full", "full_decode_only", "full_and_piecewise")
CUDA_GRAPH_CAPTURES = ("eager", "lazy")
SPECULATIVE_METHODS = ("ngram",)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class EngineConfig:
    """Everything the engine needs to know before it loads weights.

    `dtype`, `device` and `attention_backend` accept "auto", resolved here: CUDA when present,
    bfloat16 on CUDA and float32 on CPU, the Triton backend on CUDA and torch on CPU.
    """

    model: str = "tiny"  # a preset, a local directory or a Hugging Face Hub id (org/name)
    revision: str | None = None  # the Hub revision (branch, tag or commit) of a Hub id
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None  # None: the model's context length, at most 4096
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int = 256 * 2**20  # bytes of KV cache on CPU
    num_kv_blocks: int | None = None  # overrides both sizings; for tests
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    cuda_graph_mode: str = "full_and_piecewise"
    cuda_graph_capture: str = "eager"  # eager: every graph at start-up; lazy: each on first use
    enforce_eager: bool = False
    max_capture_size: int | None = None  # largest token graph; None: max_num_batched_tokens
    capture_sizes: list[int] | None = None
    # FULL graphs keyed by (tokens, requests) for steps of few requests (one long prompt):
    # token sizes in [min, max], at most max_capture_size; max 0 turns them off
    full_prefill_min_tokens: int = 64
    full_prefill_max_tokens: int = 2048
    check_graphs: int = 0
    debug_graph_addresses: bool = False
    max_waiting_requests: int = 1024
    pipeline_parallel_size: int = 1
    tensor_parallel_size: int = 1
    pp_layer_partition: list[int] | None = None  # layers per stage; None: an even split
    distributed_timeout: float = 120.0  # seconds any one collective may take before it fails
    speculative_method: str | None = None  # "ngram": draft tokens by prompt lookup
    num_speculative_tokens: int = 0  # k: draft tokens verified per request and step
    ngram_min: int = 1  # shortest suffix the n-gram proposer matches
    ngram_max: int = 4  # longest suffix it tries first
    enable_lora: bool = False
    max_loras: int = 4  # adapters one step may use (the adapter slots every rank holds)
    max_lora_rank: int = 64
    # schedule and launch the next step while the device runs this one; None: on wherever it
    # works (CUDA, one process)
    async_scheduling: bool | None = None
    # "fp8": quantise a bf16 checkpoint's linear weights at load (FP8 checkpoints need nothing)
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = default_device()
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"unknown device {self.device!r}: use 'cpu', 'cuda' or 'auto'")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.is_cuda else "float32"
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}: choose one of {sorted(DTYPES)}")
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.is_cuda else "torch"
        mode = self.cuda_graph_mode.lower()
        if mode not in CUDA_GRAPH_MODES:
            raise ValueError(
                f"unknown cuda_graph_mode {self.cuda_graph_mode!r}: "
                f"choose one of {CUDA_GRAPH_MODES}"
            )
        self.cuda_graph_mode = mode
        if self.cuda_graph_capture not in CUDA_GRAPH_CAPTURES:
            raise ValueError(
                f"unknown cuda_graph_capture {self.cuda_graph_capture!r}: choose 'eager' "
                "(capture every graph at start-up) or 'lazy' (capture each graph when a batch "
                "first needs it)"
            )
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.max_capture_size is not None and self.max_capture_size < 1:
            raise ValueError(f"max_capture_size must be at least 1, got {self.max_capture_size}")
        if self.capture_sizes is not None and any(s < 1 for s in self.capture_sizes):
            raise ValueError(f"capture_sizes must be positive, got {self.capture_sizes}")
        if self.full_prefill_min_tokens < 1 or self.full_prefill_max_tokens < 0:
            raise ValueError(
                f"full_prefill_min_tokens must be at least 1 and full_prefill_max_tokens at "
                f"least 0 (0: no FULL prefill graphs), got {self.full_prefill_min_tokens} and "
                f"{self.full_prefill_max_tokens}"
            )
        if 0 < self.full_prefill_max_tokens < self.full_prefill_min_tokens:
            raise ValueError(
                f"full_prefill_max_tokens={self.full_prefill_max_tokens} is below "
                f"full_prefill_min_tokens={self.full_prefill_min_tokens}: raise it, or set it "
                "to 0 to turn FULL prefill graphs off"
            )
        if self.check_graphs < 0:
            raise ValueError(f"check_graphs must be >= 0, got {self.check_graphs}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {self.num_kv_blocks}")
        for name in ("pipeline_parallel_size", "tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.pp_layer_partition is not None:
            self.pp_layer_partition = list(self.pp_layer_partition)
            if len(self.pp_layer_partition) != self.pipeline_parallel_size:
                raise ValueError(
                    f"pp_layer_partition has {len(self.pp_layer_partition)} entries for "
                    f"pipeline_parallel_size={self.pipeline_parallel_size}: give one layer "
                    "count per stage"
                )
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(
                f"unknown quantization {self.quantization!r}: choose one of {QUANTIZATIONS} or None"
            )
        self._check_lora()
        if not self.distributed_timeout > 0:
            raise ValueError(
                f"distributed_timeout must be positive seconds, got {self.distributed_timeout}"
            )
        self._check_speculation()
        self._resolve_async_scheduling()

    def _resolve_async_scheduling(self) -> None:
        if self.async_scheduling not in (None, True, False):
            raise ValueError(
                f"async_scheduling must be True, False or None (on wherever it works), got "
                f"{self.async_scheduling!r}"
            )
        if self.async_scheduling is None:  # several GPUs: not yet measured, so asked for
            self.async_scheduling = self.is_cuda and self.world_size == 1

    def _check_speculation(self) -> None:
        k = self.num_speculative_tokens
        if self.speculative_method is None:
            if k != 0:
                raise ValueError(
                    f"num_speculative_tokens={k} needs a speculative_method: set "
                    f"speculative_method to one of {SPECULATIVE_METHODS}, or drop it"
                )
        elif self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"unknown speculative_method {self.speculative_method!r}: choose one of "
                f"{SPECULATIVE_METHODS} or None"
            )
        elif k < 1:
            raise ValueError(
                f"speculative_method={self.speculative_method!r} needs num_speculative_tokens "
                f">= 1 (draft tokens verified per step), got {k}"
            )
        elif 1 + k > self.max_num_batched_tokens:
            raise ValueError(
                f"num_speculative_tokens={k} needs {1 + k} tokens per request and step, more "
                f"than max_num_batched_tokens={self.max_num_batched_tokens}: lower "
                "num_speculative_tokens or raise max_num_batched_tokens"
            )
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={self.ngram_min} and "
                f"ngram_max={self.ngram_max}"
            )

    def _check_lora(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be at least 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}"
            )
        if self.enable_lora and self.tensor_parallel_size > 1:
            raise ValueError(
                "enable_lora does not work with tensor_parallel_size > 1 yet: adapters are not "
                "sharded over tensor ranks; use pipeline_parallel_size instead"
            )

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def world_size(self) -> int:
        return self.pipeline_parallel_size * self.tensor_parallel_size

    def for_model(self, hf_config) -> EngineConfig:
        """The config checked against the model: max_model_len resolved against its context
        length, the pipeline split against its layers, the tensor split against its heads."""
        num_layers = hf_config.num_hidden_layers
        if self.pipeline_parallel_size > num_layers:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size} is more than the model's "
                f"{num_layers} layers: every stage needs at least one"
            )
        stage_layers(num_layers, self.pipeline_parallel_size, self.pp_layer_partition)
        _check_tensor_split(hf_config, self.tensor_parallel_size)
        limit = getattr(hf_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        if self.max_model_len is None:
            return replace(self, max_model_len=min(limit, DEFAULT_MAX_MODEL_LEN))
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} is above the model's context length "
                f"(max_position_embeddings={limit}): lower max_model_len"
            )
        return self

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)


def _tensor_split_problems(hf_config, tp_size: int) -> list[str]:
    """What of the model tp_size tensor ranks cannot split (empty: it splits)."""
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    problems = []
    if heads % tp_size:
        problems.append(f"its {heads} attention heads")
    if kv_heads % tp_size and tp_size % kv_heads:
        problems.append(f"its {kv_heads} KV heads (nor is it a multiple of them)")
    for name in ("intermediate_size", "moe_intermediate_size"):  # the experts' features too
        size = getattr(hf_config, name, None)
        if size is not None and size % tp_size:
            problems.append(f"its {name} {size}")
    return problems


def _check_tensor_split(hf_config, tp_size: int) -> None:
    if tp_size == 1:  # nothing to split (and an unsupported model is refused by its loader)
        return
    problems = _tensor_split_problems(hf_config, tp_size)
    if problems:
        fits = [t for t in range(1, hf_config.num_attention_heads + 1)
                if not _tensor_split_problems(hf_config, t)]  # fmt: skip
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide {' or '.join(problems)}: every "
            f"tensor rank needs whole heads and an equal share of the features; choose "
            f"tensor_parallel_size in {fits} (or split the layers with pipeline_parallel_size)"
        )
