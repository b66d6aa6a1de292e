"""The recipe schema is a leaf: ``pipeline.config`` loads, validates and prints every shipped recipe without
importing the trainer's, the producers' or the queue's heavy dependencies, and the constants it keeps in place of the
heavy modules' registries match them.

The import check runs in a fresh interpreter whose import system refuses the heavy packages and records every attempt
(a refusal alone could be swallowed by an ``except ImportError``), so the test fails on the first import of one.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
RECIPES = sorted((ROOT / "recipes").glob("*.toml"))

#: Never imported to load, validate or print a recipe.
HEAVY = ("torch", "megatron", "redis", "aiohttp", "pyarrow", "ray", "transformers")
#: Not imported by the schema either; a recipe's own plug-in modules may import it (sluice's rollout types do).
NUMPY = ("numpy",)

_BLOCKER = """
import importlib.abc, json, sys, traceback
BLOCKED = set(json.loads(sys.argv[1]))
attempts = []

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] in BLOCKED:
            attempts.append(name + " from\\n" + "".join(traceback.format_stack(limit=10)[:-1]))
            raise ImportError(f"{name} is blocked by the test")
        return None

already = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not already, f"loaded at start-up: {already}"
sys.meta_path.insert(0, Refuse())
"""

_LOAD = _BLOCKER + """
from pipeline.config import dump_config, load_config
from pipeline.metrics import check_metrics_config

for recipe in json.loads(sys.argv[2]):
    cfg = load_config(recipe)
    json.loads(dump_config(cfg))  # --dry-run's first part: the resolved config, credentials redacted
    check_metrics_config(cfg.metrics)  # what `sluice run` checks before it starts anything
    if cfg.model.path is None and cfg.hardware.hf_config is not None or cfg.model.path is not None:
        # --dry-run's memory plan from a config.json (the GPU recipes); a tiny model's plan builds its HF config
        # with transformers, so the CPU recipes stop at the resolved config.
        from pipeline.consumers.megatron.plan import dry_run_plan

        dry_run_plan(cfg.trainer, cfg.model, cfg.hardware)
if attempts:
    sys.exit("heavy imports:\\n" + "\\n".join(attempts))
print("ok", sorted(m for m in sys.modules if m.startswith("pipeline")))
"""


def _run(script: str, blocked: tuple[str, ...], *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(blocked), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-6000:] + proc.stdout[-2000:]
    return proc.stdout


def _has_user_modules(recipe: Path) -> bool:
    return bool(tomllib.loads(recipe.read_text()).get("plugins", {}).get("paths"))


def test_the_config_package_imports_only_leaves() -> None:
    out = _run(_BLOCKER + """
import pipeline.config
if attempts:
    sys.exit("heavy imports:\\n" + "\\n".join(attempts))
print(json.dumps(sorted(m for m in sys.modules if m.startswith("pipeline"))))
""", HEAVY + NUMPY)
    loaded = json.loads(out)
    outside = [m for m in loaded if m not in ("pipeline", "pipeline.errors", "pipeline.plugins", "pipeline.net")
               and not m.startswith("pipeline.config")]
    assert not outside, f"pipeline.config imports {outside}"


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_loads_without_a_heavy_import(recipe: Path) -> None:
    # A recipe naming no user module loads without numpy too; one that does (cpu-calc's rollout function) may import
    # what its module imports, but nothing heavy comes from sluice's side of it.
    blocked = HEAVY if _has_user_modules(recipe) else HEAVY + NUMPY
    assert _run(_LOAD, blocked, json.dumps([str(recipe)])).startswith("ok")


# ------------------------------------------------------------------------------- the constants mirror the registries
def test_the_builtin_reward_names_are_the_rewards_registry() -> None:
    from pipeline.config.producer import BUILTIN_REWARD_NAMES
    from pipeline.producers.rewards import BUILTIN_REWARDS

    assert set(BUILTIN_REWARDS) == BUILTIN_REWARD_NAMES


def test_the_builtin_rollout_names_the_rollout_function() -> None:
    from pipeline.config.producer import BUILTIN_ROLLOUT
    from pipeline.producers.rollout import single_turn

    assert BUILTIN_ROLLOUT == f"{single_turn.__module__}:{single_turn.__qualname__}"


@pytest.mark.parametrize("digits", [1, 2])
def test_the_synthetic_task_sizes_are_the_tasks(digits: int) -> None:
    from pipeline.config.prompts import SYNTHETIC_TASK_SPACES
    from pipeline.data.prompts import SYNTHETIC_TASKS

    assert set(SYNTHETIC_TASKS) == set(SYNTHETIC_TASK_SPACES)
    for name, task in SYNTHETIC_TASKS.items():
        space = SYNTHETIC_TASK_SPACES[name](digits)
        assert task.space(digits) == space
        # As many distinct prompts as the recipe check allows: a size it accepts can always be drawn.
        assert len({task.make(code, digits)[0] for code in range(space)}) == space, name
