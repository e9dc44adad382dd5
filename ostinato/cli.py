"""ostinato generate | bench | serve | explain."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ostinato.config import CUDA_GRAPH_CAPTURES, CUDA_GRAPH_MODES, DTYPES, EngineConfig
from ostinato.server.args import lora_module

# Engine flags shared by every command: (flag, type, help). Defaults come from EngineConfig.
ENGINE_FLAGS: list[tuple[str, type, str]] = [
    ("--model", str, "'tiny', 'random:<preset>' or a local Hugging Face directory"),
    ("--dtype", str, f"'auto' (bfloat16 on CUDA, float32 on CPU) or one of {sorted(DTYPES)}"),
    ("--device", str, "'auto' (CUDA when present), 'cuda', 'cuda:N' or 'cpu'"),
    ("--seed", int, "seed for random weights and unseeded sampling"),
    ("--max-num-seqs", int, "most requests in one step"),
    ("--max-num-batched-tokens", int, "most tokens in one step (prefill chunks + decodes)"),
    ("--max-model-len", int, "longest prompt + output; None: the model's context, at most 4096"),
    ("--gpu-memory-utilization", float, "fraction of GPU memory the engine may take"),
    ("--kv-cache-memory", int, "bytes of KV cache on CPU"),
    ("--num-kv-blocks", int, "fix the number of KV blocks (overrides memory sizing)"),
    ("--attention-backend", str, "'auto' (triton on CUDA, torch on CPU), 'triton' or 'torch'"),
    ("--cuda-graph-mode", str, f"one of {CUDA_GRAPH_MODES}"),
    ("--cuda-graph-capture", str, f"one of {CUDA_GRAPH_CAPTURES}: at start-up, or on first use"),
    ("--max-capture-size", int, "largest PIECEWISE graph, in tokens"),
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
        "--capture-sizes", type=_int_list, default=None, help="comma-separated graph sizes"
    )
    group.add_argument(
        "--async-scheduling",
        default="auto",
        help="schedule and launch the next step while the device runs this one: 'auto' (on "
        "for one CUDA process), 'on' or 'off' (default auto)",
    )
    group.add_argument(
        "--pp-layer-partition",
        type=_int_list,
        default=None,
        help="layers per pipeline stage, comma-separated (default: an even split)",
    )


def _int_list(text: str) -> list[int]:
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


# ---- commands --------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from ostinato import LLM, LoRARequest, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sampling_seed,
        stop=args.stop or [],
        ignore_eos=args.ignore_eos,
    )
    lora = LoRARequest(*args.lora) if args.lora else None
    llm = LLM(config=engine_config(args, **({"enable_lora": True} if lora else {})))
    prompts = args.prompt or ["The capital of France is", "Once upon a time"]
    outs = llm.generate(prompts, params, lora_request=lora)
    for prompt, out in zip(prompts, outs, strict=True):
        print(f"--- {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
        print(prompt + out.text)
    return 0


def cmd_explain(args: argparse.Namespace) -> int:
    from ostinato.graphs.explain import explain
    from ostinato.loader import load_hf_config

    config = engine_config(args)
    hf_config = load_hf_config(config.model)
    report = explain(config.for_model(hf_config), hf_config)
    if args.json:
        print(json.dumps(report))
        return 0
    for key, value in report.items():
        if key == "decisions":
            for d in value:
                print(f"decision {d['rule']}: {d['reason']}")
        elif key == "stages":
            for stage in value:
                print("stage " + ", ".join(f"{k}={v}" for k, v in stage.items() if k != "stage"))
        else:
            print(f"{key}: {value}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from ostinato.server.cli import serve

    return serve(engine_config(args), args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ostinato", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at debug level")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete prompts and print the text")
    gen.add_argument("prompt", nargs="*", help="prompts (two examples when none are given)")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default 1)")
    gen.add_argument("--top-k", type=int, default=-1, help="-1 keeps every token (default -1)")
    gen.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep going past end-of-sequence")
    gen.add_argument(
        "--lora",
        type=lora_module,
        metavar="NAME=PATH",
        help="run every prompt through this LoRA adapter (turns on --enable-lora)",
    )
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    exp = sub.add_parser("explain", help="print the resolved config and graph decisions")
    exp.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(exp)
    exp.set_defaults(func=cmd_explain)

    from ostinato.bench import add_bench_parser
    from ostinato.server.args import add_serve_arguments

    add_bench_parser(sub, add_engine_args)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_serve_arguments(srv)
    add_engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"ostinato: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
