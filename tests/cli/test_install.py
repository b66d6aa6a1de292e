"""The install's bounds: what pyproject.toml allows excludes what does not work, and what is installed here is inside
them (read with importlib.metadata), including the megatron-core range the CPU shim accepts."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).parents[2]


def _requirements(extra_groups: tuple[str, ...] = ("train", "engine", "dev")) -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    for group in extra_groups:
        reqs += [Requirement(r) for r in project["optional-dependencies"][group] if not r.startswith("sluice-rl")]
    return reqs


def _spec(name: str, python: str | None = None) -> list[Requirement]:
    env = default_environment()
    if python is not None:
        env = {**env, "python_version": python, "python_full_version": f"{python}.0"}
    return [r for r in _requirements() if r.name == name and (r.marker is None or r.marker.evaluate(env))]


def test_installed_versions_are_inside_pyprojects_bounds() -> None:
    checked = []
    for req in _requirements():
        if req.marker is not None and not req.marker.evaluate():
            continue
        try:
            installed = version(req.name)
        except PackageNotFoundError:
            continue  # an extra this environment does not install
        assert req.specifier.contains(installed, prereleases=True), (
            f"{req.name} {installed} is installed but pyproject.toml allows {req}")
        checked.append(f"{req.name} {installed}")
    print("inside the bounds:", ", ".join(sorted(set(checked))))
    assert {"transformers", "megatron-core", "ray", "torch"} <= {c.split()[0] for c in checked}


@pytest.mark.parametrize("python", ["3.11", "3.12", "3.13"])
def test_megatron_core_bounds_are_what_the_cpu_shim_accepts(python: str) -> None:
    pytest.importorskip("torch")
    from pipeline.consumers.megatron import cpu_shim

    [req] = _spec("megatron-core", python)
    accepted = [Version(v) for v in ("0.16.1", "0.16.9")]
    refused = [Version(v) for v in ("0.15.3", "0.17.0", "0.19.2")]
    for v in accepted:
        assert v in req.specifier and cpu_shim._MIN_VERSION <= v < cpu_shim._MAX_VERSION_EXCLUSIVE
    for v in refused:
        assert v not in req.specifier, f"Python {python}: pyproject allows megatron-core {v}, which the shim refuses"
    assert cpu_shim._MIN_VERSION <= cpu_shim.megatron_core_version() < cpu_shim._MAX_VERSION_EXCLUSIVE


def test_transformers_bounds_need_version_5() -> None:
    # 4.x has no fused Qwen3-MoE experts (experts.gate_up_proj), which the CPU engine's weight loader writes into.
    for req in _spec("transformers"):
        assert Version("4.57.1") not in req.specifier and Version("5.0.0") in req.specifier
    assert Version(version("transformers")).major == 5


def test_ray_is_the_version_the_launcher_was_built_on() -> None:
    [req] = _spec("ray")
    assert Version("2.60.0") in req.specifier and Version("2.61.0") not in req.specifier


def test_warning_filters_name_what_they_silence() -> None:
    # Every ignore names a third-party module or a message, so a warning from sluice's own code is never hidden.
    filters = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["filterwarnings"]
    assert filters
    for entry in filters:
        action, message, category, module, *_ = (entry.split(":") + ["", "", "", ""])[:5]
        assert action == "ignore", entry
        assert message or module, f"{entry!r} silences a whole category"
        assert not module.startswith(("pipeline", "tests")), f"{entry!r} silences sluice's own code"
