"""Model configs and weights: a local Hugging Face directory, or a preset with random weights.

`tiny` and `random:<preset>` build real architectures from configs written here (the shapes of
the released models), so every benchmark runs without a download.
"""

from __future__ import annotations

import copy
import json
import re
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm
from transformers import AutoConfig, PretrainedConfig

from ostinato.config import EngineConfig
from ostinato.layers.weights import full_shape, loader_of
from ostinato.models.llama import TIED
from ostinato.models.registry import get_model_class
from ostinato.quantization import (
    QuantSpec,
    building,
    checkpoint_quantization,
    resolve_quantization,
)

_QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
_LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": _LLAMA3_ROPE,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
_QWEN3_30B_A3B = {
    **_QWEN3_0_6B,
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "tie_word_embeddings": False,
}
PRESETS: dict[str, dict] = {
    # Qwen3-shaped and small enough for a CPU; its vocabulary covers the byte tokenizer
    "tiny": {
        **_QWEN3_0_6B,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,  # the Triton kernels take 64, 128 or 256
        "vocab_size": 384,
        "max_position_embeddings": 4096,
        "bos_token_id": 256,
        "eos_token_id": 257,
    },
    "qwen3-0.6b": _QWEN3_0_6B,
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
    },
    "llama-3.2-1b": {
        **_LLAMA_3_1_8B,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "head_dim": 64,
        "rope_scaling": {**_LLAMA3_ROPE, "factor": 32.0},
        "tie_word_embeddings": True,
    },
    "llama-3.1-8b": _LLAMA_3_1_8B,
    # Qwen3-MoE-shaped and small enough for a CPU: 8 experts, 2 per token
    "tiny-moe": {
        **_QWEN3_30B_A3B,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "vocab_size": 384,
        "max_position_embeddings": 4096,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "moe_intermediate_size": 64,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen3-30b-a3b": _QWEN3_30B_A3B,
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"],
        "model_type": "mixtral",
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
_SHOW_PROGRESS_BYTES = 2**30
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # org/name
# what a Hub snapshot needs: config, generation config, tokenizer files, weights and index
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]


def is_random(model: str) -> bool:
    """Whether `model` names a preset with random weights rather than a directory."""
    return model == "tiny" or model.startswith("random:")


def resolve_model(model: str, revision: str | None = None) -> str:
    """A directory for `model`: presets and local paths as they are; a Hub id (org/name) is
    downloaded (config, tokenizer, safetensors) into huggingface_hub's cache, or found there,
    which honours HF_HOME, HF_TOKEN and HF_HUB_OFFLINE."""
    if is_random(model) or Path(model).exists() or not HUB_ID.fullmatch(model):
        return model
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(model, revision=revision, allow_patterns=HUB_FILES)
    except Exception as e:  # noqa: BLE001 (network, auth, missing repo or revision, no cache)
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(
            f"cannot get {model!r} from the Hugging Face Hub ({reason}): check the id and "
            "--revision and HF_TOKEN, or without network set HF_HUB_OFFLINE=1 with the model "
            "already in the cache (HF_HOME), or give a local directory"
        ) from None
    if not any(Path(path).glob("*.safetensors")):
        raise ValueError(
            f"{model!r} on the Hugging Face Hub has no *.safetensors weights (other formats are "
            "not supported): convert it and give a local directory"
        )
    return path


def load_hf_config(model: str) -> PretrainedConfig:
    """`tiny`, `random:<preset>` or a local Hugging Face directory -> its config."""
    if is_random(model):
        name = model.removeprefix("random:")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)}")
        preset = copy.deepcopy(PRESETS[name])  # transformers edits the nested rope dict
        return AutoConfig.for_model(preset.pop("model_type"), **preset)
    path = Path(model)
    if not path.exists():
        raise ValueError(
            f"model path {model!r} does not exist: give a local Hugging Face directory, a Hub "
            f"id (org/name), 'tiny' or 'random:<preset>' (presets: {', '.join(PRESETS)})"
        )
    if not (path / "config.json").is_file():
        raise ValueError(f"{model!r} has no config.json: it is not a Hugging Face model directory")
    try:
        hf_config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, KeyError) as e:
        raise ValueError(f"cannot read {path / 'config.json'}: {e}") from None
    try:
        checkpoint_quantization(hf_config)
    except ValueError as e:
        raise ValueError(f"{model}: {e}") from None
    return hf_config


def build_model(
    hf_config: PretrainedConfig,
    device: str | torch.device,
    dtype: torch.dtype,
    layer_range: tuple[int, int] | None = None,
    quantization: QuantSpec | None = None,
) -> nn.Module:
    """The model with uninitialised parameters, allocated directly on `device` in `dtype`
    (no CPU copy, no init kernels; 'meta' gives shapes only), its linear layers holding their
    weights as `quantization` says."""
    cls = get_model_class(hf_config)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), building(quantization):
            model = cls(hf_config, layer_range)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


@torch.no_grad()
def load_model(
    config: EngineConfig, hf_config: PretrainedConfig, layer_range: tuple[int, int] | None = None
) -> nn.Module:
    """The model for `config.model` with its weights: from the directory's safetensors, or
    seeded random ones for presets; quantised as the checkpoint or config.quantization says."""
    spec = resolve_quantization(config.quantization, hf_config)
    if spec is not None and config.enable_lora:
        raise ValueError(
            f"{config.model}: enable_lora does not work with fp8 weights yet (adapters wrap "
            "plain projections); drop --enable-lora or use the bf16 checkpoint"
        )
    model = build_model(hf_config, config.device, config.torch_dtype, layer_range, spec)
    if is_random(config.model):
        init_random_weights(model, config.seed)
    else:
        try:
            model.load_weights(iter_checkpoint(Path(config.model)))
        except ValueError as e:
            raise ValueError(f"{config.model}: {e}") from None
    finish_loading(model)
    return model


def finish_loading(model: nn.Module) -> None:
    """What a layer does once its weights are in (FP8 at load quantises them)."""
    for module in model.modules():
        if hasattr(module, "finish_loading"):
            module.finish_loading()
    plain_attributes(model)


def plain_attributes(model: nn.Module) -> None:
    """Every module's parameters and submodules also as plain instance attributes.

    nn.Module keeps them in dicts of its own, so each `self.weight` or `self.qkv_proj` a
    forward reads first fails Python's lookup (an AttributeError made and dropped), then runs
    Module.__getattr__: about 1.5 µs on the 2-core build machine, ~600 times an eager decode
    step (a fifth of its host time, benchmarks/host_step.py). The instance's own dict is read
    before any of that. Module.__setattr__ drops a name's copy whenever it assigns a Parameter
    or a Module (FP8's quantised weight, LoRA's wrapped projections), so a replaced one is read
    through __getattr__ again, and right. What would leave a copy stale: None assigned to a
    registered name, `del`, or a write past __setattr__ (`_parameters[name] = ...`); none
    happens to a loaded model. Buffers stay out: Module.to and tensor assignment replace them
    past it. Whoever replaces modules calls this again, for speed only."""
    for module in model.modules():
        module.__dict__.update(module._parameters)
        module.__dict__.update(module._modules)


def init_random_weights(model: nn.Module, seed: int) -> None:
    """Normal(0, 0.02) matrices, unit norms, zero biases, drawn on the model's device. Each
    parameter is seeded by its name and drawn at its whole-model shape, then loaded like a
    checkpoint tensor: a pipeline stage gets the weights the whole model has, and a tensor
    rank its share of them. (A rank draws the whole tensor and keeps its slice; the draw is
    freed at once, so only the load's peak grows, by the largest tensor.)"""
    tied = model.config.tie_word_embeddings
    generator = torch.Generator(next(model.parameters()).device)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            key = TIED[0] if tied and name in TIED else name  # a last stage's own tied head
            generator.manual_seed(zlib.crc32(f"{seed}/{key}".encode()))  # the CPU uses 32 bits
            whole = torch.empty(full_shape(param), dtype=param.dtype, device=param.device)
            loader_of(param)(param, whole.normal_(0.0, 0.02, generator=generator))


def checkpoint_files(path: Path) -> list[Path]:
    """The shards the index names, or every *.safetensors file when there is no index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = [
            path / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))
        ]
        absent = [f.name for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index.name} names shards that are not there: {', '.join(absent)}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError("no *.safetensors weights (other formats are not supported)")
    return files


class LazyTensor:
    """A checkpoint tensor that is read when indexed, and only the rows or columns asked for
    (safetensors' get_slice): a tensor-parallel rank never reads a whole tensor it splits.
    Valid while iter_checkpoint is on its file."""

    def __init__(self, handle) -> None:
        self._handle = handle
        self.shape = torch.Size(handle.get_shape())

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle[index]


def iter_checkpoint(path: Path) -> Iterator[tuple[str, LazyTensor]]:
    """(name, lazy tensor) over every shard, read onto the CPU when indexed; a progress bar
    over the tensors for big checkpoints."""
    files = checkpoint_files(path)
    big = sum(f.stat().st_size for f in files) >= _SHOW_PROGRESS_BYTES
    total = _count_tensors(files) if big else 0
    with tqdm(total=total, desc="Loading weights", unit=" tensors", disable=not big) as bar:
        for file in files:
            with safe_open(file, framework="pt") as shard:
                for name in shard.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, LazyTensor(shard.get_slice(name))
                    bar.update()


def _count_tensors(files: list[Path]) -> int:
    """From the files' headers alone."""
    total = 0
    for file in files:
        with safe_open(file, framework="pt") as shard:
            total += len(shard.keys())
    return total
