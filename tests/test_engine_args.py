"""The engine flags every command shares (ostinato/engine_args.py), parsed without running an
engine: each flag reaches its EngineConfig field, each has help naming its default, and a bad
list or mode is refused with a message naming what it takes."""

from __future__ import annotations

import argparse

import pytest

from ostinato.config import EngineConfig
from ostinato.engine_args import (
    ENGINE_FLAGS,
    ENGINE_SWITCHES,
    add_engine_args,
    async_scheduling,
    engine_config,
    int_list,
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ostinato")
    add_engine_args(parser)
    return parser.parse_args(["--device", "cpu", *argv])


def test_switches_and_lists_reach_the_config():
    args = parse("--enforce-eager", "--no-prefix-caching", "--debug-graph-addresses",
                 "--enable-lora", "--capture-sizes", "1,2,,4", "--pipeline-parallel-size", "2",
                 "--pp-layer-partition", "3,1", "--async-scheduling", "off")  # fmt: skip
    config = engine_config(args)
    assert config.enforce_eager and config.debug_graph_addresses and config.enable_lora
    assert not config.enable_prefix_caching
    assert config.capture_sizes == [1, 2, 4] and config.pp_layer_partition == [3, 1]
    assert config.async_scheduling is False


def test_no_flags_give_the_configs_defaults():
    config, default = engine_config(parse()), EngineConfig(device="cpu")
    fields = ["enforce_eager", "enable_prefix_caching", "debug_graph_addresses", "enable_lora",
              "capture_sizes", "pp_layer_partition", "async_scheduling"]  # fmt: skip
    assert {f: getattr(config, f) for f in fields} == {f: getattr(default, f) for f in fields}


def test_an_override_wins_over_the_flag():
    """bench passes each value of its --async-scheduling list as an override."""
    args = parse("--async-scheduling", "off", "--max-num-seqs", "8")
    config = engine_config(args, async_scheduling=True, max_num_seqs=4)
    assert config.async_scheduling is True and config.max_num_seqs == 4


@pytest.mark.parametrize(("text", "value"), [("auto", None), ("on", True), ("off", False)])
def test_async_scheduling_modes(text, value):
    assert async_scheduling(text) is value
    resolved = EngineConfig(device="cpu", async_scheduling=value).async_scheduling  # auto: off
    assert engine_config(parse("--async-scheduling", text)).async_scheduling is resolved


def test_an_unknown_async_scheduling_mode_is_named():
    with pytest.raises(ValueError, match=r"^--async-scheduling takes 'auto', 'on' or 'off', got "
                                         r"'yes'$"):  # fmt: skip
        async_scheduling("yes")


def test_a_bad_integer_list_is_refused_by_the_parser(capsys):
    assert int_list("8,16,,32") == [8, 16, 32]
    with pytest.raises(argparse.ArgumentTypeError, match="^expected comma-separated integers, "
                                                         "got '8;16'$"):  # fmt: skip
        int_list("8;16")
    with pytest.raises(SystemExit):
        parse("--capture-sizes", "8,x")
    err = capsys.readouterr().err
    assert "--capture-sizes: expected comma-separated integers, got '8,x'" in err


def test_every_flag_is_documented_in_the_engine_group():
    parser = argparse.ArgumentParser(prog="ostinato")
    add_engine_args(parser)
    (group,) = [g for g in parser._action_groups if g.title == "engine"]
    helps = {a.option_strings[0]: a.help for a in group._group_actions}
    defaults = EngineConfig.__dataclass_fields__
    for flag, _, text in ENGINE_FLAGS:
        default = defaults[flag[2:].replace("-", "_")].default
        assert helps[flag] == f"{text} (default {default})"
    for flag, text in ENGINE_SWITCHES:
        assert helps[flag] == text
    assert helps["--capture-sizes"] == "comma-separated graph sizes"
    assert helps["--async-scheduling"].endswith("'on' or 'off' (default auto)")
    assert "(default: an even split)" in helps["--pp-layer-partition"]
    assert "engine:" in parser.format_help()
