"""ostinato generate | bench | serve | explain."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ostinato.engine_args import add_engine_args, engine_config
from ostinato.server.args import lora_module


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

    add_bench_parser(sub)
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
