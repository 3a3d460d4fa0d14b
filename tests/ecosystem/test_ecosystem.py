"""Real-world models (torchvision, timm, Hugging Face transformers, built from configs with random
init) train under a propagating FakeTensorMode with the patch exactly like eager.

Two comparisons per model: ``fakegrad_patch.verify`` (two steps, the second accumulating into the
kept ``.grad`` objects), and our own loop (two optimizer steps of two accumulated micro-batches,
no ``verify`` code, see _eco_train.py). A library that is not installed (or does not import beside
this torch build) skips its cases with the reason. The last test proves the independent comparison
fails on every case with the patch uninstalled.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
from typing import Any
from xml.etree import ElementTree

import _eco_train
import _eco_zoo
import pytest
import torch
import torch._functorch.config as functorch_config
from torch import nn

import fakegrad_patch
from fakegrad_patch._tools.verify import VerifyError

HERE = pathlib.Path(__file__).resolve().parent

#: The buffers the fake mode does not update (upstream semantics, docs/compatibility.md): any
#: other buffer that differs from eager is a failure.
NOT_WRITTEN_BACK = ("running_mean", "running_var")


def _params() -> list[Any]:
    """One param per case; the known upstream failures xfail strictly, and only with their own
    exception (anything else raised fails the test)."""
    from torch._subclasses import fake_tensor

    out = []
    for case in _eco_zoo.CASES:
        marks = []
        if case.xfail:
            # older builds (2.4) name no such exception; their cases skip anyway (no libraries)
            raises = getattr(fake_tensor, str(case.xfail_raises), None)
            if raises is None:
                marks.append(pytest.mark.skip(reason=f"this torch has no {case.xfail_raises}"))
            else:
                marks.append(pytest.mark.xfail(strict=True, reason=case.xfail, raises=raises))
        out.append(pytest.param(case.name, marks=marks, id=case.name))
    return out


def _import_error(library: str) -> str | None:
    """Why ``library`` cannot be used here (not installed, or does not import beside this torch
    build, e.g. torchvision's C++ ops built for another torch), or None."""
    try:
        __import__(library)
    except Exception as exc:
        missing = isinstance(exc, ModuleNotFoundError) and exc.name == library
        if missing:
            return f"{library} is not installed"
        return f"{library} does not import with torch {torch.__version__}: {exc!r:.200}"
    return None


def _build(name: str) -> _eco_zoo.Built:
    case = _eco_zoo.BY_NAME[name]
    why = _import_error(case.library)
    if why is not None:
        pytest.skip(why)
    pytest.importorskip(case.library)
    return case.build()


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("name", _params())
def test_trains_like_eager_through_verify(name: str) -> None:
    built = _build(name)
    try:
        report = _eco_train.run_verify(built)
    except VerifyError as exc:  # what the fake mode raised (upstream): the xfails' `raises`
        raise (exc.__cause__ or exc) from exc
    assert report.ok, report.format()
    rows = report.parameters
    assert len(rows) == len(list(built.model.parameters())) > 0
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    for p in rows:
        # frozen parameters: no gradient in either run; every other: a real one, like eager's
        expected = "real" if p.name in trainable else "none"
        assert p.grad == p.eager_grad, p
        if expected == "real" and p.eager_grad == "none":  # unused in the graph (BERT's pooler)
            continue
        assert p.grad == expected, p
        if expected == "real":
            assert p.grad_strides == p.eager_grad_strides, p
            assert p.identity == p.eager_identity == "kept", p  # zero_grad="zeros"
            assert set(p.outcomes) <= {"set", "accumulate"} and p.outcomes, p
            assert p.value_max_abs is not None, p
    differing = {b.name for b in report.buffers if not b.matches}
    assert all(b.endswith(NOT_WRITTEN_BACK) for b in differing), report.format()
    assert len(report.losses) == _eco_train.STEPS


@pytest.mark.filterwarnings("ignore::fakegrad_patch.FakeGradPatchWarning")
@pytest.mark.parametrize("name", _params())
def test_trains_like_eager_independently(name: str) -> None:
    built = _build(name)
    timing = _eco_train.independent_comparison(built)
    n_params = len(list(built.model.parameters()))
    # every parameter after each of 2x2 backwards and each of 2 optimizer steps
    assert timing.compared == n_params * _eco_train.STEPS * (len(built.batches) + 1)


def test_every_case_has_a_library_a_builder_and_a_unique_name() -> None:
    names = [c.name for c in _eco_zoo.CASES]
    assert len(names) == len(set(names)) and 15 <= len(names) <= 25
    assert {c.library for c in _eco_zoo.CASES} == set(_eco_zoo.LIBRARIES)
    for case in _eco_zoo.CASES:
        assert (case.xfail is None) == (case.xfail_raises is None), case.name


@pytest.mark.parametrize("norm", ["LayerNorm", "BatchNorm2d"])
def test_cpu_autocast_norm_upstream_repro(norm: str) -> None:
    """The upstream limit the patch repairs for the autocast cases (issue 39), without any
    library and with the patch uninstalled: CPU autocast(bfloat16) + a norm layer under
    propagation raises MetadataMismatchError. When this test fails, upstream fixed it. It runs
    where the torchvision autocast case runs (other builds may behave otherwise)."""
    why = _import_error("torchvision")
    if why is not None:
        pytest.skip(f"backs the torchvision xfail case: {why}")
    from torch._subclasses.fake_tensor import FakeTensorMode, MetadataMismatchError

    fakegrad_patch.uninstall()
    torch.manual_seed(0)
    if norm == "LayerNorm":
        model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        x = torch.randn(2, 8)
    else:
        model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.BatchNorm2d(8))
        x = torch.randn(2, 3, 4, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()  # eagerly fine
    with (
        functorch_config.patch(fake_tensor_propagate_real_tensors=True),
        FakeTensorMode(allow_non_fake_inputs=True),
        torch.autocast("cpu", dtype=torch.bfloat16),
        pytest.raises(MetadataMismatchError),
    ):
        model(x)


@pytest.mark.slow
def test_independent_comparison_fails_without_the_patch(tmp_path: pathlib.Path) -> None:
    """Can-fail proof: with the patch uninstalled (FAKEGRAD_TEST_UNPATCHED=1) every case of the
    independent comparison fails with a Mismatch (upstream leaves FakeTensors in .grad), except
    the xfails, which fail for their upstream reason patched or not, and the cases whose library
    does not import here (skipped)."""
    usable = {c.name for c in _eco_zoo.CASES if _import_error(c.library) is None}
    if not usable:
        pytest.skip("none of the zoo's libraries imports here")
    report = tmp_path / "unpatched.xml"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_ecosystem.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-k",
            "test_trains_like_eager_independently",
            f"--junitxml={report}",
        ],
        cwd=HERE,
        env={**os.environ, "FAKEGRAD_TEST_UNPATCHED": "1"},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert out.returncode == 1, out.stdout[-3000:]
    outcomes: dict[str, tuple[str, str]] = {}  # case -> (outcome, message)
    for case in ElementTree.parse(report).iter("testcase"):
        name = case.get("name", "").removeprefix("test_trains_like_eager_independently[")
        child = next(iter(case), None)  # none: passed; failure, error or skipped
        kind = "passed" if child is None else child.tag
        if kind == "skipped" and child is not None and child.get("type") == "pytest.xfail":
            kind = "xfail"
        outcomes[name.rstrip("]")] = (kind, "" if child is None else child.get("message", ""))
    assert set(outcomes) == {c.name for c in _eco_zoo.CASES}, outcomes
    for case in _eco_zoo.CASES:
        kind, message = outcomes[case.name]
        if case.name not in usable:
            assert kind == "skipped", (case.name, kind, message)
        elif case.xfail:
            assert kind == "xfail" and message.startswith("upstream"), (case.name, kind, message)
        else:  # the comparison caught the fake or wrong gradient
            assert kind == "failure" and "Mismatch" in message, (case.name, kind, message)
