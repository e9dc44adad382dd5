"""What the graph runtime would do with a configuration, without weights or a GPU."""

from __future__ import annotations

from dataclasses import asdict

from ostinato.config import EngineConfig
from ostinato.graphs.compat import resolve
from ostinato.graphs.dispatcher import Dispatcher
from ostinato.graphs.plan import CapturePlan


def explain(config: EngineConfig) -> dict:
    """The resolved mode, every rule that fired, the sizes that would be captured, and the
    config. Queries no device, so `device='cuda'` can be checked on a machine without one."""
    plan = CapturePlan.from_config(config)
    resolution = resolve(config, plan)
    return {
        **resolution.as_dict(),
        "capture_sizes": Dispatcher(resolution.resolved, plan).capture_sizes(),
        "config": asdict(config),
    }
