"""OpenAI-compatible HTTP server: `ostinato serve`."""

from ostinato.server.cli import add_serve_arguments, serve

__all__ = ["add_serve_arguments", "serve"]
