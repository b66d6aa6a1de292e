"""``python -m pipeline.producers.cpu_engine MODEL_DIR --host H --port P [...]``: run the CPU engine."""

from __future__ import annotations

import argparse

from pipeline.producers.cpu_engine.config import CpuEngineConfig


def parse_args(argv: list[str] | None = None) -> CpuEngineConfig:
    """Command line to ``CpuEngineConfig`` (flags mirror SGLang's where SGLang has one)."""
    parser = argparse.ArgumentParser(prog="python -m pipeline.producers.cpu_engine", description=__doc__)
    parser.add_argument("model_path", nargs="?", help="folder with an HF causal LM and its tokenizer")
    # SGLang's spelling, so that the CPU engine runs under SGLang's launch command (engine.launch_module).
    parser.add_argument("--model-path", dest="model_path_flag", default=None, help="the same as MODEL_PATH")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000, help="0: the OS picks a free port (see --port-file)")
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening is possible")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--enable-return-routed-experts", action="store_true")
    parser.add_argument("--logprob-mode", choices=["temperature", "original"], default="temperature")
    parser.add_argument("--attn-implementation", choices=["sdpa", "eager"], default="sdpa")
    parser.add_argument("--max-context-len", type=int, default=None)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--tp", type=int, default=1,
                        help="ranks this engine holds in the weight group (SGLang's TP size); rank 0 applies")
    parser.add_argument("--weight-version", dest="initial_weight_version", default="0")
    parser.add_argument("--hold-until-update", action="store_true",
                        help="serve no generation until the first complete weight update")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="keep no prefix cache (every prompt is computed whole)")
    parser.add_argument("--prefix-cache-mb", type=float, default=256.0,
                        help="memory the prefix cache may hold; least recently used prompts are dropped beyond it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--patch", default=None,
                        help="package.module:function that adds user modules to the model (model.engine_patch)")
    parser.add_argument("--plugin-path", dest="plugin_paths", action="append", default=[],
                        help="folder --patch is imported from (repeatable)")
    parser.add_argument("--lora", choices=["merge", "adapter"], default="merge",
                        help="serve pushed LoRA adapters merged into the weights, or beside the base")
    parser.add_argument("--weight-dtype", choices=["auto", "fp8"], default="auto",
                        help="fp8: projection weights in FP8 with 128x128 block scales, activations per token group")
    parser.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info")
    args = vars(parser.parse_args(argv))
    flag = args.pop("model_path_flag")
    if (args["model_path"] is None) == (flag is None):
        parser.error("give the model folder once: MODEL_PATH or --model-path")
    args["model_path"] = args["model_path"] or flag
    return CpuEngineConfig(**args)


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and serve."""
    cfg = parse_args(argv)  # before the heavy imports, so that --help and bad flags answer at once
    from pipeline.producers.cpu_engine.server import run_server

    run_server(cfg)


if __name__ == "__main__":
    main()
