"""Issue 19.2: every registry costs O(1) amortized per operation at any model size.

v0.2 rebuilt a registry on every conversion once more than 4,096 entries were alive (20,000
Parameters: a patched fake step 1.96x the unpatched one). Registries are now
:class:`fakegrad_patch._core.weak.WeakIdTable` s, whose only O(n) operation is ``items()`` (used by
``uninstall()``); these tests count O(n) work during fake steps of a model with 6,000 parameter
tensors (past v0.2's 4,096 threshold) instead of timing it, so they cannot pass by luck on a fast
machine or fail on a loaded one. The timing is in benchmarks (docs/performance.md, scaling row).
"""

from __future__ import annotations

import gc

import pytest
import torch
from _helpers import fake_mode, is_real

from fakegrad_patch._core import weak as _weak
from fakegrad_patch._core.accumulate import arming as _arming
from fakegrad_patch._core.convert import leaves as _leaves
from fakegrad_patch._core.convert import records as _records

pytestmark = pytest.mark.usefixtures("propagate")

N = 6_000


class _Many(torch.nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.ps = torch.nn.ParameterList(
            torch.nn.Parameter(torch.full((2,), 0.5)) for _ in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum((p * x).sum() for p in self.ps)  # type: ignore[return-value]


@pytest.mark.slow  # 6,000 tensors: over a minute on 2 cores (the quick tier leaves it out)
def test_no_registry_is_rebuilt_or_scanned_during_fake_steps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _Many(N)
    x = torch.tensor([1.0, 2.0])
    scans = 0
    items = _weak.WeakIdTable.items

    def counting_items(self: _weak.WeakIdTable) -> object:  # type: ignore[type-arg]
        nonlocal scans
        scans += 1
        return items(self)

    monkeypatch.setattr(_weak.WeakIdTable, "items", counting_items)
    prunes = 0
    prune = _arming._prune_lasting

    def counting_prune() -> None:
        nonlocal prunes
        prunes += 1
        prune()

    monkeypatch.setattr(_arming, "_prune_lasting", counting_prune)
    mode = fake_mode()
    for _ in range(3):  # new fakes each step: conversions, records, managed grads
        with mode:
            model(x).backward()
    assert scans == 0 and prunes == 0
    assert all(is_real(p.grad) for p in model.ps)
    torch.testing.assert_close(model.ps[0].grad, 3 * x)
    conv = mode.fake_tensor_converter
    table = _records.lookup(conv)
    assert table is not None and N <= len(table) <= N + 16  # one record per live source tensor
    assert len(_leaves._grads) >= N  # every managed grad known ...
    del model
    gc.collect()
    assert len(table) <= 16  # ... and forgotten with its tensor, without any scan
    assert scans == 0


def test_weak_id_table_forgets_dead_keys_and_survives_id_reuse() -> None:
    table: _weak.WeakIdTable[int] = _weak.WeakIdTable()
    keep = [torch.zeros(1) for _ in range(1000)]
    for i, t in enumerate(keep):
        table.set(t, i)
    for _ in range(50):  # churn: dead entries never accumulate, reused ids never alias
        tmp = [torch.zeros(1) for _ in range(100)]
        for t in tmp:
            assert table.get(t) is None
            table.set(t, -1)
        del tmp, t  # freed here, by reference counting: no collection needed (nor run)
        assert len(table) == 1000
    gc.collect()
    assert len(table) == 1000
    assert [table.get(t) for t in keep] == list(range(1000))
    # the batch lookup arming uses agrees with get(), dead ids reused by new objects included
    fresh = [torch.zeros(1) for _ in range(100)]
    assert table.get_many([*keep[:10], *fresh]) == [*range(10), *[None] * 100]
    assert table.get_many([]) == []
