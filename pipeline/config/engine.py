"""``[engine]``: the rollout engines (sluice's CPU engines, or SGLang servers given or started)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pipeline.config.base import Strict


class EngineConfig(Strict):
    """Rollout engines."""

    type: Literal["cpu", "sglang"] = "cpu"
    """cpu: sluice starts its CPU engines; sglang: SGLang servers, at urls or started by sluice (launch)."""
    count: int = Field(1, ge=1, le=1024)
    """Engines to start (CPU engines, or SGLang servers with launch = true)."""
    urls: list[str] = []
    """Base URLs of running SGLang servers (type = sglang, launch = false)."""
    launch: bool = False
    """type = sglang: sluice starts `count` SGLang servers itself, each a supervised Ray process with
    ray.engine's resources (GPUs), serving the run's model folder (the warm start's output when there is one)."""
    launch_module: str = Field("sglang.launch_server", pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")
    """The server's Python module, run as `python -m MODULE --host H --port P --model-path M --weight-version 0
    [--enable-return-routed-experts] LAUNCH_ARGS`; any server with SGLang's command line and protocol may stand in."""
    launch_args: list[str] = []
    """Further server flags, e.g. ["--tp-size", "8", "--mem-fraction-static", "0.7"]."""
    python: str | None = None
    """launch = true: the interpreter that runs the server (`PYTHON -m launch_module ...`): a path, or a command on the
    engine node's PATH, e.g. the python of the virtual environment SGLang is installed in (SGLang pins its own torch
    and kernels, so it usually lives apart from sluice). None: sluice's own interpreter."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """Dtype of the CPU engine (bfloat16 reproduces the rollout/train mismatch R3 removes)."""
    weight_dtype: Literal["auto", "fp8"] = "auto"
    """"fp8": the engines store the projection weights in FP8 (float8_e4m3fn, 128 x 128 block scales) and quantize
    their inputs per token group of 128, as FP8 inference does; the trainer quantizes each push on the way out, so it
    carries about half a BF16 push's bytes (``pipeline.quant.fp8``). Embeddings, norms, the router and the LM head
    keep ``dtype``. The CPU engine needs dtype float32 for it. SGLang engines serve an FP8 checkpoint of the model
    (``pipeline.quant.checkpoint``: managed ones get it in the run folder), with SGLang's own FP8 kernels."""
    max_batch: int = Field(32, ge=1, le=4096)
    """Sequences one CPU engine decodes together."""
    startup_timeout_s: float = Field(120.0, gt=0)
    """How long to wait for an engine's /health."""
