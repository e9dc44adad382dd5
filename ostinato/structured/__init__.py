"""Structured outputs: grammars (llguidance) that constrain what a request may generate."""
