"""User plug-ins: one way of naming user code (``package.module:attr``), checked before anything starts.

Every edge of sluice that takes user code (rewards, rollout functions, losses, filters, hooks, model specs) names it
the same way and resolves it here:

- the module is imported from the folders the recipe lists in ``plugins.paths`` (relative to the working directory),
  or from an installed package; a module found anywhere else (the working directory, a stray ``PYTHONPATH`` entry) is
  refused, so a run executes only code its recipe points at;
- the attribute must exist and be callable, with a signature that accepts the call sluice will make (and be async,
  or not, as the edge requires); the error names the recipe field;
- each resolved plug-in is recorded with its source file and the file's SHA-256 (``RUN_DIR/plugins.json``), so a
  run's results can be traced to the exact code that produced them.

Light on purpose (no torch): the config imports it.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
import sysconfig
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.errors import ConfigError

_SYS_PATH_LOCK = threading.Lock()
_ACTIVE: list[Path] = []  # every folder activate() put on sys.path: trusted for the rest of the process
_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Signature:
    """What an edge will call a plug-in with: placeholder positional arguments, and whether it must be async.

    ``args`` are only bound against the function's signature (never passed), so a wrong arity is found at load time.
    ``awaitable``: True (must be ``async def``), False (must be a plain function), None (either).
    """

    args: tuple[Any, ...]
    described: str
    """The call in words, for the error: e.g. "(prompt, response_text)"."""
    awaitable: bool | None = None


@dataclass(frozen=True)
class PluginRecord:
    """Where a resolved plug-in's code came from (written to ``RUN_DIR/plugins.json``)."""

    field: str
    ref: str
    file: str | None
    sha256: str | None

    def as_dict(self) -> dict[str, str | None]:
        return {"field": self.field, "ref": self.ref, "file": self.file, "sha256": self.sha256}


def split_ref(ref: str, field: str) -> tuple[str, str]:
    """``package.module:attr`` split in two; ConfigError naming ``field`` when it is not of that form."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr or not all(p.isidentifier() for p in module.split(".")) \
            or not all(p.isidentifier() for p in attr.split(".")):
        raise ConfigError(f"{field} = {ref!r} is not an import path 'package.module:attr' (e.g. "
                          "'my_rewards.math:score', with the folder holding my_rewards/ in plugins.paths)")
    return module, attr


def activate(paths: Sequence[str | Path]) -> list[Path]:
    """Put ``plugins.paths`` at the front of ``sys.path`` for the rest of the process (idempotent).

    They stay there: a plug-in may import its own helpers lazily, long after it was resolved.
    """
    folders = [Path(p).resolve() for p in paths]
    with _SYS_PATH_LOCK:
        for f in reversed(folders):
            if str(f) not in sys.path:
                sys.path.insert(0, str(f))
            if f not in _ACTIVE:
                _ACTIVE.append(f)
    return folders


def _trusted_roots() -> list[Path]:
    roots = list(_ACTIVE) + [_PACKAGE_ROOT / "pipeline"]
    for key in ("purelib", "platlib", "stdlib", "platstdlib"):
        if path := sysconfig.get_paths().get(key):
            roots.append(Path(path).resolve())
    return roots


def _under(path: Path, roots: Sequence[Path]) -> bool:
    return any(path == r or r in path.parents for r in roots)


def module_file(module: Any) -> Path | None:
    """The module's source file, or None for a built-in or namespace module."""
    file = getattr(module, "__file__", None)
    return Path(file).resolve() if file else None


def _where() -> str:
    return f"plugins.paths is [{', '.join(str(p) for p in _ACTIVE)}]" if _ACTIVE else "plugins.paths is empty"


def _check_origin(ref: str, field: str, module_name: str) -> None:
    """Refuse a module found outside the trusted folders *before* importing it, so none of its code runs.

    Each dotted prefix is located before the next is looked up: ``find_spec("a.b")`` imports ``a``, so ``a`` must
    have passed first.
    """
    roots = _trusted_roots()
    parts = module_name.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        if name in sys.modules:
            located = [module_file(sys.modules[name])]
        else:
            try:
                spec = importlib.util.find_spec(name)
            except (ImportError, ValueError) as e:
                raise ConfigError(f"{field} = {ref!r}: cannot import {module_name!r} ({e}); {_where()}") from None
            if spec is None:
                raise ConfigError(f"{field} = {ref!r}: cannot import {module_name!r} (no module named {name!r}); "
                                  f"{_where()}: add the folder that holds the module") from None
            has_file = spec.origin not in (None, "built-in", "frozen")
            located = [Path(spec.origin).resolve()] if has_file else [
                Path(p).resolve() for p in (spec.submodule_search_locations or [])]
        for where in located:
            if where is not None and not _under(where, roots):
                raise ConfigError(f"{field} = {ref!r}: module {name!r} was found at {where}, outside plugins.paths and "
                                  "the installed packages; sluice runs user code only from folders the recipe names, "
                                  "so add its folder to plugins.paths (it was not imported)")


def resolve(ref: str, *, field: str, signature: Signature | None = None,
            paths: Sequence[str | Path] = ()) -> Callable[..., Any]:
    """Import the callable ``ref`` names for recipe field ``field`` and check it; ConfigError says what is wrong.

    ``paths`` are activated first; folders activated earlier in the process (a loaded recipe's ``plugins.paths``)
    count too, so a process that loaded its config resolves plug-ins without passing them again.
    """
    module_name, attr = split_ref(ref, field)
    activate(paths)
    _check_origin(ref, field, module_name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field} = {ref!r}: cannot import {module_name!r} ({e}); {_where()}: add the folder that "
                          "holds the module") from None
    except Exception as e:  # the module itself failed while loading: name it rather than crash the loader
        raise ConfigError(f"{field} = {ref!r}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for part in attr.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ConfigError(f"{field} = {ref!r}: {module_name!r} has no attribute {attr!r}")
    if not callable(obj):
        raise ConfigError(f"{field} = {ref!r}: {attr!r} is a {type(obj).__name__}, not a function")
    if signature is not None:
        check_signature(obj, ref, field, signature)
    return obj  # type: ignore[no-any-return]


def check_signature(fn: Callable[..., Any], ref: str, field: str, signature: Signature) -> None:
    """ConfigError unless ``fn`` can be called as ``signature`` says (arity, and async or not)."""
    is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)
    if signature.awaitable is True and not is_async:
        raise ConfigError(f"{field} = {ref!r}: must be an async function (async def ...{signature.described}); "
                          "sluice awaits it")
    if signature.awaitable is False and is_async:
        raise ConfigError(f"{field} = {ref!r}: is async, but sluice calls it synchronously{signature.described}; "
                          "make it a plain function")
    try:
        inspect.signature(fn).bind(*signature.args)
    except TypeError:
        raise ConfigError(f"{field} = {ref!r}: must accept {signature.described}; its signature is "
                          f"{inspect.signature(fn)}") from None
    except ValueError:
        pass  # a builtin without an introspectable signature: trust it


def record(ref: str, *, field: str, paths: Sequence[str | Path] = ()) -> PluginRecord:
    """The source file and SHA-256 of the module ``ref`` names (resolve it first)."""
    module_name, _ = split_ref(ref, field)
    activate(paths)
    module = importlib.import_module(module_name)
    file = module_file(module)
    digest = hashlib.sha256(file.read_bytes()).hexdigest() if file is not None and file.is_file() else None
    return PluginRecord(field=field, ref=ref, file=str(_display(file)) if file else None, sha256=digest)


def _display(file: Path) -> Path:
    """Relative to the working directory when under it: run folders travel between machines."""
    try:
        return file.relative_to(Path.cwd().resolve())
    except ValueError:
        return file
