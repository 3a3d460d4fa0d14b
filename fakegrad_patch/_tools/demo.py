"""``python -m fakegrad_patch demo``: one training step of a real model inside FakeTensorMode.

The same small conv net is trained one step three times from the same weights:

* eager: the reference gradients and updated weights;
* unpatched: parameters inside ``FakeTensorMode(allow_non_fake_inputs=True)`` with real-value
  propagation on, upstream torch: the parameters receive FakeTensor gradients and SGD does nothing;
* patched: the same with fakegrad_patch installed, and ``buffers="write_back"`` (the setting the
  patch recommends for models with BatchNorm: the running statistics the forward updates in
  place reach the real buffers, as in eager mode): real gradients land on the parameters, equal
  to eager, the step moves the weights like eager, and the buffers end as eager's.

It prints the three side by side, then the trace of the patched run as ``python -m fakegrad_patch
trace`` summarizes it. Exit status 0 only when the patched run matches eager.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings
from typing import Any


def _model() -> Any:
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(4),
        torch.nn.Flatten(),
        torch.nn.Linear(8 * 4 * 4, 32),
        torch.nn.LayerNorm(32),
        torch.nn.GELU(),
        torch.nn.Linear(32, 10),
    )


def _step(model: Any, x: Any, y: Any, *, fake: bool) -> None:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if fake:
        with FakeTensorMode(allow_non_fake_inputs=True):
            torch.nn.functional.cross_entropy(model(x), y).backward()
    else:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()  # outside the mode, as a training loop would


def _describe(grad: Any, eager: Any) -> str:
    from torch._subclasses.fake_tensor import FakeTensor

    if grad is None:
        return "None (lost)"
    if isinstance(grad, FakeTensor):
        return "FakeTensor (no values)"
    diff = (grad.double() - eager.double()).abs().max().item()
    return f"real {grad.device.type}/{str(grad.dtype).removeprefix('torch.')} |d|={diff:.1e}"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m fakegrad_patch demo", description=__doc__)
    parser.add_argument("--trace", metavar="PATH", help="keep the patched run's JSONL trace here")
    args = parser.parse_args(argv)

    # torch 2.14 without numpy prints a warning at import; it is noise for this demonstration.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy")
    import torch
    import torch._functorch.config as functorch_config
    from torch._subclasses.fake_tensor import FakeTensor

    import fakegrad_patch
    from fakegrad_patch import trace
    from fakegrad_patch.trace import _reader as _trace_reader

    print(f"torch {torch.__version__}; model: conv + batchnorm + MLP, one SGD step, batch of 4")
    torch.manual_seed(1)
    x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    base = _model()
    eager, unpatched, patched = (copy.deepcopy(base) for _ in range(3))
    fakegrad_patch.name_parameters(patched)

    _step(eager, x, y, fake=False)
    with functorch_config.patch(fake_tensor_propagate_real_tensors=True):
        fakegrad_patch.uninstall()
        _step(unpatched, x, y, fake=True)
        trace_path = args.trace or os.path.join(tempfile.mkdtemp(), "fakegrad-demo.jsonl")
        previous = trace.configure_trace(path=trace_path, level="info")
        try:
            with fakegrad_patch.patched(buffers="write_back"):
                _step(patched, x, y, fake=True)
        finally:
            trace.restore(previous)

    ok = True
    rows = [("parameter", "eager |grad|max", "unpatched .grad", "patched .grad vs eager", "step")]
    for (name, p_eager), p_un, p_pa, p_base in zip(
        eager.named_parameters(),
        unpatched.parameters(),
        patched.parameters(),
        base.parameters(),
        strict=True,
    ):
        g = p_eager.grad
        matches = (
            p_pa.grad is not None
            and not isinstance(p_pa.grad, FakeTensor)
            and torch.allclose(p_pa.grad, g, atol=1e-5, rtol=1e-4)
        )
        moved_like_eager = torch.allclose(p_pa.detach(), p_eager.detach(), atol=1e-5, rtol=1e-4)
        unpatched_moved = not torch.equal(p_un.detach(), p_base.detach())
        ok = ok and matches and moved_like_eager
        rows.append(
            (
                name,
                f"{g.abs().max().item():.3e}",
                _describe(p_un.grad, g) + (" moved" if unpatched_moved else " stuck"),
                _describe(p_pa.grad, g),
                "== eager" if moved_like_eager else "!= eager",
            )
        )
    for (name, b_eager), b_un, b_pa in zip(
        eager.named_buffers(), unpatched.buffers(), patched.buffers(), strict=True
    ):
        if not b_eager.dtype.is_floating_point:
            continue  # num_batches_tracked: an all-real op, right in every run
        same = torch.equal(b_pa, b_eager)
        ok = ok and same
        rows.append(
            (
                f"{name} (buffer)",
                f"{b_eager.abs().max().item():.3e}",
                "== eager" if torch.equal(b_un, b_eager) else "stale (update lost)",
                "== eager (buffers='write_back')" if same else "!= eager",
                "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))

    print(f"\ntrace of the patched run ({trace_path}):")
    _trace_reader.main([trace_path])
    print(
        "\nresult:",
        "patched gradients, SGD step and BatchNorm statistics equal eager"
        if ok
        else "MISMATCH (please report)",
    )
    sys.stdout.flush()
    return 0 if ok else 1
