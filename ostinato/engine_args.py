"""The engine flags every command shares (generate, explain, bench, serve) and the
EngineConfig they build; cli.py and bench.py both use them."""

from __future__ import annotations

import argparse

from ostinato.config import CUDA_GRAPH_CAPTURES, CUDA_GRAPH_MODES, DTYPES, EngineConfig

# Engine flags shared by every command: (flag, type, help). Defaults come from EngineConfig.
ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "'tiny', 'random:<preset>' or a local Hugging Face directory"),
    ("--dtype", str, f"'auto' (bfloat16 on CUDA, float32 on CPU) or one of {sorted(DTYPES)}"),
    ("--device", str, "'auto' (CUDA when present), 'cuda', 'cuda:N' or 'cpu'"),
    ("--seed", int, "seed for random weights and unseeded sampling"),
    ("--max-num-seqs", int, "most requests in one step"),
    ("--max-num-batched-tokens", int, "most tokens in one step (prefill chunks + decodes)"),
    ("--revision", str, "Hub revision (branch, tag or commit) of a Hub model id"),
    ("--max-model-len", int, "longest prompt + output; None: the model's context, at most 4096"),
    ("--gpu-memory-utilization", float, "fraction of GPU memory the engine may take"),
    ("--kv-cache-memory", int, "bytes of KV cache on CPU"),
    ("--num-kv-blocks", int, "fix the number of KV blocks (overrides memory sizing)"),
    ("--attention-backend", str, "'auto' (triton on CUDA, torch on CPU), 'triton' or 'torch'"),
    ("--cuda-graph-mode", str, f"one of {CUDA_GRAPH_MODES}"),
    ("--cuda-graph-capture", str, f"one of {CUDA_GRAPH_CAPTURES}: at start-up, or on first use"),
    ("--max-capture-size", int, "largest token-keyed graph; None: max-num-batched-tokens"),
    ("--full-prefill-min-tokens", int, "smallest step (tokens) of a FULL prefill graph"),
    ("--full-prefill-max-tokens", int, "largest FULL prefill graph in tokens (0: none)"),
    ("--check-graphs", int, "re-run every N-th graphed step eagerly and compare (0: off)"),
    ("--pipeline-parallel-size", int, "pipeline stages, one process (GPU) each"),
    ("--tensor-parallel-size", int, "processes (GPUs) splitting each stage's layers"),
    ("--distributed-timeout", float, "seconds one collective may take before it fails"),
    ("--speculative-method", str, "'ngram' (draft by prompt lookup); unset: no speculation"),
    ("--num-speculative-tokens", int, "draft tokens verified per request and step (k)"),
    ("--ngram-min", int, "shortest suffix the n-gram proposer matches"),
    ("--ngram-max", int, "longest suffix the n-gram proposer tries first"),
    ("--max-loras", int, "LoRA adapters one step may use (the adapter slots)"),
    ("--max-lora-rank", int, "largest LoRA rank an adapter may have"),
    ("--quantization", str, "'fp8': FP8 weights quantised at load (FP8 checkpoints need none)"),
]
ENGINE_SWITCHES: list[tuple[str, str]] = [
    ("--enforce-eager", "never use CUDA graphs"),
    ("--no-prefix-caching", "turn the prefix cache off"),
    ("--debug-graph-addresses", "check at every replay that input addresses are the captured ones"),
    ("--enable-lora", "serve LoRA adapters beside the base model"),
]


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    defaults = EngineConfig.__dataclass_fields__
    group = parser.add_argument_group("engine")
    for flag, kind, help_text in ENGINE_FLAGS:
        default = defaults[flag[2:].replace("-", "_")].default
        group.add_argument(
            flag, type=kind, default=default, help=f"{help_text} (default {default})"
        )
    for flag, help_text in ENGINE_SWITCHES:
        group.add_argument(flag, action="store_true", help=help_text)
    group.add_argument(
        "--capture-sizes", type=int_list, default=None, help="comma-separated graph sizes"
    )
    group.add_argument(
        "--async-scheduling",
        default="auto",
        help="schedule and launch the next step while the device runs this one: 'auto' (on "
        "for one CUDA process), 'on' or 'off' (default auto)",
    )
    group.add_argument(
        "--pp-layer-partition",
        type=int_list,
        default=None,
        help="layers per pipeline stage, comma-separated (default: an even split)",
    )


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    fields = {flag[2:].replace("-", "_") for flag, _, _ in ENGINE_FLAGS}
    kwargs = {name: getattr(args, name) for name in fields}
    kwargs.update(
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        debug_graph_addresses=args.debug_graph_addresses,
        enable_lora=args.enable_lora,
        capture_sizes=args.capture_sizes,
        pp_layer_partition=args.pp_layer_partition,
    )
    kwargs.update(overrides)
    if "async_scheduling" not in overrides:  # bench passes each value of its list
        kwargs["async_scheduling"] = async_scheduling(args.async_scheduling)
    return EngineConfig(**kwargs)


def async_scheduling(text: str) -> bool | None:
    """--async-scheduling auto|on|off as EngineConfig.async_scheduling."""
    choices = {"auto": None, "on": True, "off": False}
    if text not in choices:
        raise ValueError(f"--async-scheduling takes 'auto', 'on' or 'off', got {text!r}")
    return choices[text]
