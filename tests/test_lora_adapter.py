"""LoRA adapter files without an engine: the base model's shapes, every check of
check_adapter with its message, and the weights adapter_weights reads (scaling written here
from PEFT's definition). tests/test_lora.py runs adapters through the engine."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import make_hf_config
from safetensors.torch import load_file, save_file

from ostinato.lora.adapter import (
    AdapterConfig,
    BaseShapes,
    adapter_weights,
    check_adapter,
    read_config,
    write_random_adapter,
)

# make_hf_config("llama"): hidden 128, intermediate 256, 4 heads and 2 KV heads of 64, 2 layers
PROJECTIONS = {
    "self_attn.q_proj": (128, 256),
    "self_attn.k_proj": (128, 128),
    "self_attn.v_proj": (128, 128),
    "self_attn.o_proj": (256, 128),
    "mlp.gate_proj": (128, 256),
    "mlp.up_proj": (128, 256),
    "mlp.down_proj": (256, 128),
}
BASE = BaseShapes(2, PROJECTIONS)
KEY = "base_model.model.model.layers.{}.{}.lora_{}.weight"


def pair(layer: int, projection: str, rank: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    fan_in, fan_out = PROJECTIONS[projection]
    g = torch.Generator().manual_seed(seed)
    return {
        KEY.format(layer, projection, "A"): torch.randn(rank, fan_in, generator=g),
        KEY.format(layer, projection, "B"): torch.randn(fan_out, rank, generator=g),
    }


def write(path: Path, tensors: dict | None = None, **config) -> Path:
    """An adapter directory: `tensors` (default: rank 2 on layer 0's q_proj and layer 1's
    down_proj) and a LORA config with `config` merged in (None drops a field)."""
    path.mkdir(parents=True, exist_ok=True)
    if tensors is None:
        tensors = pair(0, "self_attn.q_proj") | pair(1, "mlp.down_proj", seed=1)
    save_file(tensors, path / "adapter_model.safetensors")
    fields = {"peft_type": "LORA", "r": 2, "lora_alpha": 8, "target_modules": ["q_proj"]}
    fields = {k: v for k, v in (fields | config).items() if v is not None}
    (path / "adapter_config.json").write_text(json.dumps(fields))
    return path


def refused(path: Path, message: str, max_rank: int = 16) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        check_adapter(path, BASE, max_rank)


def test_base_shapes_are_the_projections_of_the_model():
    shapes = BaseShapes.of(make_hf_config("llama"))
    assert shapes.num_layers == 2 and shapes.projections == PROJECTIONS
    assert BaseShapes.of(make_hf_config("llama", num_hidden_layers=3)).num_layers == 3


def test_a_good_adapter_passes_and_reads_its_config(tmp_path):
    path = write(tmp_path, lora_alpha=16, use_rslora=True)
    check_adapter(str(path), BASE, max_rank=2)  # rank 2 == max_lora_rank is allowed
    assert read_config(path) == AdapterConfig(alpha=16.0, use_rslora=True)
    assert read_config(write(tmp_path / "plain", lora_alpha=4)) == AdapterConfig(4.0, False)


def test_keys_without_peft_s_prefix_are_read(tmp_path):
    tensors = {k.removeprefix("base_model.model."): v for k, v in pair(1, "mlp.up_proj").items()}
    path = write(tmp_path, tensors)
    check_adapter(path, BASE, 16)
    [(module, shard, _, _)] = adapter_weights(path, range(2), torch.float32)
    assert (module, shard) == ("model.layers.1.mlp.gate_up_proj", 1)


def test_files_and_config_fields_are_checked(tmp_path):
    refused(tmp_path / "nowhere", "is not a directory: give the adapter's PEFT directory")
    (tmp_path / "empty").mkdir()
    refused(tmp_path / "empty", "has no adapter_config.json: it is not a PEFT adapter directory")
    bad_json = write(tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    refused(bad_json, "cannot read")
    refused(
        write(tmp_path / "ia3", peft_type="IA3"),
        "peft_type is 'IA3': only LORA adapters are supported",
    )
    read_config(write(tmp_path / "no_type", peft_type=None))  # LORA by default
    refused(write(tmp_path / "no_alpha", lora_alpha=None), "adapter_config.json has no lora_alpha")
    refused(
        write(tmp_path / "targets", target_modules=["q_proj", "lm_head", "embed_tokens"]),
        "targets embed_tokens, lm_head: ostinato supports LoRA on q_proj, k_proj, v_proj, "
        "o_proj, gate_proj, up_proj, down_proj only",
    )
    read_config(write(tmp_path / "regex", target_modules="all-linear"))  # keys are checked


@pytest.mark.parametrize(
    "option",
    ["use_dora", "lora_bias", "modules_to_save", "layer_replication", "alpha_pattern",
     "target_parameters", "trainable_token_indices", "use_qalora", "use_bdlora"],
)  # fmt: skip
def test_peft_options_beyond_plain_lora_are_refused(tmp_path, option):
    refused(write(tmp_path, **{option: ["x"]}), f"uses {option}, which ostinato does not support")
    read_config(write(tmp_path / "off", **{option: False}))  # set to off: fine


def test_every_unsupported_option_is_named(tmp_path):
    refused(
        write(tmp_path, use_dora=True, bias="all"),
        "uses use_dora, bias='all', which ostinato does not support",
    )
    read_config(write(tmp_path / "none", bias="none"))


def test_weights_file_must_be_safetensors(tmp_path):
    path = write(tmp_path)
    (path / "adapter_model.safetensors").unlink()
    refused(path, "has no adapter_model.safetensors")
    with pytest.raises(ValueError, match=r"safetensors$"):  # no hint without a .bin
        check_adapter(path, BASE, 16)
    (path / "adapter_model.bin").write_bytes(b"")
    refused(path, "has no adapter_model.safetensors (adapter_model.bin: save it as safetensors)")


def test_tensors_are_checked(tmp_path):
    q = pair(0, "self_attn.q_proj")
    a, b = KEY.format(0, "self_attn.q_proj", "A"), KEY.format(0, "self_attn.q_proj", "B")
    refused(
        write(tmp_path / "lm_head", q | {"base_model.model.lm_head.lora_A.weight": q[a].clone()}),
        "tensor 'base_model.model.lm_head.lora_A.weight' is not a LoRA weight of a "
        "decoder-layer projection: ostinato supports LoRA on q_proj, k_proj, v_proj, o_proj, "
        "gate_proj, up_proj, down_proj only",
    )
    rotary = KEY.format(0, "self_attn.rotary", "A")
    refused(
        write(tmp_path / "rotary", {rotary: q[a]}),
        f"{rotary}: target module 'rotary' is not supported (ostinato supports q_proj, ",
    )
    refused(
        write(tmp_path / "vector", {**q, a: torch.ones(128)}),
        f"{a} is not a float matrix: torch.float32 [128]",
    )
    refused(
        write(tmp_path / "ints", {**q, b: torch.ones(256, 2, dtype=torch.int32)}),
        f"{b} is not a float matrix: torch.int32 [256, 2]",
    )
    for bad in (float("nan"), float("inf")):
        tensor = q[b].clone()
        tensor[3, 1] = bad
        refused(write(tmp_path / str(bad), {**q, b: tensor}), f"{b} holds non-finite values")
    damaged = write(tmp_path / "damaged")
    data = (damaged / "adapter_model.safetensors").read_bytes()
    (damaged / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    refused(damaged, "cannot read")
    refused(write(tmp_path / "none", {}), "adapter_model.safetensors holds no LoRA weights")


def test_each_pair_must_fit_the_base_model(tmp_path):
    q = pair(0, "self_attn.q_proj")
    a, b = KEY.format(0, "self_attn.q_proj", "A"), KEY.format(0, "self_attn.q_proj", "B")
    refused(
        write(tmp_path / "layer", pair(2, "self_attn.q_proj")),
        "layer 2 self_attn.q_proj: the base model has 2 layers",
    )
    misplaced = {KEY.format(0, "mlp.q_proj", w): t for w, t in zip("AB", q.values(), strict=True)}
    refused(
        write(tmp_path / "misplaced", misplaced),
        "layer 0 mlp.q_proj: the base model has no such projection",
    )
    refused(
        write(tmp_path / "half", {a: q[a]}),
        "layer 0 self_attn.q_proj: lora_A and lora_B must both be present",
    )
    fits = "do not fit the base model's 128 -> 256 projection: was the adapter trained for"
    for name, shapes in [("in", ((2, 64), (256, 2))), ("out", ((2, 128), (128, 2))),
                         ("rank", ((2, 128), (256, 3)))]:  # fmt: skip
        tensors = {a: torch.zeros(shapes[0]), b: torch.zeros(shapes[1])}
        refused(
            write(tmp_path / name, tensors),
            f"layer 0 self_attn.q_proj: lora_A {list(shapes[0])} and lora_B {list(shapes[1])} "
            + fits,
        )
    refused(
        write(tmp_path / "rank", pair(1, "mlp.down_proj", rank=3)),
        "layer 1 mlp.down_proj has rank 3, above max_lora_rank=2: raise max_lora_rank",
        max_rank=2,
    )


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_weights_are_a_and_scaled_b_per_shard(tmp_path, rslora):
    tensors = pair(0, "self_attn.k_proj", rank=4) | pair(1, "mlp.down_proj", rank=4, seed=1)
    path = write(tmp_path, tensors, lora_alpha=6, use_rslora=rslora)
    scaling = 6 / (math.sqrt(4) if rslora else 4)  # PEFT: alpha / r, or alpha / sqrt(r)
    got = list(adapter_weights(path, range(2), torch.float64))
    assert [(module, shard) for module, shard, _, _ in got] == [
        ("model.layers.0.self_attn.qkv_proj", 1),
        ("model.layers.1.mlp.down_proj", 0),
    ]
    for (_, _, a, scaled_b), projection in zip(got, ["0.self_attn.k_proj", "1.mlp.down_proj"],
                                               strict=True):  # fmt: skip
        layer, name = projection.split(".", 1)
        want_a = tensors[KEY.format(layer, name, "A")].double()
        want_b = tensors[KEY.format(layer, name, "B")].double() * scaling
        assert a.dtype == scaled_b.dtype == torch.float64
        torch.testing.assert_close(a, want_a)
        torch.testing.assert_close(scaled_b, want_b)
    [(module, _, _, _)] = adapter_weights(path, range(1, 2), torch.float32)  # a stage's layers
    assert module == "model.layers.1.mlp.down_proj"


def test_random_adapters_fit_their_base_and_are_seeded(tmp_path):
    path = write_random_adapter(tmp_path / "a" / "nested", BASE, rank=4, seed=3)
    assert write_random_adapter(path, BASE, rank=4, seed=3) == path  # over an existing one
    check_adapter(path, BASE, max_rank=4)
    assert read_config(path) == AdapterConfig(alpha=4.0, use_rslora=False)  # scaling 1
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["peft_type"] == "LORA"
    assert config["target_modules"] == [p.split(".")[1] for p in PROJECTIONS]  # PEFT reads it
    weights = load_file(path / "adapter_model.safetensors")
    assert len(weights) == 2 * 2 * len(PROJECTIONS)
    a = weights[KEY.format(1, "mlp.down_proj", "A")]
    b = weights[KEY.format(1, "mlp.down_proj", "B")]
    assert a.shape == (4, 256) and b.shape == (128, 4) and a.dtype == torch.bfloat16
    # A like a trained layer's input map (std fan_in^-1/2), B small
    assert a.float().std().item() == pytest.approx(256**-0.5, rel=0.2)
    assert b.float().std().item() == pytest.approx(0.02, rel=0.2)
    same = load_file(
        write_random_adapter(tmp_path / "b", BASE, 4, seed=3) / "adapter_model.safetensors"
    )
    other = load_file(
        write_random_adapter(tmp_path / "c", BASE, 4, seed=4) / "adapter_model.safetensors"
    )
    assert all(torch.equal(weights[k], same[k]) for k in weights)
    assert not torch.equal(weights[KEY.format(0, "self_attn.q_proj", "A")],
                           other[KEY.format(0, "self_attn.q_proj", "A")])  # fmt: skip
    half = write_random_adapter(tmp_path / "d", BASE, 2, dtype=torch.float16)
    assert next(iter(load_file(half / "adapter_model.safetensors").values())).dtype == torch.float16
