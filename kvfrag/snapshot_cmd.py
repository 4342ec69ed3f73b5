"""`kvfrag snapshot replay FILE.pickle`: a recorded PyTorch memory snapshot against the model.

The snapshot's trace (`torch.cuda.memory._record_memory_history()`, then
`torch.cuda.memory._dump_snapshot(FILE)`; or a run's `snapshots/LABEL.pickle`) is turned into
the allocation calls that made it, those are replayed through a fresh `torch-caching` model
(`sim.snapshot.compare`), and the segment events and OOMs the model makes are compared, call
by call, with the recorded ones. See docs/snapshots.md.

Exit status: 0 when it ran (differences are a finding, not an error); 2 for a file that is not
a snapshot with a trace, or a bad option. Nothing is written. The simulator's modules are
imported only when the command runs, so that `kvfrag --help` stays quick.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

OPTIONS = ("expandable_segments", "max_split_size_mb", "roundup_power2_divisions")


def add_parser(sub: argparse._SubParsersAction) -> None:
    from kvfrag.args import positive

    p = sub.add_parser(
        "snapshot",
        help="PyTorch memory snapshots: replay one through the torch-caching model",
        description="Work with PyTorch memory snapshots (torch.cuda.memory._dump_snapshot "
        "files, and the snapshots/ a torch-caching run writes). See docs/snapshots.md.",
    )
    actions = p.add_subparsers(dest="snapshot_command", required=True, metavar="ACTION")
    r = actions.add_parser(
        "replay",
        help="replay a snapshot's allocation calls through the torch-caching model and "
        "report where its segment events differ from the recorded ones",
        description="Turn the snapshot's trace into the allocation calls that made it (alloc, "
        "free, and allocations that ran out of memory), replay them through a fresh "
        "torch-caching model, and compare the segment_alloc / segment_free (segment_map / "
        "segment_unmap with expandable segments) and oom events the model makes at each call "
        "with the recorded ones. Exit status 0 when it ran, whatever it found; 2 for a file "
        "that is not a snapshot with a trace.",
    )
    r.add_argument("file", type=Path, help="a pickled torch.cuda.memory._snapshot()")
    r.add_argument(
        "--expandable-segments",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="model expandable segments, or not (default: as the snapshot's "
        "allocator_settings record)",
    )
    r.add_argument(
        "--max-split-size-mb",
        type=_split_size,
        metavar="N",
        help="torch's max_split_size_mb (> 20), or 'none' (default: as recorded)",
    )
    r.add_argument(
        "--roundup-power2-divisions",
        type=positive,
        metavar="N",
        help="torch's roundup_power2_divisions, a power of 2 (1: none; default: as recorded, "
        "the most common value when it differs by size)",
    )
    r.add_argument(
        "--capacity",
        metavar="SIZE",
        help="the most the model may reserve, e.g. 40GiB (default: inferred from the trace; "
        "see docs/snapshots.md)",
    )
    r.add_argument(
        "--device",
        type=int,
        metavar="N",
        help="whose trace to replay (default: the device with the most trace entries)",
    )
    r.add_argument(
        "--show",
        type=int,
        default=5,
        metavar="N",
        help="list the first N calls where the events differ (default 5)",
    )
    r.add_argument("--json", action="store_true", help="print the comparison as JSON")
    r.set_defaults(func=cmd_replay)


def _split_size(text: str) -> float | str:
    if text.strip().lower() in ("none", "unlimited", "-1"):
        return "none"
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of MiB or 'none', got {text!r}"
        ) from None
    return int(value) if value.is_integer() else value


def cmd_replay(args: argparse.Namespace) -> int:
    from kvfrag.results import SCHEMA_VERSION, dumps_json, read_snapshot
    from kvfrag.sim.allocators import TorchCachingAllocator
    from kvfrag.sim.snapshot import check_snapshot, compare, infer_capacity, recorded_settings
    from kvfrag.sim.units import parse_size

    if args.show < 0:
        raise ValueError("--show must be >= 0")
    path: Path = args.file
    snap = read_snapshot(path)
    try:
        device = check_snapshot(snap, args.device)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None

    recorded, notes = recorded_settings(snap)
    has_settings = isinstance(snap.get("allocator_settings"), dict)
    settings, source = {}, {}
    given = {
        "expandable_segments": args.expandable_segments,
        "max_split_size_mb": args.max_split_size_mb,
        "roundup_power2_divisions": args.roundup_power2_divisions,
    }
    for name in OPTIONS:
        if given[name] is not None:
            settings[name] = None if given[name] == "none" else given[name]
            source[name] = "option"
        else:
            settings[name] = recorded[name]
            source[name] = "recorded" if has_settings else "default"
    if args.capacity is not None:
        capacity, how = parse_size(args.capacity), "given (--capacity)"
        if capacity < 1:
            raise ValueError("--capacity must be above 0 bytes")
    else:
        capacity, how = infer_capacity(snap, device, settings["roundup_power2_divisions"])
    model = TorchCachingAllocator(capacity, 1, 2**40, reserve="oracle", **settings)
    result = compare(snap, model, device, keep=args.show)

    if not result.entries:
        notes.append(
            "the trace is empty: record one with torch.cuda.memory._record_memory_history() "
            "before the allocations"
        )
    if result.reserved_before:
        notes.append(
            f"{_bytes(result.reserved_before)} were reserved before the trace began; the "
            "model starts empty, so its segments can differ from the recorded ones"
        )
    if result.skipped_frees:
        notes.append(
            f"{result.skipped_frees:,} free(s) of blocks allocated before the trace began "
            "were not replayed"
        )
    if result.other_streams:
        notes.append(
            f"{result.other_streams:,} trace entries are on streams other than 0; the model "
            "has one stream"
        )

    if args.json:
        doc = {
            "schema_version": SCHEMA_VERSION,
            "file": str(path),
            "device": device,
            "trace_entries": result.entries,
            "calls": result.ops,
            "settings": settings,
            "settings_source": source,
            "capacity_bytes": capacity,
            "capacity_source": how,
            "events": {
                action: {"recorded": result.recorded[action], "model": result.model[action]}
                for action in result.recorded
            },
            "reserved_end_bytes": result.reserved_end,
            "reserved_before_trace_bytes": result.reserved_before,
            "skipped_frees": result.skipped_frees,
            "other_stream_entries": result.other_streams,
            "identical": result.identical,
            "calls_compared": result.calls,
            "calls_differing": result.differing,
            "differences": [d.to_json() for d in result.differences],
            "notes": notes,
        }
        print(dumps_json(doc))
        return 0
    print(_report(path, result, settings, source, capacity, how, notes))
    return 0


def _bytes(n: int) -> str:
    from kvfrag.sim.units import format_size

    return f"{format_size(n)} ({n:,} B)"


def _size(n: int) -> str:
    return f"{n:,} B"


def _addr(addr: int | None) -> str:
    return "" if addr is None else f" at {addr:#x}"


def _events(events: list[dict[str, Any]]) -> str:
    if not events:
        return "nothing"
    return ", ".join(
        ("" if "index" not in e else f"[{e['index']}] ")
        + f"{e['action']} {_size(e['size'])}{_addr(e['addr'])}"
        for e in events
    )


def _report(
    path: Path,
    result: Any,
    settings: dict[str, Any],
    source: dict[str, str],
    capacity: int,
    how: str,
    notes: list[str],
) -> str:
    ops = result.ops
    lines = [
        f"{path}: device {result.device}, {result.entries:,} trace entries; replayed "
        f"{ops['alloc']:,} allocs, {ops['free']:,} frees, {ops['oom']:,} failed allocs (oom)",
    ]
    words = {"recorded": "as recorded", "option": "given", "default": "torch's default"}
    shown = ", ".join(
        f"{name}={'none' if settings[name] is None else settings[name]}"
        + (f" ({words[source[name]]})" if source[name] != "recorded" else "")
        for name in OPTIONS
    )
    if all(s == "recorded" for s in source.values()):
        shown += " (as recorded)"
    lines.append(f"settings: {shown}")
    lines.append(f"capacity: {_bytes(capacity)}: {how}")
    lines.append("")
    rows = [
        a for a in result.recorded
        if a in ("segment_alloc", "segment_free", "oom")
        or result.recorded[a] or result.model[a]
    ]
    width = max(len(a) for a in rows)
    lines.append(f"{'event':<{width}}  {'recorded':>10}  {'model':>10}")
    for a in rows:
        lines.append(f"{a:<{width}}  {result.recorded[a]:>10,}  {result.model[a]:>10,}")
    end = result.reserved_end
    lines.append(
        f"reserved at end: recorded {_bytes(end['recorded'])}, model {_bytes(end['model'])}"
    )
    lines.append("")
    if result.identical:
        lines.append(
            f"identical: at each of the {result.calls:,} allocation calls the model makes the "
            "segment events and OOMs the trace records"
        )
    else:
        lines.append(
            f"different at {result.differing:,} of {result.calls:,} allocation calls"
            + (
                f"; the first {len(result.differences)} (trace index, call, size, address; "
                "then the segment events and OOMs of each side):"
                if result.differences
                else ""
            )
        )
        for d in result.differences:
            where = "after the last call" if d.index is None else f"[{d.index}]"
            call = "" if d.op == "end" else f" {d.op} {_size(d.size)}{_addr(d.addr)}"
            lines.append(f"  {where}{call}")
            lines.append(f"      recorded: {_events(d.recorded)}")
            lines.append(f"      model:    {_events(d.model)}")
    for note in notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
