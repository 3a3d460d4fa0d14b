"""PT2 coexistence (tests/test_pt2_coexistence.py) for the programs that compile with inductor:
``torch.compile(backend="inductor")`` training and compiled autograd on inductor, each in fresh
interpreters with and without the patch, compared bit for bit, and the patch staying out.

A file of its own so that CI can run these groups on fewer builds than the rest: each group
compiles C++ kernels twice per build (patched and unpatched, cold caches: ~40 s of CPU each on a
2-core machine). They run on the newest build (2.15.0) of the CI command (tox.ini,
``FAKEGRAD_TEST_ELSEWHERE`` in oldest, torch213 and torch214; tests/test_readme.py checks it;
until run 32 on the oldest, 2.4.0, too); every other PT2 group runs on every build: the inductor
programs take the same stand-aside path (a tracer's mode, with a ShapeEnv) as they do.
"""

from __future__ import annotations

import pytest
from test_pt2_coexistence import INDUCTOR_NAMES, _Runs, _same_behaviour, _stays_out
from test_pt2_coexistence import runs as runs  # the session's records (a fixture)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("name", INDUCTOR_NAMES)
def test_same_behaviour(runs: _Runs, name: str) -> None:
    _same_behaviour(name, *runs.get(name))


@pytest.mark.parametrize("name", INDUCTOR_NAMES)
def test_patch_stays_out(runs: _Runs, name: str) -> None:
    _stays_out(name, *runs.get(name))
