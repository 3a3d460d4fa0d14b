"""pytest-benchmark harness for fakegrad_patch: devices, paired slots, run order, JSON metadata.

Run (docs/performance.md)::

    python -m pytest benchmarks --benchmark-json=bench-results/bench.json
    python benchmarks/ratios.py bench-results/bench.json

A test takes ``device`` (``cpu``; ``cuda`` only when ``torch.cuda.is_available()``, otherwise
skipped with a reason) and ``slot`` (see _support.py) when it carries ``@pytest.mark.paired(
baseline, other, ..., max_blocks=N)`` (``max_blocks``: cap ``--bench-blocks`` for an expensive
case), and ``size`` when it carries ``@pytest.mark.sizes(full, smoke)`` (the sizes of a
size-parametrized case; ``smoke`` under ``--bench-smoke``). Benchmarks assert nothing about
speed; they only check that each variant really is what it claims to be (patch installed or
not, grads real or fake).

Smoke mode (CI, tests/test_benchmarks_smoke.py)::

    python -m pytest benchmarks --bench-smoke --benchmark-json=smoke.json
    python benchmarks/ratios.py smoke.json

runs every case once per variant (1 block, 1 round, no warm-up, the smallest sizes) and still
writes the JSON (with ``--benchmark-disable`` it runs the same but times nothing): seconds, no
timing asserted, the table's numbers meaningless.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

import fakegrad_patch
from benchmarks import _support

CUDA = torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device (torch.cuda.is_available() is False); CUDA numbers pending"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fakegrad_patch benchmarks")
    group.addoption(
        "--bench-blocks",
        type=int,
        default=8,
        help="paired blocks per case (variants alternate, order reversed every other block; "
        "keep it even so that each variant runs first equally often)",
    )
    group.addoption(
        "--bench-scale",
        type=float,
        default=1.0,
        help="multiplier for every case's rounds (0.2 for a smoke run, 3 for a quiet machine)",
    )
    group.addoption(
        "--bench-smoke",
        action="store_true",
        default=False,
        help="CI smoke run: 1 block, 1 round, no warm-up, the smallest sizes of "
        "size-parametrized cases; checks that the cases run, not their speed",
    )
    group.addoption(
        "--bench-round-budget",
        type=float,
        default=150.0,
        help="seconds: a size-parametrized case whose round is estimated (from its smaller "
        "sizes) to take longer is skipped, with the estimate in the ratio table",
    )
    group.addoption(
        "--bench-threads",
        type=int,
        default=1,
        help="torch.set_num_threads for the run (1: steadier on a shared 2-core machine)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "paired(baseline, *others, max_blocks=None): a paired benchmark case; parametrizes `slot`",
    )
    config.addinivalue_line(
        "markers", "sizes(full, smoke): the sizes of a case; parametrizes `size`"
    )
    _support.SCALE = config.getoption("--bench-scale")
    _support.SMOKE = config.getoption("--bench-smoke")
    _support.ROUND_BUDGET_S = config.getoption("--bench-round-budget")
    torch.set_num_threads(config.getoption("--bench-threads"))
    # Uninitialised or garbage real values (unpatched 2.13, D2) can be denormal; without this
    # they would slow the unpatched side down and flatter the patch.
    torch.set_flush_denormal(True)
    out = json_path(config.getoption("benchmark_json", default=None))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)


def json_path(option: Any) -> Path | None:
    """Where ``--benchmark-json`` writes, whatever pytest-benchmark made of the option: a path
    (5.3 and later parse it with ``type=Path``) or a file it has already opened for writing
    (4.x up to 5.2: ``argparse.FileType('wb')``, so the file, and its folder, exist by now:
    its ``name`` is the path). None when the option is not given, or names no file."""
    if option is None:
        return None
    if isinstance(option, str | os.PathLike):
        return Path(option)
    name = getattr(option, "name", None)  # an open file object
    return Path(name) if isinstance(name, str | os.PathLike) else None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "device" in metafunc.fixturenames:
        metafunc.parametrize(
            "device",
            [
                "cpu",
                pytest.param(
                    "cuda",
                    marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=NO_CUDA_REASON)],
                ),
            ],
        )
    sizes = metafunc.definition.get_closest_marker("sizes")
    chosen: list[int] | None = None
    if sizes is not None and "size" in metafunc.fixturenames:
        full, smoke = sizes.args
        chosen = list(smoke if metafunc.config.getoption("--bench-smoke") else full)
    marker = metafunc.definition.get_closest_marker("paired")
    if marker is not None:
        cap = marker.kwargs.get("max_blocks")
        if chosen is not None:
            # (size, slot) together: an expensive size may run fewer blocks (max_blocks={size: N})
            pairs = [
                (n, s)
                for n in chosen
                for s in _support.slots(
                    tuple(marker.args),
                    blocks_for(metafunc.config, cap.get(n) if isinstance(cap, dict) else cap),
                )
            ]
            metafunc.parametrize("size,slot", pairs, ids=[f"n{n}-{s.id}" for n, s in pairs])
            return
        blocks = blocks_for(metafunc.config, cap)
        case_slots = _support.slots(tuple(marker.args), blocks)
        metafunc.parametrize("slot", case_slots, ids=[s.id for s in case_slots])
    elif chosen is not None:
        metafunc.parametrize("size", chosen, ids=[f"n{n}" for n in chosen])


def blocks_for(config: pytest.Config, max_blocks: int | None) -> int:
    """``--bench-blocks``, capped by the case's ``max_blocks``; 1 under ``--bench-smoke``."""
    blocks = 1 if config.getoption("--bench-smoke") else config.getoption("--bench-blocks")
    return blocks if max_blocks is None else max(1, min(blocks, max_blocks))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run one case's slots back to back, in slot order (pytest's own order interleaves the
    parametrizations differently); cases keep their collection order."""

    def case_key(item: pytest.Item) -> tuple[Any, ...]:
        spec = getattr(item, "callspec", None)
        params = {} if spec is None else {k: v for k, v in spec.params.items() if k != "slot"}
        return (item.path, getattr(item, "originalname", item.name), repr(sorted(params.items())))

    first_seen: dict[tuple[Any, ...], int] = {}
    for index, item in enumerate(items):
        first_seen.setdefault(case_key(item), index)

    def slot_order(item: pytest.Item) -> int:
        spec = getattr(item, "callspec", None)
        slot = None if spec is None else spec.params.get("slot")
        return 0 if slot is None else slot.order

    items.sort(key=lambda item: (first_seen[case_key(item)], slot_order(item)))


@pytest.fixture(autouse=True, scope="module")
def _module_cache() -> Any:
    """Models and tensors shared by a module's slots are freed when the module is done."""
    yield
    _support.clear_cache()


@pytest.fixture(autouse=True)
def _restore_state() -> Any:
    """Each benchmark leaves the patch installed and the trace as it found them."""
    from fakegrad_patch import trace

    config = trace.current_config() if hasattr(trace, "current_config") else None
    yield
    fakegrad_patch.install()
    if config is not None:
        trace.restore(config)


def pytest_benchmark_update_json(config: pytest.Config, benchmarks: Any, output_json: dict) -> None:
    """Record what the ratios depend on: torch build, threads, defects the patch detected."""
    output_json["fakegrad_patch"] = {
        "version": fakegrad_patch.__version__,
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": CUDA,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "blocks": blocks_for(config, None),
        "scale": config.getoption("--bench-scale"),
        "smoke": config.getoption("--bench-smoke"),
        "defects": _support.defects(),
        "skipped": list(_support.SKIPPED),
    }
