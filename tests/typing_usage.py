"""Type-checked usage of the public API, the way a user's code calls it (mypy, not pytest).

``mypy`` (configured in pyproject.toml) checks this file with the package: each ``assert_type``
pins a public signature's types, and each ``type: ignore[...]`` marks a misuse that mypy must
reject (``warn_unused_ignores`` turns an accepted misuse into an error). Nothing here runs at
import; ``python tests/typing_usage.py`` runs ``main()`` as a smoke check.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

import torch

import fakegrad_patch
from fakegrad_patch import Buffers, FakeGradError, FakeGradPatchWarning, OnMissing, Settings

if TYPE_CHECKING:
    from typing_extensions import assert_type
else:

    def assert_type(value: object, _type: object) -> object:
        return value


def main() -> None:
    assert_type(fakegrad_patch.install(), bool)
    assert_type(fakegrad_patch.uninstall(), bool)
    assert_type(fakegrad_patch.is_installed(), bool)
    assert_type(fakegrad_patch.status(), dict[str, Any])

    previous = fakegrad_patch.configure(on_missing="zeros")
    assert_type(previous, Settings)
    policy: OnMissing = previous.on_missing
    fakegrad_patch.configure(on_missing=policy)
    assert_type(fakegrad_patch.settings(), Settings)
    with contextlib.suppress(ValueError):  # rejected at run time too
        fakegrad_patch.configure(on_missing="bogus")  # type: ignore[arg-type]
    buffers: Buffers = fakegrad_patch.configure(buffers="write_back").buffers
    fakegrad_patch.configure(buffers=buffers)
    with contextlib.suppress(ValueError):
        fakegrad_patch.configure(buffers="copy")  # type: ignore[arg-type]
    with fakegrad_patch.patched(buffers="write_back"):
        pass
    assert fakegrad_patch.BUFFERS_VALUES == ("upstream", "write_back")

    model = torch.nn.Linear(3, 2)
    assert_type(fakegrad_patch.name_parameters(model, prefix="model."), int)
    with contextlib.suppress(AttributeError, TypeError):
        fakegrad_patch.name_parameters("not a module")  # type: ignore[arg-type]

    with fakegrad_patch.patched(on_missing="error"):
        pass
    with (
        contextlib.suppress(ValueError),
        fakegrad_patch.patched(on_missing="sometimes"),  # type: ignore[arg-type]
    ):
        pass
    if TYPE_CHECKING:  # needs a FakeTensorMode at run time
        mirror = fakegrad_patch.mirror_to_sources(object())
        assert_type(mirror, contextlib.AbstractContextManager[None])
    fakegrad_patch.materialize([torch.zeros(1)], on_missing="drop", copy=True)

    assert issubclass(FakeGradError, RuntimeError)
    assert issubclass(FakeGradPatchWarning, Warning)
    assert fakegrad_patch.ON_MISSING_VALUES


if __name__ == "__main__":
    main()
    print("ok")
