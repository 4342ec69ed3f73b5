"""Scenario files: YAML -> validated `sim.scenario.Scenario`, with errors that point at lines.

Every problem becomes one `ScenarioError` line naming the file, the line and the field path,
e.g. `scenarios/x.yaml:14: allocators[1].blok_size: unknown option; did you mean
'block_size'?`. `--set key=value` overrides are applied to the raw data before validation,
with the same dotted keys as a sweep (values are parsed as YAML: `--set kv_budget=40GB`,
`--set engine.chunked_prefill=true`).
"""

from __future__ import annotations

import difflib
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kvfrag import __version__
from sim.scenario import Scenario, set_path


def add_set_argument(parser: Any, example: str) -> None:
    """The `--set KEY=VALUE` option every scenario command takes."""
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override a field, e.g. --set {example} (repeatable)",
    )


class ScenarioError(ValueError):
    """A scenario file or override that cannot be used; the message is one line."""


@dataclass(frozen=True)
class LoadedScenario:
    scenario: Scenario
    path: Path
    base_dir: Path  # relative paths in the scenario resolve from here

    def resolved(self) -> dict[str, Any]:
        """The fully resolved input: every default filled in, paths absolute, the version."""
        data = self.scenario.model_dump(mode="json")
        _absolute_paths(data.get("workload", {}), self.base_dir)
        return {"kvfrag_version": __version__, **data}


def load_scenario(path: str | Path, sets: list[str] | tuple[str, ...] = ()) -> LoadedScenario:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(f"{path}: no such scenario file") from None
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
        root = yaml.compose(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ScenarioError(f"{where}: malformed YAML: {problem}") from None
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a YAML mapping (name, model, kv_budget, ...)")
    data.pop("kvfrag_version", None)  # written into resolved copies; informational only
    data.setdefault("name", path.stem)
    for item in sets:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(f"--set {item!r}: write key=value, e.g. --set kv_budget=40GB")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
            set_path(data, key.strip(), value)
        except (yaml.YAMLError, ValueError) as exc:
            raise ScenarioError(f"--set {item!r}: {exc}") from None
    try:
        scenario = Scenario.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(_describe(exc, path, root, data)) from None
    base_dir = path.resolve().parent
    _check_paths(data.get("workload"), ["workload"], base_dir, path, root)
    return LoadedScenario(scenario, path, base_dir)


def _check_paths(node: Any, loc: list, base: Path, path: Path, root: yaml.Node | None) -> None:
    """Every file the workload names must exist, so a run never fails half-way for it."""
    from workloads import samples

    if isinstance(node, dict):
        for key, value in node.items():
            here = [*loc, key]
            if key == "path" and isinstance(value, str):
                if value.startswith("sample:"):
                    ok = value.removeprefix("sample:") in samples.names()
                    problem = f"no shipped sample {value!r} (samples: {', '.join(samples.names())})"
                else:
                    ok = (base / value).exists()
                    problem = f"no such file {value!r} (relative to {base})"
                if not ok:
                    line = _line_of(root, here)
                    where = f"{path}:{line}" if line else str(path)
                    raise ScenarioError(f"{where}: {'.'.join(here)}: {problem}")
            else:
                _check_paths(value, here, base, path, root)


def _describe(exc: ValidationError, path: Path, root: yaml.Node | None, data: Any) -> str:
    """The first validation error as `file:line: field.path: message`."""
    errors = exc.errors()
    # A misspelt key also makes the real one "missing": report the misspelling.
    err = next((e for e in errors if e["type"] == "extra_forbidden"), errors[0])
    loc = _data_loc(err["loc"], data)
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    line = _line_of(root, loc)
    where = f"{path}:{line}" if line else str(path)
    if err["type"] == "extra_forbidden":
        valid = _valid_fields(loc[:-1], data)
        hint = difflib.get_close_matches(str(loc[-1]), valid, n=1, cutoff=0.6)
        msg = f"unknown key {loc[-1]!r}" + (f"; did you mean {hint[0]!r}?" if hint else "")
        if valid:
            msg += f" (valid: {', '.join(valid)})"
    elif err["type"] == "missing":
        msg = "required field is missing"
    else:
        msg = err["msg"].removeprefix("Value error, ")
    return f"{where}: {field or 'scenario'}: {msg}"


def _data_loc(loc: tuple, data: Any) -> list:
    """pydantic's error location with union tags dropped, so it walks the data."""
    out, node = [], data
    for part in loc:
        in_dict = isinstance(node, dict) and part in node
        if in_dict or (isinstance(node, list) and isinstance(part, int) and part < len(node)):
            node = node[part]
        elif isinstance(node, dict) and node.get("kind") == part:
            continue  # discriminated-union tag
        elif isinstance(part, str) and part.startswith(("function-", "union")):
            continue
        else:
            node = None
        out.append(part)
    return out


def _line_of(root: yaml.Node | None, loc: list) -> int | None:
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = [(k, v) for k, v in node.value if k.value == part]
            if not found:
                break
            key, node = found[0]
            line = key.start_mark.line + 1
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(
            node.value
        ):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


def _valid_fields(loc: list, data: Any) -> list[str]:
    """Field names of the model found at `loc` (for "did you mean" hints)."""
    model: Any = Scenario
    node = data
    for part in loc:
        node = node[part] if isinstance(node, dict | list) else None
        model = _member_type(model, part, node)
        if model is None:
            return []
    return sorted(model.model_fields) if _is_model(model) else []


def _member_type(model: Any, part: Any, node: Any) -> Any:
    if _is_model(model):
        field = model.model_fields.get(part)
        return _pick(field.annotation, node) if field else None
    origin = typing.get_origin(model)
    if origin in (list, tuple) and isinstance(part, int):
        return _pick(typing.get_args(model)[0], node)
    return None


def _pick(annotation: Any, node: Any) -> Any:
    """The model a union annotation means for this data (by its `kind` when there is one)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _pick(typing.get_args(annotation)[0], node)
    if origin in (typing.Union, types.UnionType):
        members = [_pick(a, node) for a in typing.get_args(annotation)]
        models = [m for m in members if _is_model(m) or typing.get_origin(m) in (list, tuple)]
        kind = node.get("kind") if isinstance(node, dict) else None
        for m in models:
            f = getattr(m, "model_fields", {}).get("kind")
            if kind is not None and f is not None and f.default == kind:
                return m
        return models[0] if models else None
    return annotation


def _is_model(obj: Any) -> bool:
    return isinstance(obj, type) and issubclass(obj, BaseModel)


def _absolute_paths(node: Any, base: Path) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "path" and isinstance(value, str) and not value.startswith("sample:"):
                node[key] = str((base / value).resolve())
            else:
                _absolute_paths(value, base)
    elif isinstance(node, list):
        for value in node:
            _absolute_paths(value, base)
