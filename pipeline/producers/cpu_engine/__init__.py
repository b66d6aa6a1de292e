"""sluice's CPU rollout engine: a real HF transformers model behind the subset of SGLang 0.5.23's HTTP protocol that
sluice uses (``/generate`` with logprobs, routed experts and weight-version spans, and the weight-update endpoints).

SGLang cannot start on CPU-only machines, so CPU recipes and tests run this engine instead; one client talks to both.
Start it with ``python -m pipeline.producers.cpu_engine MODEL_DIR --host 127.0.0.1 --port P`` or ``serve(...)``.
The heavy modules (torch, transformers, aiohttp) are imported only when the engine starts.
"""

from __future__ import annotations

from typing import Any

from pipeline.producers.cpu_engine.config import CpuEngineConfig

__all__ = ["CpuEngineConfig", "serve"]


def serve(model_dir: str, host: str = "127.0.0.1", port: int = 30000, **opts: Any) -> None:
    """Load the model in ``model_dir`` and serve it on ``host:port`` until interrupted; ``opts`` are
    ``CpuEngineConfig`` fields (``dtype``, ``max_batch``, ``enable_return_routed_experts``, ...)."""
    from pipeline.producers.cpu_engine.server import run_server

    run_server(CpuEngineConfig(model_path=str(model_dir), host=host, port=port, **opts))
