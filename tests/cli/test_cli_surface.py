"""The CLI surface is deliberate: a new feature adds a recipe field, not a flag. This snapshot fails when a command or
flag appears or disappears, so that the change is a decision (update the snapshot in the same commit)."""

from __future__ import annotations

import argparse

from pipeline.cli import build_parser

SURFACE = {
    "bench queue": ([], ["--appendfsync", "--batch-entries", "--e2e", "--engine-layers", "--engine-prompt-tokens",
                         "--engine-response-tokens", "--engine-samples", "--group-size", "--json", "--layers",
                         "--num-experts", "--out", "--prompt-tokens", "--redis-url", "--response-tokens", "--rounds",
                         "--routing", "--samples", "--topk"]),
    "bench data-plane": ([], ["--appendfsync", "--batch-groups", "--e2e-samples", "--eval-repeats", "--group-size",
                              "--json", "--layers", "--masters", "--num-experts", "--out", "--prompt-tokens",
                              "--readers", "--response-tokens", "--rounds", "--samples", "--topk"]),
    "bench faults": ([], ["--archive-processes", "--baseline", "--checkpoint-every", "--json", "--kinds",
                          "--no-baseline", "--out", "--recipe", "--redis", "--resumes", "--seed", "--steps",
                          "--timeout-s", "--trials"]),
    # Trials that take several sessions are folded into one record.
    "bench faults-merge": (["runs"], ["--into"]),
    "bench cluster-faults": ([], ["--batch-groups", "--capacity", "--commit-every", "--folder", "--group-size",
                                  "--groups", "--json", "--keep", "--kind", "--max-lag", "--no-keep", "--out",
                                  "--response-tokens", "--seed", "--stall-s", "--timeout-s", "--trials",
                                  "--trim-every-s"]),
    "bench pipeline": ([], ["--json", "--max-lag", "--out", "--recipe", "--skip-steps", "--steps"]),
    "bench rollout": ([], ["--capture-reference", "--concurrency", "--group-size", "--groups", "--json", "--layers",
                           "--max-new-tokens", "--no-capture-reference", "--num-experts", "--rounds", "--temperature",
                           "--topk"]),
    "bench sync": ([], ["--big", "--bucket-mb", "--engine-dtype", "--json", "--min-seconds", "--no-big", "--out",
                        "--rounds", "--sizes-mb"]),
    "bench sync-sources": ([], ["--bucket-mb", "--engines", "--json", "--kill-trials", "--out", "--rounds",
                                "--size-mb", "--sources"]),
    "bench export-bytes": ([], ["--ep", "--json", "--out"]),
    "bench lora": ([], ["--full-lr", "--groups", "--json", "--out", "--rank", "--recipe", "--rounds"]),
    "bench archive": ([], ["--group-size", "--groups", "--json", "--layers", "--num-experts", "--out", "--processes",
                           "--prompt-tokens", "--redis-url", "--response-tokens", "--rounds", "--segment-samples",
                           "--templates", "--timeout-s", "--topk"]),
    "bench gpu": ([], ["--device", "--json", "--no-resume", "--out", "--parts", "--resume", "--steps"]),
    "engine serve": (["model_dir", "engine_args"], []),
    "eval": ([], ["--checkpoints", "--group", "--heldout", "--json", "--redis", "--reset", "--run", "--run-dir", "--start",
                  "--until-idle"]),
    "export": ([], ["--adapter", "--json", "--run-dir", "--step", "--to"]),  # HF export of a run's checkpoint
    "model init-tiny": ([], ["--arch", "--out", "--seed", "--set"]),
    "plot": ([], ["--json", "--run-dir"]),  # PNG plots of any run
    "status": ([], ["--json", "--redis", "--run-dir", "--watch"]),  # the live view of any run
    "queue audit": ([], ["--json", "--redis", "--run", "--run-dir", "--samples"]),
    "queue export": ([], ["--json", "--range", "--redis", "--run", "--run-dir", "--to"]),
    "queue stats": ([], ["--json", "--redis", "--run", "--run-dir"]),
    "queue tail": ([], ["--count", "--follow", "--json", "--redis", "--run", "--run-dir"]),
    "replay": (["recipe"], ["--from", "--json", "--range", "--run-dir", "--set", "--steps"]),
    "run": (["recipe"], ["--dry-run", "--ray-address", "--run-dir", "--set", "--steps"]),
    "sft": (["recipe"], ["--run-dir", "--set"]),
}


def _leaves(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, tuple[list[str], list[str]]]:
    out: dict[str, tuple[list[str], list[str]]] = {}
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    for action in subs:
        for name, child in action.choices.items():
            out.update(_leaves(child, f"{prefix} {name}".strip()))
    if not subs and prefix:
        positional = [a.dest for a in parser._actions if not a.option_strings]
        flags = sorted(o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help")
        out[prefix] = (positional, flags)
    return out


def test_cli_surface_matches_the_snapshot() -> None:
    assert _leaves(build_parser()) == SURFACE
