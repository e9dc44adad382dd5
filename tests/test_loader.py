"""Configs, presets, checkpoint files and weights: what loads, and the errors for what does not."""

from __future__ import annotations

import json
import re
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers import make_hf_checkpoint, make_hf_config
from safetensors.torch import load_file, save_file
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from ostinato.config import EngineConfig
from ostinato.layers.rotary import inverse_frequencies, rope_parameters
from ostinato.loader import PRESETS, build_model, load_hf_config, load_model
from ostinato.lora.layer import LoRALinear
from ostinato.lora.model import LoRAModel


def load(model: str, layer_range=None, seed: int = 0):
    config = EngineConfig(model=model, device="cpu", dtype="float32", seed=seed)
    return load_model(config, load_hf_config(model), layer_range)


def state(model) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


# Parameter counts of the released models (tied embeddings counted once).
@pytest.mark.parametrize(
    "preset, params, layers, tied",
    [
        ("qwen3-0.6b", 596_049_920, 28, True),
        ("qwen2.5-0.5b", 494_032_768, 24, True),
        ("llama-3.2-1b", 1_235_814_400, 16, True),
        ("llama-3.1-8b", 8_030_261_248, 32, False),
        ("qwen3-30b-a3b", 30_532_122_624, 48, False),
        ("mixtral-8x7b", 46_702_792_704, 32, False),
    ],
)
def test_presets_have_the_real_shapes(preset, params, layers, tied):
    hf_config = load_hf_config(f"random:{preset}")
    model = build_model(hf_config, "meta", torch.bfloat16)  # shapes only, nothing allocated
    assert sum(p.numel() for p in model.parameters()) == params
    assert len(model.model.layers) == hf_config.num_hidden_layers == layers
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32


def test_llama_3_1_preset_uses_llama3_rope_scaling():
    params = rope_parameters(load_hf_config("random:llama-3.1-8b"))
    assert params["rope_type"] == "llama3" and params["factor"] == 8.0
    assert params["rope_theta"] == 500000.0


def test_tiny_random_weights_are_seeded_and_the_same_in_every_stage():
    whole = state(load("tiny"))
    assert set(PRESETS) >= {"tiny", "qwen3-0.6b", "llama-3.2-1b", "llama-3.1-8b", "qwen2.5-0.5b"}
    assert all(torch.equal(p, state(load("tiny"))[n]) for n, p in whole.items())
    reseeded = state(load("tiny", seed=1))
    assert not torch.equal(
        whole["model.embed_tokens.weight"], reseeded["model.embed_tokens.weight"]
    )
    first, last = state(load("tiny", (0, 2))), state(load("tiny", (2, 4)))
    for name, param in {**first, **last}.items():
        if name != "lm_head.weight":
            assert torch.equal(param, whole[name]), name
    # tied: the last stage's own head holds the embedding the first stage has
    assert torch.equal(last["lm_head.weight"], whole["model.embed_tokens.weight"])
    weight = whole["model.layers.0.self_attn.qkv_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.002
    assert torch.equal(whole["model.norm.weight"], torch.ones(128))


def test_sharded_checkpoints_with_and_without_index_load_identically(tmp_path):
    single = make_hf_checkpoint("qwen2", tmp_path / "single")
    sharded = make_hf_checkpoint("qwen2", tmp_path / "sharded", max_shard_size="100KB")
    assert len(list(sharded.glob("*.safetensors"))) > 1
    assert (sharded / "model.safetensors.index.json").is_file()
    no_index = shutil.copytree(sharded, tmp_path / "no_index")
    (no_index / "model.safetensors.index.json").unlink()
    want = state(load(str(single)))
    for path in (sharded, no_index):
        got = state(load(str(path)))
        assert got.keys() == want.keys()
        assert all(torch.equal(got[n], want[n]) for n in want)


def test_rope_settings_parse_from_either_spelling(tmp_path):
    rope = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    new = rope_parameters(make_hf_config("llama"))  # written as rope_parameters
    old_file = make_hf_config("llama").to_dict()
    del old_file["rope_parameters"]
    old_file.update(rope_theta=10000.0, rope_scaling={**rope, "type": "llama3"})
    (tmp_path / "config.json").write_text(json.dumps(old_file))
    assert rope_parameters(load_hf_config(str(tmp_path))) == new
    # a transformers 4 config object: attributes rope_theta and rope_scaling only
    old_object = SimpleNamespace(rope_theta=10000.0, rope_scaling={**rope, "rope_type": "llama3"})
    assert rope_parameters(old_object) == new
    assert rope_parameters(SimpleNamespace(rope_theta=5.0, rope_scaling=None)) == {
        "rope_theta": 5.0,
        "rope_type": "default",
    }


@pytest.mark.parametrize(
    "rope", [{"rope_type": "linear", "factor": 4.0}, {"rope_type": "llama3", "factor": 32.0}]
)
def test_inverse_frequencies_match_transformers(rope):
    full = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    hf_config = make_hf_config("llama", rope_scaling={**full, **rope})
    want, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_config)
    torch.testing.assert_close(inverse_frequencies(64, rope_parameters(hf_config)), want)


def write_without(path, name: str, replacement: torch.Tensor | None = None) -> None:
    tensors = load_file(path / "model.safetensors")
    if replacement is None:
        del tensors[name]
    else:
        tensors[name] = replacement
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})


def bad_checkpoint(tmp_path, case: str) -> str:
    path = tmp_path / case
    if case == "no config.json":
        path.mkdir()
    elif case == "unsupported architecture":
        transformers.GPT2Config(n_layer=1, architectures=["GPT2LMHeadModel"]).save_pretrained(path)
    elif case == "unknown model type":
        path.mkdir()
        (path / "config.json").write_text(json.dumps({"model_type": "nonesuch"}))
    else:
        make_hf_checkpoint("qwen3", path)
    if case == "missing weight":
        write_without(path, "model.layers.1.self_attn.k_proj.weight")
    elif case == "wrong shape":
        write_without(path, "model.norm.weight", torch.ones(7))
    elif case == "no safetensors":
        (path / "model.safetensors").unlink()
    elif case == "index names a lost shard":
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}})
        )
    elif case == "sliding window":
        config = json.loads((path / "config.json").read_text())
        config.update(
            use_sliding_window=True, sliding_window=32, layer_types=["sliding_attention"] * 2
        )
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize(
    "case, message",
    [
        ("no config.json", "has no config.json"),
        ("unsupported architecture", "unsupported architecture GPT2LMHeadModel: ostinato supports "
                                     "LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"),
        ("unknown model type", "cannot read"),
        ("missing weight", "lacks weights: model.layers.1.self_attn.k_proj.weight"),
        ("wrong shape", "model.norm.weight: shape mismatch: parameter (128,), checkpoint (7,)"),
        ("no safetensors", "no *.safetensors weights"),
        ("index names a lost shard", "model-00002-of-00002.safetensors"),
        ("sliding window", "sliding-window attention"),
    ],
)  # fmt: skip
def test_bad_checkpoints_raise_value_error(tmp_path, case, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        load(bad_checkpoint(tmp_path, case))


@pytest.mark.parametrize(
    "model, message",
    [
        ("/nonexistent/model", "model path '/nonexistent/model' does not exist"),
        ("random:gpt-5", "unknown preset 'gpt-5': choose one of tiny, qwen3-0.6b"),
    ],
)
def test_bad_model_names_raise_value_error(model, message):
    with pytest.raises(ValueError, match=message):
        load_hf_config(model)


@pytest.mark.parametrize(
    "arch, change, message",
    [
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
        ("llama", {"hidden_act": "gelu"}, "unsupported activation 'gelu'"),
        ("mistral", {"sliding_window": 32}, "sliding-window attention (window 32 < 512"),
    ],
)
def test_unsupported_model_features_raise_value_error(arch, change, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        build_model(make_hf_config(arch, **change), "meta", torch.float32)


def test_layer_range_outside_the_model_raises_value_error():
    with pytest.raises(ValueError, match=r"layer_range \(2, 9\) is not within the 4 layers"):
        build_model(load_hf_config("tiny"), "meta", torch.float32, (2, 9))


def test_loaded_modules_read_parameters_and_submodules_as_plain_attributes(monkeypatch):
    """finish_loading / LoRAModel: each name reads without Module.__getattr__ (~1.5 µs a read
    on the build machine, ~600 reads an eager step), and a replaced one reads as replaced."""
    model = load("tiny")
    missed = []
    fallback = torch.nn.Module.__getattr__

    def through_getattr(module, name):
        missed.append(name)
        return fallback(module, name)

    monkeypatch.setattr(torch.nn.Module, "__getattr__", through_getattr)

    def read_all() -> None:
        missed.clear()
        for module in model.modules():
            for name, value in [*module._parameters.items(), *module._modules.items()]:
                assert getattr(module, name) is value
        assert not missed, missed

    read_all()
    proj = model.model.layers["0"].self_attn.o_proj
    replaced = torch.nn.Parameter(proj.weight.detach().clone(), requires_grad=False)
    proj.weight = replaced  # as FP8 at load replaces a weight
    assert proj.weight is replaced  # not the copy: read through __getattr__ again
    LoRAModel(model, max_loras=1, max_rank=4)
    assert isinstance(model.model.layers["0"].self_attn.qkv_proj, LoRALinear)
    read_all()
