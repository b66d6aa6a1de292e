"""An FP8 checkpoint for SGLang to start from: an HF model folder in the block format of ``pipeline.quant.fp8``.

SGLang 0.5.23 serves block FP8 only from a checkpoint that says so: config.json's ``quantization_config`` with
``weight_block_size`` selects its ``Fp8Config`` with block quantization, whose layers hold each projection's weight as
float8_e4m3fn beside a float32 ``weight_scale_inv`` per 128 x 128 block. That is the layout the FP8 push carries
(``quantize_named``), so a server started from this checkpoint takes every push in place. Starting a server on the
BF16 folder with ``--quantization fp8`` instead quantizes online, per tensor, with no ``weight_scale_inv`` parameters,
and the pushed scales would have nowhere to go.

``python -m pipeline.quant.checkpoint SRC DST`` writes one for a server sluice does not launch; managed engines get one
in the run folder (``ensure_fp8_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError
from pipeline.quant.blocks import BLOCK, QUANTIZATION_CONFIG, is_fp8_weight

MARKER = "sluice-fp8.json"
"""Written last: which source the checkpoint was made from (a checkpoint without it is unfinished)."""

_INDEX = "model.safetensors.index.json"


def _weight_files(src: Path) -> list[Path]:
    index = src / _INDEX
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [src / f for f in files]
    single = src / "model.safetensors"
    if single.is_file():
        return [single]
    raise ConfigError(f"{src} has no model.safetensors or {_INDEX}; an FP8 checkpoint is written from safetensors")


def _source_stamp(src: Path) -> dict[str, Any]:
    """What identifies the source without reading it: its files' sizes and modification times."""
    files = [src / "config.json", *_weight_files(src)]
    return {"source": str(src.resolve()),
            "files": {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in files},
            "quantization_config": QUANTIZATION_CONFIG}


def sglang_parallel(args: list[str]) -> tuple[int, int]:
    """``(tp, ep)`` of an SGLang command line (``--tp``/``--tp-size``, ``--ep``/``--ep-size``; 1 when absent)."""
    found = {"tp": 1, "ep": 1}
    for i, arg in enumerate(args):
        key, _, value = arg.partition("=")
        kind = {"--tp": "tp", "--tp-size": "tp", "--ep": "ep", "--ep-size": "ep"}.get(key)
        if kind is None:
            continue
        value = value or (args[i + 1] if i + 1 < len(args) else "")
        if value.isdigit() and int(value) > 0:
            found[kind] = int(value)
    return found["tp"], found["ep"]


def fp8_shape_problems(config: dict[str, Any], tp: int = 1, ep: int = 1) -> list[str]:
    """Why SGLang's block-FP8 layers could not hold this model on ``tp`` ranks: every projection's output partition
    (each of q, k and v, gate and up, per rank) and every row-parallel input partition must be whole 128-wide blocks,
    as ``Fp8LinearMethod.create_weights`` and ``Fp8MoEMethod.create_weights`` require. Experts split by tensor
    parallelism only where ``ep`` does not place them whole (SGLang's MoE TP size is ``tp / ep``)."""
    hidden = config.get("hidden_size")
    heads = config.get("num_attention_heads")
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or (hidden // heads if hidden and heads else None)
    moe_tp = max(tp // max(ep, 1), 1)
    sizes: dict[str, tuple[int | None, int]] = {"hidden_size": (hidden, 1)}
    if not config.get("kv_lora_rank"):  # MLA projections have sizes of their own, which its FP8 releases fit
        sizes["num_attention_heads * head_dim"] = (heads * head_dim if heads and head_dim else None, tp)
        # A KV head is replicated, not split, once tp exceeds the KV heads.
        sizes["num_key_value_heads * head_dim"] = (kv_heads * head_dim if kv_heads and head_dim else None,
                                                   min(tp, kv_heads or 1))
    sizes["intermediate_size"] = (config.get("intermediate_size"), tp)
    sizes["moe_intermediate_size"] = (config.get("moe_intermediate_size"), moe_tp)
    problems = []
    for name, (size, parts) in sizes.items():
        if not isinstance(size, int) or not size:
            continue
        if size % parts or (size // parts) % BLOCK:
            where = f" / {parts} ranks = {size / parts:g}" if parts > 1 else ""
            problems.append(f"{name} = {size}{where} is not a multiple of {BLOCK}")
    return problems


def write_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """Write ``src``'s weights to ``dst`` as an FP8 checkpoint (projections FP8 with block scales, every other tensor
    as it was), with its config.json and tokenizer files; returns ``dst``. Shard by shard: one source shard in
    memory at a time."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from pipeline.quant.fp8 import quantize_named

    src = Path(src)
    dst = Path(dst)
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        raise ConfigError(f"{src} is already quantized ({config['quantization_config'].get('quant_method')}); "
                          "an FP8 checkpoint is written from an unquantized (BF16 or fp32) model folder")
    problems = fp8_shape_problems(config)
    if problems:
        raise ConfigError(f"SGLang cannot serve {src} in block FP8: " + "; ".join(problems))
    dst.mkdir(parents=True, exist_ok=True)
    (dst / MARKER).unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    quantized = 0
    for file in _weight_files(src):
        with safe_open(str(file), framework="pt") as f:
            named = ((name, f.get_tensor(name)) for name in f.keys())
            tensors = {name: t.contiguous() for name, t in quantize_named(named)}
        for name, tensor in tensors.items():
            weight_map[name] = file.name
            quantized += is_fp8_weight(name) and tensor.dtype == torch.float8_e4m3fn
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
    if not quantized:
        raise ConfigError(f"{src} has no projection weights to store in FP8 (q_proj, gate_proj, ...)")
    if (src / _INDEX).is_file():
        (dst / _INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    config["quantization_config"] = dict(QUANTIZATION_CONFIG)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for other in src.iterdir():
        if other.is_file() and other.name != "config.json" and other.name != _INDEX \
                and not other.name.endswith(".safetensors"):
            shutil.copy2(other, dst / other.name)
    (dst / MARKER).write_text(json.dumps(_source_stamp(src), indent=2))
    return dst


def ensure_fp8_checkpoint(src: Path, dst: Path) -> Path:
    """``dst`` as an FP8 checkpoint of ``src``: reused when it was written from the same source files, else
    (re)written."""
    marker = Path(dst) / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == _source_stamp(Path(src)):
                return Path(dst)
        except (OSError, ValueError):
            pass
    return write_fp8_checkpoint(src, dst)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline.quant.checkpoint",
                                     description="Write an HF model folder as a block-FP8 checkpoint for SGLang "
                                                 "(engine.weight_dtype = 'fp8' with a server sluice does not launch).")
    parser.add_argument("src", type=Path, help="the model folder (BF16 or fp32 safetensors)")
    parser.add_argument("dst", type=Path, help="where to write the FP8 checkpoint")
    args = parser.parse_args(argv)
    try:
        out = write_fp8_checkpoint(args.src, args.dst)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
