"""Quantised checkpoints: what we cannot run is refused by name, never loaded as garbage."""

import json
import re

import pytest
from helpers import make_hf_checkpoint

from ostinato import LLM
from ostinato.loader import load_hf_config


def with_quantization(path, quantization_config: dict) -> str:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint("qwen3", tmp_path_factory.mktemp("q") / "q")


@pytest.mark.parametrize(
    "quantization_config, message",
    [
        ({"quant_method": "awq", "bits": 4}, "unsupported quantization 'awq'"),
        ({"quant_method": "gptq", "bits": 4}, "unsupported quantization 'gptq'"),
        ({"quant_method": "bitsandbytes", "load_in_4bit": True},
         "unsupported quantization 'bitsandbytes'"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"},
         "unsupported fp8 checkpoint: weight_block_size None"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         "unsupported fp8 activation_scheme 'static'"),
    ],
)  # fmt: skip
def test_a_quantization_we_cannot_run_is_one_line_naming_it(
    checkpoint, tmp_path, quantization_config, message
):
    import shutil

    path = tmp_path / "m"
    shutil.copytree(checkpoint, path)
    model = with_quantization(path, quantization_config)
    for load in (load_hf_config, lambda m: LLM(m, device="cpu")):
        with pytest.raises(ValueError, match=re.escape(message)) as e:
            load(model)
        assert "\n" not in str(e.value) and str(e.value).startswith(model)
