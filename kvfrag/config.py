"""Scenario files: YAML -> validated `sim.scenario.Scenario`, with errors that point at lines.

Every problem becomes one `ScenarioError` line naming the file, the line and the field path,
e.g. `scenarios/x.yaml:14: allocators[1].blok_size: unknown option; did you mean
'block_size'?`. `--set key=value` overrides are applied to the raw data before validation,
with the same dotted keys as a sweep (values are parsed as YAML: `--set kv_budget=40GB`,
`--set engine.chunked_prefill=true`); a problem in a value given by `--set` names that item
instead of a line. Sweep points are all validated at load time, so a bad one is reported here,
as `file:line: sweep.KEY: point N (KEY=VALUE): problem`.
"""

from __future__ import annotations

import json
import stat
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kvfrag import __version__
from kvfrag.sim.presets import nearest
from kvfrag.sim.scenario import Scenario, SweepPointError, check_name, set_path, show_values
from kvfrag.sim.units import EXCERPT_CHARS, clip_quoted, excerpt
from kvfrag.workloads.spec import FieldError

#: Largest scenario file read: scenarios are a page of YAML, so anything bigger (a trace given
#: by mistake, /dev/zero behind a link) is refused before it is read.
MAX_FILE_BYTES = 1_000_000
#: Largest Hugging Face config.json read (`model: {hf_config: PATH}`): published ones are a few
#: KB; a multimodal one with label maps, tens of KB.
MAX_HF_CONFIG_BYTES = 4_000_000
#: Longest `--set KEY=VALUE` item, in characters.
MAX_SET_CHARS = 64 * 1024


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
        if self.scenario.model_len_per_point:
            data["max_model_len"] = None  # (each point's model gives its own: as written)
        if not self.scenario.sweep:  # the batch limits the hardware class gave (a sweep may
            cfg = self.scenario.engine_config()  # vary them: its points resolve their own)
            data["engine"]["max_num_seqs"] = cfg.max_num_seqs
            data["engine"]["max_num_batched_tokens"] = cfg.max_num_batched_tokens
            data["engine"]["async_scheduling"] = cfg.async_scheduling
        return {"kvfrag_version": __version__, **data}


def shipped_scenarios() -> dict[str, Path]:
    """The scenarios that ship with kvfrag, by name: package data when installed, the
    repository's scenarios/ folder in a source checkout."""
    import kvfrag

    here = Path(kvfrag.__file__).resolve().parent
    for folder in (here / "scenarios", here.parent / "scenarios"):
        if folder.is_dir():
            return {p.stem: p for p in sorted(folder.glob("*.yaml"))}
    return {}


def scenario_path(arg: str | Path) -> Path:
    """A scenario file, or the name of a shipped one (`kvfrag run quickstart`). A file of that
    name in the current folder wins; a path with a folder or a suffix is always a file."""
    path = Path(arg)
    if path.exists() or path.suffix or len(path.parts) != 1:
        return path
    return shipped_scenarios().get(str(arg), path)


def load_scenario(path: str | Path, sets: list[str] | tuple[str, ...] = ()) -> LoadedScenario:
    path = scenario_path(path)
    root, data = _parse(_read(path), path)
    if not isinstance(data, dict):
        raise ScenarioError(f"{path}: a scenario is a YAML mapping (name, model, kv_budget, ...)")
    data.pop("kvfrag_version", None)  # written into resolved copies; informational only
    origins: dict[str, str] = {}  # dotted key -> the --set item that wrote it
    for item in sets:
        if len(item) > MAX_SET_CHARS:
            raise ScenarioError(
                f"--set {item[:40]!r}...: {len(item)} characters; a --set item is at most "
                f"{MAX_SET_CHARS // 1024} KiB"
            )
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ScenarioError(
                f"--set {excerpt(item)}: write key=value, e.g. --set kv_budget=40GB"
            )
        try:
            value = _load_yaml(raw)[1] if raw.strip() else ""
            set_path(data, key.strip(), value)
        except _DuplicateKey as exc:
            raise ScenarioError(f"--set {excerpt(item)}: {exc.problem}") from None
        except (yaml.YAMLError, ValueError) as exc:
            raise ScenarioError(f"--set {excerpt(item)}: {_one_line(exc)}") from None
        origins[key.strip()] = item
    if "name" not in data:
        try:
            data["name"] = check_name(path.stem)
        except ValueError:
            raise ScenarioError(
                f"{path}: the file name {path.stem!r} is not a valid scenario name (letters, "
                "digits, '.', '_' and '-'); give the scenario a name: line"
            ) from None
    _resolve_profile(data, path.resolve().parent, origins)
    _resolve_hf_configs(data, path.resolve().parent, origins, path, root)
    _resolve_set_paths(data, origins)
    try:
        scenario = Scenario.model_validate(data)
        for _ in scenario.iter_points():  # every point now, so a run never fails half-way
            pass
    except ValidationError as exc:
        raise ScenarioError(_describe(exc, path, root, data, origins)) from None
    except SweepPointError as exc:
        raise ScenarioError(_describe_point(exc, path, root, data, origins)) from None
    except ArithmeticError:  # (the bounds keep every number computable: this is a bug)
        raise ScenarioError(
            f"{path}: a number is beyond what kvfrag can compute with; the README's "
            "'Scenario files' lists the range of each"
        ) from None
    base_dir = path.resolve().parent
    _check_paths(data.get("workload"), ["workload"], base_dir, path, root)
    return LoadedScenario(scenario, path, base_dir)


def _read(path: Path) -> str:
    """The scenario file's text; what is not a small regular file is refused before it is
    read."""
    try:
        return read_small_text(path, MAX_FILE_BYTES, "scenario file")
    except FileNotFoundError:
        hint = ""
        if not path.suffix and len(path.parts) == 1:
            names = ", ".join(shipped_scenarios())
            hint = f" and no shipped scenario of that name (kvfrag scenarios lists them: {names})"
        raise ScenarioError(f"{path}: no such scenario file{hint}") from None
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None


def read_small_text(path: Path, limit: int, what: str) -> str:
    """The UTF-8 text of `path`, a regular file of at most `limit` bytes (`what` it is, for
    the message); anything else is refused from its stat, before it is opened (a FIFO or a
    device would never end). Raises FileNotFoundError, or ValueError("PATH: problem")."""
    try:
        info = path.stat()
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise ValueError(f"{path}: cannot read: {getattr(exc, 'strerror', None) or exc}") from None
    if not stat.S_ISREG(info.st_mode):
        raise ValueError(f"{path}: not a regular file")
    try:
        with path.open("rb") as f:
            raw = f.read(limit + 1)
    except OSError as exc:
        raise ValueError(f"{path}: cannot read: {exc.strerror}") from None
    size = max(info.st_size, len(raw))
    if size > limit:
        raise ValueError(
            f"{path}: {size / 1e6:.1f} MB; a {what} is at most {limit / 1e6:.0f} MB"
        )
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start})") from None


def _parse(text: str, path: Path) -> tuple[yaml.Node | None, Any]:
    """(node tree, data) of the scenario text; YAML errors as one line with the file's line."""
    try:
        return _load_yaml(text)
    except _DuplicateKey as exc:
        raise ScenarioError(f"{path}:{exc.line}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ScenarioError(f"{where}: malformed YAML: {problem}") from None


class _DuplicateKey(yaml.constructor.ConstructorError):
    def __init__(self, key: Any, first: yaml.Node, again: yaml.Node) -> None:
        first_line = first.start_mark.line + 1
        super().__init__(
            None, None, f"duplicate key {excerpt(key)} (first at line {first_line})",
            again.start_mark
        )
        self.line = again.start_mark.line + 1


class _Loader(yaml.SafeLoader):
    """Safe YAML that refuses a key given twice in one mapping (plain YAML keeps the last one
    silently) and reports an integer too long to convert at its line."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Node] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:
                continue  # unhashable: the base class says so
            if first is not key_node:
                raise _DuplicateKey(key, first, key_node)
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            raise yaml.constructor.ConstructorError(
                None, None, f"integer of {len(node.value)} digits is too long", node.start_mark
            ) from None


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)


def _load_yaml(text: str) -> tuple[yaml.Node | None, Any]:
    loader = _Loader(text)
    try:
        root = loader.get_single_node()
        return root, (loader.construct_document(root) if root is not None else None)
    finally:
        loader.dispose()


def _one_line(exc: Exception) -> str:
    """The message on one line, any value it quotes cut to an excerpt."""
    return clip_quoted(" ".join(str(exc).split()))


def _given_by_set(dotted: str, origins: dict[str, str]) -> bool:
    """Whether a --set wrote the value at `dotted` (itself or a mapping above it)."""
    return any(dotted == k or dotted.startswith(k + ".") for k in origins)


def _resolve_set_paths(data: dict, origins: dict[str, str]) -> None:
    """A workload file named on the command line (`--set workload.trace.path=...`) is relative
    to the current folder, as a shell user means it; those in the YAML stay relative to it."""
    if not origins:
        return
    for loc, value in list(workload_paths(data.get("workload"), ["workload"])):
        if _given_by_set(".".join(map(str, loc)), origins) and not value.startswith("sample:"):
            node = data
            for part in loc[:-1]:
                node = node[part]
            node[loc[-1]] = str((Path.cwd() / Path(value).expanduser()).resolve())


def _resolve_profile(data: dict, base_dir: Path, origins: dict[str, str]) -> None:
    """A step-time profile's path, made absolute: relative to the scenario's folder, or to the
    current one when a --set gave it (as a user typing it on the command line means)."""
    engine = data.get("engine")
    step = engine.get("step_time") if isinstance(engine, dict) else None
    if not isinstance(step, dict) or not isinstance(step.get("profile"), str):
        return
    base = Path.cwd() if _given_by_set("engine.step_time.profile", origins) else base_dir
    step["profile"] = str((base / Path(step["profile"]).expanduser()).resolve())


def _resolve_hf_configs(
    data: dict, base_dir: Path, origins: dict[str, str], path: Path, root: yaml.Node | None
) -> None:
    """Read every config.json a model names (`model.hf_config`, and sweep values of `model`
    and `model.hf_config`) and put `{path, config}` in its place: the path absolute (relative
    to the scenario's folder, or to the current one when a --set gave it), the config cut to
    the fields kvfrag reads. A file that cannot be read, or is not JSON, is one line naming
    the scenario's line and the file."""

    def read(value: Any, loc: list, dotted: str) -> Any:
        if not isinstance(value, str):
            return value  # (a resolved copy's {path, config}; or a wrong type, said later)
        where = _where(loc, data, path, root, origins)
        if not value.strip():
            raise ScenarioError(f"{where}: {_field(loc)}: the path is empty; name a config.json")
        base = Path.cwd() if _given_by_set(dotted, origins) else base_dir
        file = (base / Path(value).expanduser()).resolve()
        try:
            config = _read_json(file)
        except ValueError as exc:
            raise ScenarioError(f"{where}: {_field(loc)}: {exc}") from None
        from kvfrag.sim.hf_config import relevant

        return {"path": str(file), "config": relevant(config)}

    model = data.get("model")
    if isinstance(model, dict) and "hf_config" in model:
        model["hf_config"] = read(model["hf_config"], ["model", "hf_config"], "model.hf_config")
    sweep = data.get("sweep")
    if not isinstance(sweep, dict):
        return
    for key in ("model", "model.hf_config"):
        values = sweep.get(key)
        if not isinstance(values, list):
            continue
        for i, value in enumerate(values):
            if key == "model.hf_config":
                values[i] = read(value, ["sweep", key, i], f"sweep.{key}")
            elif isinstance(value, dict) and "hf_config" in value:
                value["hf_config"] = read(value["hf_config"], ["sweep", key, i], f"sweep.{key}")


def _read_json(file: Path) -> Any:
    """A config.json's data; what is not a small regular file of JSON is refused, before it is
    read where its size or kind says so. Raises ValueError("FILE: problem")."""
    try:
        text = read_small_text(file, MAX_HF_CONFIG_BYTES, "config.json")
    except FileNotFoundError:
        raise ValueError(f"{file}: no such file") from None

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        return json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file}: not JSON (line {exc.lineno}, column {exc.colno}: "
                         f"{exc.msg})") from None
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{file}: not JSON ({str(exc)[:80] or 'nested too deep'})") from None


def workload_paths(node: Any, loc: list) -> Iterator[tuple[list, str]]:
    """(location, value) of every file a workload's data names (`path`: a trace, an arrival
    replay, an empirical length table), `sample:NAME` included."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = [*loc, key]
            if key == "path" and isinstance(value, str):
                yield here, value
            else:
                yield from workload_paths(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from workload_paths(value, [*loc, i])


def _check_paths(node: Any, loc: list, base: Path, path: Path, root: yaml.Node | None) -> None:
    """Every file the workload names must be a regular, non-empty file, so that a run never
    fails half-way for it, nor hangs on a FIFO or a device: checked by `stat`, not read."""
    from kvfrag.workloads import samples
    from kvfrag.workloads.readers import MISSING, resolve_path, trace_file_problem
    from kvfrag.workloads.table import show

    for here, value in workload_paths(node, loc):
        if value.startswith("sample:"):
            ok = value.removeprefix("sample:") in samples.names()
            problem = f"no shipped sample {value!r} (samples: {', '.join(samples.names())})"
        elif not value.strip():  # (Path("") is the scenario's folder)
            ok, problem = False, "the path is empty; name a file"
        else:
            found = trace_file_problem(resolve_path(value, base))
            ok = found is None
            problem = (
                f"no such file {show(value)} (relative to {base})" if found == MISSING else
                f"{show(value)} {found}; kvfrag reads only regular, non-empty files"
            )
        if not ok:
            line = _line_of(root, here)
            where = f"{path}:{line}" if line else str(path)
            raise ScenarioError(f"{where}: {_field(here)}: {problem}")


def _describe(
    exc: ValidationError, path: Path, root: yaml.Node | None, data: Any, origins: dict[str, str]
) -> str:
    """The first validation error as `file:line: field.path: message` (or `--set ITEM: ...`)."""
    loc, msg = _first_error(exc, data)
    where = _where(loc, data, path, root, origins)
    return f"{where}: {_field(loc) or 'scenario'}: {clip_quoted(msg)}"


def _describe_point(
    exc: SweepPointError, path: Path, root: yaml.Node | None, data: Any, origins: dict[str, str]
) -> str:
    """A sweep point that fails, at the line of the sweep key that made it fail."""
    if isinstance(exc.exc, ValidationError):
        loc, msg = _first_error(exc.exc, exc.data)
    else:  # set_path: its message starts with the key
        loc, msg = [], _one_line(exc.exc)
    inner = _dotted(loc, exc.data)
    keys = list(exc.values)
    key = next((k for k in keys if msg.startswith(f"{k}: ")), None)
    if key is not None:
        msg = msg.removeprefix(f"{key}: ")
    else:
        key = next((k for k in keys if _overlaps(k.split("."), inner)), keys[0])
    detail = msg if not loc or ".".join(inner) == key else f"{_field(loc)}: {msg}"
    where = _where(["sweep", key], data, path, root, origins)
    return (f"{where}: sweep.{_part(key)}: point {exc.index} ({show_values(exc.values)}): "
            f"{clip_quoted(detail)}")


def _first_error(exc: ValidationError, data: Any) -> tuple[list, str]:
    """(location in the data, message) of the error to report."""
    errors = exc.errors()
    # A misspelt key also makes the real one "missing": report the misspelling. Otherwise the
    # error that reaches deepest into the data (a union's member the data was meant for).
    extra = [e for e in errors if e["type"] == "extra_forbidden"]
    # (on a tie, a check's own message beats a union member's type mismatch: a config.json
    # model's problem, not "should be a valid string")
    err = extra[0] if extra else max(errors, key=lambda e: (
        _depth(_data_loc(e, data), data), e["type"] == "value_error"))
    loc = _data_loc(err, data)
    cause = (err.get("ctx") or {}).get("error")
    if isinstance(cause, FieldError):  # a model-level check that names the field
        loc = [*loc, *cause.loc]
    if err["type"] == "extra_forbidden":
        valid = _valid_fields(loc[:-1], data)
        hint = nearest(str(loc[-1]), valid)
        msg = f"unknown key {excerpt(loc[-1])}" + (f"; did you mean {hint!r}?" if hint else "")
        if valid:
            msg += f" (valid: {', '.join(valid)})"
    elif err["type"] == "missing":
        msg = "required field is missing"
    else:
        msg = _one_line(Exception(err["msg"].removeprefix("Value error, ")))
    return loc, msg


def _field(loc: list) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{_part(p)}" for p in loc).lstrip(".")


def _part(name: Any) -> str:
    """A key of the field path, cut to an excerpt (a key may be any YAML scalar)."""
    text = str(name)
    return text if len(text) <= EXCERPT_CHARS else text[: EXCERPT_CHARS - 3] + "..."


def _where(
    loc: list, data: Any, path: Path, root: yaml.Node | None, origins: dict[str, str]
) -> str:
    """Where the value at `loc` came from: the `--set` item that wrote it, or its line."""
    parts = ".".join(_dotted(loc, data)).split(".")  # (a sweep key is one dotted part)
    for key, item in reversed(origins.items()):
        if _overlaps(key.split("."), parts):
            return f"--set {excerpt(item)}"
    line = _line_of(root, loc)
    return f"{path}:{line}" if line else str(path)


def _overlaps(key: list[str], parts: list[str]) -> bool:
    """`key` (what a --set or sweep key wrote) holds `parts`, or is part of a non-root `parts`."""
    n = min(len(key), len(parts))
    return n > 0 and key[:n] == parts[:n]


def _dotted(loc: list, data: Any) -> list[str]:
    """A data location as set_path's key parts: list elements by their label."""
    out, node = [], data
    for part in loc:
        if isinstance(node, list) and isinstance(part, int) and part < len(node):
            node = node[part]
            label = node.get("label") if isinstance(node, dict) else None
            out.append(str(label) if label is not None else str(part))
            continue
        node = node.get(part) if isinstance(node, dict) else None
        out.append(str(part))
    return out


def _data_loc(err: Any, data: Any) -> list:
    """pydantic's error location with union tags dropped, so it walks the data."""
    loc, kind = err["loc"], err["type"]
    out, node = [], data
    for i, part in enumerate(loc):
        # (a key that is also a union's tag, like step_time's `roofline: true`, is the tag when
        # the location goes on below it: a scalar has nothing below)
        in_dict = isinstance(node, dict) and part in node and (
            i == len(loc) - 1 or isinstance(node[part], dict | list))
        if in_dict or (isinstance(node, list) and isinstance(part, int) and part < len(node)):
            node = node[part]
        elif isinstance(node, dict) and node.get("kind") == part:
            continue  # discriminated-union tag
        elif isinstance(part, str) and part.startswith(("function-", "union")):
            continue
        elif isinstance(part, str) and node is not None and not isinstance(node, dict | list):
            continue  # a union member's tag at a scalar (kv_budget.int)
        elif (
            isinstance(part, str)
            and isinstance(node, dict)
            and (i < len(loc) - 1 or kind not in ("missing", "extra_forbidden"))
        ):
            continue  # a union member's tag at a mapping (kv_budget.GpuBudget.utilization)
        else:
            node = None
        out.append(part)
    return out


def _depth(loc: list, data: Any) -> int:
    """How many leading parts of `loc` exist in the data."""
    node = data
    for depth, part in enumerate(loc):
        in_list = isinstance(node, list) and isinstance(part, int) and part < len(node)
        if in_list or (isinstance(node, dict) and part in node):
            node = node[part]
        else:
            return depth
    return len(loc)


def _line_of(root: yaml.Node | None, loc: list) -> int | None:
    node, line = root, (root.start_mark.line + 1 if root is not None else None)
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            found = [(k, v) for k, v in node.value if k.value == part]
            if not found:
                break
            key, node = found[-1]  # the one that counts, after any merged (<<) ones
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
