"""The serve command's own flags; light to import, since every ostinato command builds them."""

from __future__ import annotations

import argparse


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's own flags; engine flags (--model, ...) come from the caller's parser."""
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1", help="address to listen on")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="names clients may give as `model` (default: the --model value)",
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        type=lora_module,
        default=[],
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT directories) clients pick by giving NAME as `model`; "
        "checked at start, and they turn on --enable-lora",
    )
    group.add_argument(
        "--max-waiting-requests",
        type=int,
        default=None,
        help="answer 503 with Retry-After when more requests than this wait "
        "(default: the engine config's max_waiting_requests)",
    )
    group.add_argument(
        "--tool-call-parser",
        choices=["hermes", "llama3_json"],
        default=None,
        help="the format of the model's tool calls, parsed into tool_calls: hermes "
        "(<tool_call> JSON: Qwen2.5, Qwen3, Hermes) or llama3_json (Llama 3.1/3.2); "
        "without it, requests with tools are refused",
    )
    group.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )


def lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH for a LoRA adapter, got {text!r}")
    return name, path
