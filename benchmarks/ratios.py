"""Print the ratio table of a benchmark run (a ``--benchmark-json`` file) as Markdown.

Usage::

    python benchmarks/ratios.py bench-results/bench.json [more.json ...]

For every case and device, the rounds of each variant are pooled over the run's blocks (both
sides come from the same process, interleaved; see benchmarks/_support.py) and the medians are
divided: ratio = median(variant) / median(baseline). ``paired`` is the median and interquartile
range of the per-block ratios (each block's variant median over the same block's baseline median,
measured back to back): where it disagrees with ``ratio`` or is wide, the run was noisy.
Standard library only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

CASE_ORDER = [f"P{i}" for i in range(1, 21)]


def fmt_time(seconds: float, sign: bool = False) -> str:
    """``1.23 ms``; with ``sign``, ``+1.23 ms`` / ``-1.23 ms``."""
    prefix = ("+" if seconds >= 0 else "-") if sign else ("-" if seconds < 0 else "")
    magnitude = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if magnitude >= scale:
            return f"{prefix}{magnitude / scale:.3g} {unit}"
    return f"{prefix}{magnitude / 1e-9:.3g} ns"


def _data(bench: dict[str, Any]) -> list[float]:
    """The round times of one benchmark: ``extra_info["inner_seconds"]`` when the case timed its
    rounds itself (a subprocess measuring its own step), else pytest-benchmark's."""
    inner = bench.get("extra_info", {}).get("inner_seconds")
    if inner:
        return list(inner)
    stats = bench["stats"]
    return list(stats.get("data") or [stats["median"]])


def _median(bench: dict[str, Any]) -> float:
    inner = bench.get("extra_info", {}).get("inner_seconds")
    return statistics.median(inner) if inner else bench["stats"]["median"]


def group_runs(doc: dict[str, Any]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """(case, device, detail) -> the benchmarks of that case, from ``extra_info``."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = defaultdict(list)
    for bench in doc.get("benchmarks", []):
        info = bench.get("extra_info", {})
        if "case" in info and "variant" in info:
            groups[(info["case"], info["device"], info["detail"])].append(bench)
    return groups


def _infos(benches: list[dict[str, Any]], variant: str) -> list[dict[str, Any]]:
    return [b["extra_info"] for b in benches if b["extra_info"]["variant"] == variant]


def _first(infos: list[dict[str, Any]], key: str) -> Any:
    return next((i[key] for i in infos if i.get(key) is not None), None)


def per_unit_us(
    case: str, benches: list[dict[str, Any]], variant: str, delta: float
) -> float | None:
    """The case's per-unit cost in microseconds, where it has one: P7 per interception, P11
    per leaf, P13 per event written; P12: the hook's median time per leaf."""
    infos = _infos(benches, variant)
    if case == "P7":
        calls = _first(infos, "interceptions_per_round")
        return delta / calls * 1e6 if calls else None
    if case == "P11":
        leaves = _first(infos, "leaves")
        return delta / leaves * 1e6 if leaves else None
    if case == "P12":
        value = _first(infos, "hook_us_median")
        return float(value) if value is not None else None
    if case == "P13":
        events = _first(infos, "events_per_round")
        return delta / events * 1e6 if events else None
    return None


def _unit_goal(case: str, benches: list[dict[str, Any]], variant: str) -> float | None:
    key = {"P11": "goal_us_per_leaf", "P12": "goal_us", "P13": "goal_us_per_event"}.get(case)
    return None if key is None else _first(_infos(benches, variant), key)


def _note(
    case: str,
    benches: list[dict[str, Any]],
    variant: str,
    delta: float,
    spread: float | None,
    floors: dict[Any, float] | None = None,
) -> str:
    infos = _infos(benches, variant)
    unit = per_unit_us(case, benches, variant, delta)
    if case == "P4":
        events = sum(i.get("set_events", 0) for i in infos)
        zero = sum(i.get("zero_copy_events", 0) for i in infos)
        copied = sum(i.get("bytes_copied", 0) for i in infos)
        dur = [i["median_duration_us"] for i in infos if "median_duration_us" in i]
        extra = f", {statistics.median(dur):.0f} µs/leaf in the hook" if dur else ""
        return f"{zero}/{events} set events zero-copy, {copied} bytes copied{extra}"
    if case == "P5":
        size = infos[0].get("bytes", 0) if infos else 0
        return f"{size / 2**20:.0f} MiB per call; Δ {fmt_time(delta, sign=True)} per call"
    if case == "P1":
        armed = sorted(
            {i["armed_leaves_before_step"] for i in infos if "armed_leaves_before_step" in i}
        )
        return f"hooked leaves before the real steps: {armed}" if armed else ""
    if case == "P6":
        mods = sorted({m for i in infos for m in i.get("extra_modules_at_startup", [])})
        return "extra modules at start-up: " + (", ".join(mods) if mods else "none")
    if case == "P7":
        return f"{unit:+.2f} µs per interception" if unit is not None else ""
    if case in ("P9", "P10"):
        base = _infos(benches, benches[0]["extra_info"]["baseline"])
        parts = []
        for name, group in (("unpatched", base), (variant, infos)):
            graphs = sorted({i["graphs"] for i in group if "graphs" in i})
            breaks = sorted({i["graph_breaks"] for i in group if "graph_breaks" in i})
            if graphs or breaks:
                parts.append(f"{name}: graphs {graphs}, breaks {breaks}")
        imports = [
            (name, [t for i in group for t in i.get("import_seconds", [])])
            for name, group in (("unpatched", base), (variant, infos))
        ]
        if all(times for _, times in imports):
            parts.append(
                "imports before the step: "
                + ", ".join(f"{n} {fmt_time(statistics.median(t))}" for n, t in imports)
            )
        armed = sorted(
            {i["armed_leaves_after"] for i in infos if i.get("armed_leaves_after") is not None}
        )
        if armed:
            parts.append(f"armed leaves after the step: {armed}")
        return "; ".join(parts)
    if case == "P11":
        leaves = _first(infos, "leaves") or 0
        text = f"{unit:+.2f} µs/leaf" if unit is not None else ""
        if spread is not None and leaves:
            text += f" (± {spread / leaves * 1e6:.1f} from the block IQR)"
        hook = _first(infos, "hook_us_median")
        if hook is not None:
            text += f"; in the hook {hook:.1f} µs/leaf (set path, traced)"
        arming = _first(infos, "arming_us_per_leaf")
        if arming is not None:
            text += f"; arming {arming:.1f} µs/leaf (its profiler ranges)"
            floor = (floors or {}).get((str(infos[0].get("device", "")), leaves))
            if floor:  # the same run's floor row at the same size: a machine-free reading
                text += f" = {arming / floor:.2f}x torch's floor"
        walk = _first(infos, "floor_walk_us_per_leaf")
        hooks = _first(infos, "floor_hooks_us_per_leaf")
        if walk is not None and hooks is not None:
            text += (
                f"; timed in the step: walk {walk:.1f} + register_prehook/remove {hooks:.1f}"
                f" = {walk + hooks:.1f} µs/leaf"
            )
        if unit is not None and unit < 0 and walk is None:
            text += (
                "; negative: upstream's fake AccumulateGrad, which the patch replaces, costs more"
            )
        return text
    if case == "P12":
        events = sum(i.get("set_events", 0) for i in infos)
        zero = sum(i.get("zero_copy_events", 0) for i in infos)
        copied = sum(i.get("bytes_copied", 0) for i in infos)
        samples = sum(i.get("hook_samples", 0) for i in infos)
        head = (
            f"{unit:.1f} µs/leaf in the hook (median of {samples})"
            if unit is not None
            else (_first(infos, "hook_note") or "no hook timing")
        )
        if variant == "set floor":  # torch alone: no events, nothing to count
            return f"{head}: the least a set path costs here (read the real values, set .grad)"
        label = _first(infos, "grad_label")
        floor = (floors or {}).get((str(infos[0].get("device", "")), label)) if infos else None
        if unit is not None and floor:
            head += f" = {unit / floor:.1f}x the set floor"
        return f"{head}; {zero}/{events} set events zero-copy, {copied} bytes copied"
    if case == "P13":
        events = _first(infos, "events_per_round") or 0
        text = ""
        alternating = _first(infos, "alternating_us_per_event")
        if alternating is not None:
            pairs = _first(infos, "alternating_pairs")
            iqr = _first(infos, "alternating_us_per_event_iqr")
            text = f"{alternating:+.2f} µs/event over {pairs} alternating pairs"
            if iqr:
                text += f" [IQR {iqr[0]:+.1f} to {iqr[1]:+.1f}]"
            ci = _first(infos, "alternating_us_per_event_ci95")
            if ci:
                text += f" (median's 95 % CI {ci[0]:+.1f} to {ci[1]:+.1f})"
            text += "; "
        if unit is not None:
            text += f"{unit:+.2f} µs/event from the block medians"
        return f"{text} ({events} events/round)"
    if case in ("P19", "P20"):
        return _per_op_note(case, benches, variant, delta)
    if case == "P14":
        size = _first(infos, "param_tensors")
        return f"{size} parameter tensors" if size else ""
    return ""


def _per_op_note(case: str, benches: list[dict[str, Any]], variant: str, delta: float) -> str:
    """P19: the extra cost per aten op over eager, ``patched / two-pass`` and ``patched / fake
    floor``, and on the floor's row ``fake floor / two-pass`` (at or above 1, no mode that makes
    FakeTensors beats the seed's two passes on that model: item 5's own floor); P20: each
    variant's cost per aten op (the baseline's beside it), and ``patched / fake floor``."""
    ops = _first(_infos(benches, variant), "aten_ops")
    if not ops:
        return ""
    medians = {
        v: statistics.median(
            [x for b in benches if b["extra_info"]["variant"] == v for x in _data(b)]
        )
        for v in {b["extra_info"]["variant"] for b in benches}
    }
    floor = medians.get("fake floor")
    if case == "P19":
        text = f"{ops} aten ops; {delta / ops * 1e6:+.1f} µs per op over eager"
        if variant == "patched" and medians.get("two-pass"):
            text += f"; patched / two-pass {medians['patched'] / medians['two-pass']:.3f}"
        if variant == "patched" and floor:
            text += f"; patched / fake floor {medians['patched'] / floor:.3f}"
        if variant == "fake floor" and medians.get("two-pass"):
            text += f"; fake floor / two-pass {floor / medians['two-pass']:.3f}"
        return text
    baseline = benches[0]["extra_info"]["baseline"]
    text = (
        f"{ops} aten ops; {medians[variant] / ops * 1e6:.1f} µs per op "
        f"({baseline} {medians[baseline] / ops * 1e6:.1f})"
    )
    if variant == "patched" and floor:
        text += f"; patched / fake floor {medians['patched'] / floor:.2f}"
    return text


def _met(case: str, goal: Any, ratio: float, benches: list[dict[str, Any]], variant: str) -> str:
    if goal is None:
        return "-"
    if isinstance(goal, (int, float)):
        return "yes" if ratio <= goal else "**no**"
    if case == "P4":
        infos = _infos(benches, variant)
        events = sum(i.get("set_events", 0) for i in infos)
        copied = sum(i.get("bytes_copied", 0) for i in infos)
        return "yes" if events and copied == 0 else "**no**"
    unit_goal = _unit_goal(case, benches, variant)
    if unit_goal is not None and case == "P13":
        # the alternating pairs resolve what the block medians cannot (test_trace_end_to_end)
        infos = _infos(benches, variant)
        alternating = _first(infos, "alternating_us_per_event")
        ci = _first(infos, "alternating_us_per_event_ci95")
        if ci:  # judged by the median's confidence interval, not by the point estimate
            if ci[1] <= unit_goal:
                return "yes"
            return "**no**" if ci[0] > unit_goal else "unresolved"
        if alternating is not None:
            return "yes" if alternating <= unit_goal else "**no**"
    if unit_goal is not None:
        base = [b for b in benches if b["extra_info"]["variant"] == b["extra_info"]["baseline"]]
        var = [b for b in benches if b["extra_info"]["variant"] == variant]
        delta = statistics.median([x for b in var for x in _data(b)]) - statistics.median(
            [x for b in base for x in _data(b)]
        )
        unit = per_unit_us(case, benches, variant, delta)
        if unit is None:
            return "?"
        return "yes" if unit <= unit_goal else "**no**"
    return "?"


def _paired(ratios: list[float]) -> str:
    """``median [q1-q3]`` of the per-block ratios (``median [min-max]`` under 4 blocks)."""
    if not ratios:
        return "-"
    mid = statistics.median(ratios)
    if len(ratios) >= 4:
        low, _, high = statistics.quantiles(ratios, n=4)
    else:
        low, high = min(ratios), max(ratios)
    return f"{mid:.3f} [{low:.2f}-{high:.2f}]"


def p11_floors(
    groups: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> dict[tuple[str, int], float]:
    """(device, leaves) -> torch's per-leaf floor (walk + register_prehook/remove, µs) from the
    run's P11 floor rows: arming is also read as a multiple of it, which does not depend on how
    fast the machine is (the absolute goal does)."""
    floors: dict[tuple[str, int], float] = {}
    for (case, device, _detail), benches in groups.items():
        if case != "P11":
            continue
        for bench in benches:
            info = bench["extra_info"]
            walk, hooks = info.get("floor_walk_us_per_leaf"), info.get("floor_hooks_us_per_leaf")
            if walk is not None and hooks is not None and info.get("leaves"):
                floors.setdefault((device, int(info["leaves"])), walk + hooks)  # as _first
    return floors


def p12_floors(
    groups: dict[tuple[str, str, str], list[dict[str, Any]]],
) -> dict[tuple[str, str], float]:
    """(device, gradient size label) -> the set floor's median time in the hook (µs) from the
    run's P12 ``set floor`` rows: the set path is also read as a multiple of it."""
    floors: dict[tuple[str, str], float] = {}
    for (case, device, _detail), benches in groups.items():
        if case != "P12":
            continue
        for info in _infos(benches, "set floor"):
            if info.get("hook_us_median") and info.get("grad_label"):
                floors.setdefault((device, str(info["grad_label"])), float(info["hook_us_median"]))
    return floors


def rows(doc: dict[str, Any]) -> list[list[str]]:
    out: list[list[str]] = []
    groups = group_runs(doc)
    floors: dict[Any, float] = {**p11_floors(groups), **p12_floors(groups)}

    def order(key: tuple[str, str, str]) -> tuple[int, str, str]:
        case, device, detail = key
        rank = CASE_ORDER.index(case) if case in CASE_ORDER else len(CASE_ORDER)
        return (rank, device, detail)

    for key in sorted(groups, key=order):
        case, device, detail = key
        benches = groups[key]
        first = benches[0]["extra_info"]
        baseline, variants = first["baseline"], first["variants"]
        pooled: dict[str, list[float]] = defaultdict(list)
        per_block: dict[tuple[str, int], float] = {}
        for b in benches:
            info = b["extra_info"]
            pooled[info["variant"]].extend(_data(b))
            per_block[(info["variant"], info["block"])] = _median(b)
        if baseline not in pooled:
            continue
        base_median = statistics.median(pooled[baseline])
        for variant in variants:
            if variant == baseline or variant not in pooled:
                continue
            median = statistics.median(pooled[variant])
            ratio = median / base_median
            block_ratios = [
                per_block[(variant, blk)] / per_block[(baseline, blk)]
                for (v, blk) in per_block
                if v == variant and (baseline, blk) in per_block
            ]
            spread = _paired(block_ratios)
            deltas = [
                per_block[(variant, blk)] - per_block[(baseline, blk)]
                for (v, blk) in per_block
                if v == variant and (baseline, blk) in per_block
            ]
            delta_iqr = None
            if len(deltas) >= 4:
                q1, _, q3 = statistics.quantiles(deltas, n=4)
                delta_iqr = (q3 - q1) / 2
            goal = next(
                (
                    b["extra_info"].get("goal")
                    for b in benches
                    if b["extra_info"]["variant"] == variant
                ),
                first.get("goal"),
            )
            out.append(
                [
                    case,
                    device,
                    detail,
                    f"{variant} / {baseline}",
                    fmt_time(base_median),
                    fmt_time(median),
                    f"{ratio:.3f}",
                    spread,
                    "-"
                    if goal is None
                    else (f"≤ {goal:.2f}" if not isinstance(goal, str) else goal),
                    _met(case, goal, ratio, benches, variant),
                    _note(case, benches, variant, median - base_median, delta_iqr, floors),
                ]
            )
    return out


HEADER = [
    "case",
    "device",
    "what",
    "compared",
    "baseline median",
    "variant median",
    "ratio",
    "paired [IQR]",
    "goal",
    "met?",
    "note",
]


def render(doc: dict[str, Any], source: str) -> str:
    meta = doc.get("fakegrad_patch", {})
    machine = doc.get("machine_info", {})
    cpu = machine.get("cpu", {}).get("brand_raw") or machine.get("processor", "?")
    lines = [
        f"### {source}",
        "",
        f"torch {meta.get('torch', '?')} (CUDA build: {meta.get('torch_cuda') or 'no'}, "
        f"CUDA available: {meta.get('cuda_available', '?')}), {meta.get('cpu_count', '?')} CPUs "
        f"({cpu}), torch threads {meta.get('threads', '?')}, {meta.get('blocks', '?')} blocks, "
        f"round scale {meta.get('scale', '?')}"
        + (
            ", SMOKE RUN (1 round per variant: the numbers mean nothing)"
            if meta.get("smoke")
            else ""
        )
        + f", defects detected: {meta.get('defects', '?')}",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
    ]
    table = rows(doc)
    lines += ["| " + " | ".join(r) + " |" for r in table]
    skipped = meta.get("skipped") or []
    if skipped:
        lines += ["", "Skipped:"]
        lines += [f"* {s['case']} {s['device']} {s['detail']}: {s['reason']}" for s in skipped]
    devices = {r[1] for r in table}
    if "cuda" not in devices:
        lines += ["", "No CUDA rows: the CUDA cases were skipped (no CUDA device in this run)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", type=Path, help="--benchmark-json output file(s)")
    args = parser.parse_args(argv)
    for i, path in enumerate(args.json):
        doc = json.loads(path.read_text())
        if i:
            print()
        print(render(doc, path.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
