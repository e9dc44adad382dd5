"""Hugging Face Hub ids (org/name), offline: a cache in the hub layout, filled by the test."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
from helpers import make_hf_checkpoint

from ostinato import LLM, SamplingParams

REVISION = "0123456789abcdef0123456789abcdef01234567"


def fill_cache(home, repo: str, source, revision: str = REVISION, ref: str = "main"):
    """models--org--name/snapshots/<rev>/... and refs/<ref>, as huggingface_hub writes them."""
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    shutil.copytree(source, root / "snapshots" / revision)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(revision)


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    home = tmp_path / "hf"
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    return home


def test_a_hub_id_loads_from_the_cache_like_its_directory(tmp_path, offline_hub):
    source = make_hf_checkpoint("qwen3", tmp_path / "src")
    fill_cache(offline_hub, "org/tiny-qwen", source)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = {"device": "cpu", "dtype": "float32"}
    want = LLM(str(source), **kw).generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids
    llm = LLM("org/tiny-qwen", **kw)
    assert str(offline_hub) in llm.engine.config.model
    assert llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].token_ids == want
    fill_cache(offline_hub, "org/tiny-qwen", source, "f" * 40, ref="v2")
    assert "f" * 40 in LLM("org/tiny-qwen", revision="v2", **kw).engine.config.model


def test_missing_or_weightless_hub_models_are_one_clear_error(tmp_path, offline_hub):
    with pytest.raises(
        ValueError,
        match="cannot get .org/absent. from the Hugging Face Hub.*HF_HUB_OFFLINE=1.*local dir",
    ):
        LLM("org/absent", device="cpu")
    source = make_hf_checkpoint("qwen3", tmp_path / "src")
    (source / "model.safetensors").unlink()
    fill_cache(offline_hub, "org/no-weights", source)
    with pytest.raises(
        ValueError, match="'org/no-weights' on the Hugging Face Hub has no \\*.safetensors"
    ):
        LLM("org/no-weights", device="cpu")


def test_the_cli_names_the_id_and_the_fix(tmp_path):
    env = {"HF_HOME": str(tmp_path / "empty"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    command = [sys.executable, "-m", "ostinato.cli", "generate", "--model", "org/absent", "hi"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert (
        lines[-1].startswith("ostinato: error: cannot get 'org/absent'")
        and "HF_HUB_OFFLINE=1" in lines[-1]
    )
