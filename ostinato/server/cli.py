"""`ostinato serve`: the uvicorn runner (imported only by the serve command)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from ostinato.config import EngineConfig

if TYPE_CHECKING:
    from ostinato.engine.async_engine import AsyncEngine


def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGINT/SIGTERM, and return the exit status."""
    # Imported here: every ostinato command builds this parser, only serve needs the app.
    from ostinato.engine.engine import LLMEngine
    from ostinato.lora.request import LoRARequest
    from ostinato.server.app import build_app

    if args.max_waiting_requests is not None:
        config = dataclasses.replace(config, max_waiting_requests=args.max_waiting_requests)
    if args.lora_modules:
        config = dataclasses.replace(config, enable_lora=True)
    adapters = [LoRARequest(name, path) for name, path in args.lora_modules]
    engine = LLMEngine(config)
    try:
        names = args.served_model_name or [config.model]
        app = build_app(engine, names, adapters, args.tool_call_parser)
    except ValueError:  # a bad --lora-modules entry: stop the workers, if any, before exiting
        engine.shutdown()
        raise
    uv_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.uvicorn_log_level
    )
    _Server(uv_config, app.state.async_engine).run()
    return 0


class _Server(uvicorn.Server):
    """Aborts every request as shutdown begins, and exits 0 on SIGINT/SIGTERM."""

    def __init__(self, config: uvicorn.Config, engine: AsyncEngine) -> None:
        super().__init__(config)
        self.engine = engine

    async def shutdown(self, sockets: list | None = None) -> None:
        # Streams end at once with an abort, so uvicorn's wait for open connections is short.
        self.engine.begin_shutdown()
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's own version re-raises the signal after shutdown: the exit status would not be 0.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
