"""sluice's CPU rollout engine: a real HF transformers model behind the subset of SGLang 0.5.23's HTTP protocol that
sluice uses (``/generate`` with logprobs, routed experts and weight-version spans, and the weight-update endpoints).

SGLang cannot start on CPU-only machines, so CPU recipes and tests run this engine instead; one client talks to both.
Where a client can tell, it behaves as SGLang 0.5.23 does:

- **Pause and model-update lock** (``update_lock.py``): every ``/generate`` holds a writer-preferring lock as a reader
  for its life, and waits while generation is paused before taking it. ``/begin_weight_update``,
  ``/update_weights_from_distributed``, ``/end_weight_update`` and ``/update_weights_from_disk`` run without the
  lock while paused, else take it as a writer, waiting for every generation in flight: a begin sent before an
  in-place pause waits for ever, as it does against SGLang.
- **Prefix cache** (``prefix_cache.py``), on unless ``--disable-radix-cache``: prompts are cached with their KV and
  routing in ``(cache_salt, extra_key)`` namespaces, a hit reuses KV computed under whatever weights were loaded
  then, and ``meta_info.cached_tokens`` counts the positions reused. ``/flush_cache`` empties it only on a fully
  idle engine (else a 400), and so does a weight update's ``flush_cache``.
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
