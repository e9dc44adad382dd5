"""OpenAI-compatible HTTP server: `ostinato serve` (ostinato.server.cli needs uvicorn)."""
