"""PEFT LoRA adapters on disk: checked against the base model, then read layer by layer.

An adapter adds scaling * B @ A to a projection's weight, with A [rank, in] and B [out, rank]
(`...layers.{i}.self_attn.q_proj.lora_A.weight` and `...lora_B.weight` in
adapter_model.safetensors) and scaling = lora_alpha / rank (/ sqrt(rank) with use_rslora).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ostinato.loader import build_model
from ostinato.models.llama import merged_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# our projection -> the PEFT target modules its shards hold, in shard order (models/llama.py)
TARGETS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
SUPPORTED = tuple(t for parts in TARGETS.values() for t in parts)
# PEFT options that change the maths beyond W + scaling * B @ A: refused when set
_UNSUPPORTED = (
    "use_dora",
    "lora_bias",
    "modules_to_save",
    "layer_replication",
    "alpha_pattern",
    "target_parameters",
    "trainable_token_indices",
    "use_qalora",
    "use_bdlora",
)
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_([AB])\.weight$"
)


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the layer count and (in, out) features of each projection,
    keyed like "self_attn.q_proj"."""

    num_layers: int
    projections: dict[str, tuple[int, int]]

    @classmethod
    def of(cls, hf_config) -> BaseShapes:
        """Read off the first layer of a weightless ('meta') model of hf_config."""
        model = build_model(hf_config, "meta", torch.float32, (0, 1))
        projections = {}
        for name, module in model.named_modules():
            parts = TARGETS.get(name.rpartition(".")[2])
            if parts is None or not hasattr(module, "weight"):
                continue
            block = name.split(".")[-2]
            sizes = getattr(module, "out_sizes", [module.weight.shape[0]])
            for part, size in zip(parts, sizes, strict=True):
                projections[f"{block}.{part}"] = (module.weight.shape[1], size)
        return cls(hf_config.num_hidden_layers, projections)


@dataclass(frozen=True)
class AdapterConfig:
    alpha: float
    use_rslora: bool

    def scaling(self, rank: int) -> float:
        return self.alpha / (math.sqrt(rank) if self.use_rslora else rank)


def read_config(path: Path) -> AdapterConfig:
    file = path / CONFIG_FILE
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: give the adapter's PEFT directory")
    if not file.is_file():
        raise ValueError(f"{path} has no {CONFIG_FILE}: it is not a PEFT adapter directory")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {file}: {e}") from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"peft_type is {config['peft_type']!r}: only LORA adapters are supported")
    used = [name for name in _UNSUPPORTED if config.get(name)]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r}")
    if used:
        raise ValueError(f"uses {', '.join(used)}, which ostinato does not support")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unsupported = sorted(set(targets) - set(SUPPORTED))
        if unsupported:
            raise ValueError(
                f"targets {', '.join(unsupported)}: ostinato supports LoRA on "
                f"{', '.join(SUPPORTED)} only"
            )
    if "lora_alpha" not in config:
        raise ValueError(f"{CONFIG_FILE} has no lora_alpha")
    return AdapterConfig(float(config["lora_alpha"]), bool(config.get("use_rslora", False)))


def _weights_file(path: Path) -> Path:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        other = (
            " (adapter_model.bin: save it as safetensors)"
            if (path / "adapter_model.bin").is_file()
            else ""
        )
        raise ValueError(f"{path} has no {WEIGHTS_FILE}{other}")
    return file


def _parse_key(key: str) -> tuple[int, str, str]:
    """Checkpoint key -> (layer, "self_attn.q_proj", "A" or "B")."""
    match = _KEY.match(key)
    if match is None:
        raise ValueError(
            f"tensor {key!r} is not a LoRA weight of a decoder-layer projection: ostinato "
            f"supports LoRA on {', '.join(SUPPORTED)} only"
        )
    layer, block, target, which = match.groups()
    return int(layer), f"{block}.{target}", which


def check_adapter(path: str | Path, base: BaseShapes, max_rank: int) -> None:
    """Raise ValueError naming the first thing that keeps the adapter at `path` from running on
    the base model: files, options, target modules, layers, shapes, rank, non-finite values."""
    path = Path(path)
    read_config(path)
    file = _weights_file(path)
    pairs: dict[tuple[int, str], dict[str, tuple[int, ...]]] = {}
    try:
        with safe_open(file, framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                layer, projection, which = _parse_key(key)
                if projection.rpartition(".")[2] not in SUPPORTED:
                    raise ValueError(
                        f"{key}: target module {projection.rpartition('.')[2]!r} is not "
                        f"supported (ostinato supports {', '.join(SUPPORTED)})"
                    )
                tensor = f.get_tensor(key)
                if tensor.dim() != 2 or not tensor.is_floating_point():
                    raise ValueError(
                        f"{key} is not a float matrix: {tensor.dtype} {list(tensor.shape)}"
                    )
                if not torch.isfinite(tensor).all():
                    raise ValueError(f"{key} holds non-finite values")
                pairs.setdefault((layer, projection), {})[which] = tuple(tensor.shape)
    except (OSError, SafetensorError) as e:  # a damaged file
        raise ValueError(f"cannot read {file}: {e}") from None
    if not pairs:
        raise ValueError(f"{file} holds no LoRA weights")
    for (layer, projection), shapes in sorted(pairs.items()):
        _check_pair(layer, projection, shapes, base, max_rank)


def _check_pair(layer, projection, shapes, base: BaseShapes, max_rank: int) -> None:
    where = f"layer {layer} {projection}"
    if not 0 <= layer < base.num_layers:
        raise ValueError(f"{where}: the base model has {base.num_layers} layers")
    if projection not in base.projections:
        raise ValueError(f"{where}: the base model has no such projection")
    if set(shapes) != {"A", "B"}:
        raise ValueError(f"{where}: lora_A and lora_B must both be present")
    (rank, fan_in), (fan_out, rank_b) = shapes["A"], shapes["B"]
    expected_in, expected_out = base.projections[projection]
    if (fan_in, fan_out) != (expected_in, expected_out) or rank != rank_b:
        raise ValueError(
            f"{where}: lora_A {list(shapes['A'])} and lora_B {list(shapes['B'])} do not fit the "
            f"base model's {expected_in} -> {expected_out} projection: was the adapter trained "
            "for another model?"
        )
    if rank > max_rank:
        raise ValueError(
            f"{where} has rank {rank}, above max_lora_rank={max_rank}: raise max_lora_rank"
        )


def adapter_weights(
    path: str | Path, layers: range, dtype: torch.dtype
) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor]]:
    """(our module name, shard, A, scaling * B) in `dtype` for the projections of `layers`,
    on the CPU. The adapter was checked by check_adapter."""
    path = Path(path)
    config = read_config(path)
    with safe_open(_weights_file(path), framework="pt") as f:
        for key in sorted(f.keys()):
            layer, projection, which = _parse_key(key)
            if which != "A" or layer not in layers:
                continue
            a = f.get_tensor(key)
            b = f.get_tensor(key[: -len("A.weight")] + "B.weight")
            module, shard = merged_name(f"model.layers.{layer}.{projection}.weight")
            scaled = (b.float() * config.scaling(a.shape[0])).to(dtype)
            yield module.removesuffix(".weight"), shard or 0, a.to(dtype), scaled


def write_random_adapter(
    path: str | Path, base: BaseShapes, rank: int, seed: int = 0, dtype=torch.bfloat16
) -> Path:
    """A PEFT adapter of `rank` on every supported projection of every layer, with random
    weights: adapters of real shapes for benchmarks, with no training or download."""
    path = Path(path)
    generator = torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=generator)
    tensors = {}
    for layer in range(base.num_layers):
        for projection, (fan_in, fan_out) in base.projections.items():
            key = f"base_model.model.model.layers.{layer}.{projection}"
            tensors[f"{key}.lora_A.weight"] = (randn(rank, fan_in) * fan_in**-0.5).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (randn(fan_out, rank) * 0.02).to(dtype)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, path / WEIGHTS_FILE)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": SUPPORTED}
    (path / CONFIG_FILE).write_text(json.dumps(config))
    return path
