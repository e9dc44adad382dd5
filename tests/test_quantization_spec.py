"""Which quantisation a model runs with (ostinato/quantization.py), from its config alone: the
checkpoint's block-wise FP8, FP8 at load, or a refusal that names what cannot run. (The
loading and the kernels are tests/test_quantization.py's.)"""

import re
from types import SimpleNamespace

import pytest

from ostinato.quantization import (
    QuantSpec,
    building,
    building_spec,
    checkpoint_quantization,
    resolve_quantization,
)

FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}


class QuantizationConfig:
    """transformers hands quantization_config as an object with to_dict() for known methods."""

    def __init__(self, fields: dict) -> None:
        self.fields = fields

    def to_dict(self) -> dict:
        return dict(self.fields)


def hf(quantization_config=None, **fields):
    if quantization_config is not None:
        fields["quantization_config"] = quantization_config
    return SimpleNamespace(**fields)


def test_plain_weights_have_no_quantization():
    assert checkpoint_quantization(hf()) is None
    assert resolve_quantization(None, hf()) is None


@pytest.mark.parametrize("config", [FP8, QuantizationConfig(FP8)])
def test_a_block_wise_fp8_checkpoint_is_read_as_its_blocks(config):
    spec = checkpoint_quantization(hf(config))
    assert spec == QuantSpec("fp8", (128, 128)) and spec.from_checkpoint
    assert resolve_quantization(None, hf(config)) == spec
    assert resolve_quantization("fp8", hf(config)) == spec  # the checkpoint's own scheme wins


def test_the_activation_scheme_defaults_to_dynamic_and_blocks_may_differ():
    spec = checkpoint_quantization(hf({"quant_method": "fp8", "weight_block_size": (64, 16)}))
    assert spec == QuantSpec("fp8", (64, 16))


def test_fp8_at_load_keeps_a_scale_per_row():
    spec = resolve_quantization("fp8", hf())
    assert spec == QuantSpec("fp8") and spec.block is None and not spec.from_checkpoint


@pytest.mark.parametrize("block", [None, [128], [128, 128, 128], [128, 96], [8, 8], [128.0, 128],
                                   "128x128", [0, 128]])  # fmt: skip
def test_a_block_size_the_kernels_cannot_take_is_refused(block):
    message = (
        f"unsupported fp8 checkpoint: weight_block_size {block!r} in quantization_config; "
        "ostinato runs block-wise fp8 with power-of-two blocks (weight_block_size [128, 128])"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint_quantization(hf({"quant_method": "fp8", "weight_block_size": block}))


@pytest.mark.parametrize("method", ["awq", "gptq", None])
def test_another_method_is_refused_by_name(method):
    message = (
        f"unsupported quantization {method!r} (config.json quantization_config): ostinato runs "
        "block-wise fp8 checkpoints only; use the bf16 release of the model"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        checkpoint_quantization(hf({"quant_method": method}))


def test_a_static_activation_scheme_is_refused():
    config = {**FP8, "activation_scheme": "static"}
    with pytest.raises(ValueError, match="unsupported fp8 activation_scheme 'static': ostinato"):
        checkpoint_quantization(hf(config))


@pytest.mark.parametrize("experts", [{"num_experts": 128}, {"num_local_experts": 8}])
@pytest.mark.parametrize("requested, config", [("fp8", None), (None, FP8)])
def test_fp8_mixture_of_experts_is_refused_either_way(experts, requested, config):
    message = (
        "fp8 weights of a mixture-of-experts model are not supported yet: run its bf16 "
        "checkpoint without --quantization"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve_quantization(requested, hf(config, **experts))
    assert resolve_quantization(None, hf(**experts)) is None  # bf16 experts run
    assert resolve_quantization("fp8", hf(num_experts=0)) == QuantSpec("fp8")  # a dense model


def test_building_sets_the_scheme_for_the_layers_inside_and_restores_it():
    outer, inner = QuantSpec("fp8"), QuantSpec("fp8", (128, 128))
    assert building_spec() is None
    with building(outer):
        assert building_spec() is outer
        with building(inner):
            assert building_spec() is inner
        assert building_spec() is outer
    assert building_spec() is None
    with pytest.raises(RuntimeError), building(outer):
        raise RuntimeError("a layer failed to build")
    assert building_spec() is None  # restored on the way out of an error too
