"""`ostinato serve`: the uvicorn runner (imported only by the serve command)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import signal
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn

from ostinato.config import EngineConfig

if TYPE_CHECKING:
    from ostinato.engine.core_client import EngineCoreClient

DEAD_GRACE_SECONDS = 3.0  # after the engine process died: 503s with the reason, then exit 1


def serve(config: EngineConfig, args: argparse.Namespace) -> int:
    """Start the engine-core process, serve until SIGINT/SIGTERM (0) or until the engine
    process dies (1), and return the exit status."""
    # Imported here: every ostinato command builds this parser, only serve needs the app.
    from ostinato.engine.core_client import EngineCoreClient
    from ostinato.lora.request import LoRARequest
    from ostinato.server.app import build_app

    if args.max_waiting_requests is not None:
        config = dataclasses.replace(config, max_waiting_requests=args.max_waiting_requests)
    if args.lora_modules:
        config = dataclasses.replace(config, enable_lora=True)
    adapters = [LoRARequest(name, path) for name, path in args.lora_modules]
    engine = EngineCoreClient(config, adapters)
    try:
        names = args.served_model_name or [config.model]
        app = build_app(engine, names, adapters, args.tool_call_parser)
        uv_config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.uvicorn_log_level
        )
        server = _Server(uv_config, engine)
        server.run()
    finally:  # the lifespan stops the engine; this covers a server that never started
        engine.close()
    return server.exit_code


class _Server(uvicorn.Server):
    """Aborts every request as shutdown begins, and exits 0 on SIGINT/SIGTERM; when the engine
    process dies, answers 503 for DEAD_GRACE_SECONDS (so clients read why) and exits 1."""

    def __init__(self, config: uvicorn.Config, engine: EngineCoreClient) -> None:
        super().__init__(config)
        self.engine = engine
        self.exit_code = 0
        engine.on_dead = self._engine_died

    def _engine_died(self, reason: str) -> None:
        self.exit_code = 1
        asyncio.get_running_loop().call_later(DEAD_GRACE_SECONDS, self._exit)

    def _exit(self) -> None:
        self.should_exit = True

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
