"""Start-up activation: ``FAKEGRAD_PATCH=1 python app.py`` with no change to the program.

Installed at the root of site-packages as the top-level module ``_fakegrad_patch_startup`` (hatch
``force-include``), next to ``fakegrad_patch.pth`` and ``fakegrad_patch.start`` which call
:func:`init`. Why not a module inside the package: importing ``fakegrad_patch.<anything>`` first
runs ``fakegrad_patch/__init__``, which imports wrapt and installs the patch, while a PEP 829
``.start`` entry point (Python 3.15+) is imported on every start, so the check of the variable has
to live in a module that imports nothing of ours. Standard library only (``os``, ``sys``: both
already loaded by ``site``). ``fakegrad_patch._startup`` gives the package access to this module
(and loads it from this file when the package is reached through PYTHONPATH).

The ``.pth`` line checks the variable itself before importing even this module, so with the
variable unset, empty or off an interpreter start costs reading one short ``.pth`` line.

Guarantees (docs/activation.md): values are parsed strictly; anything unknown prints one line on
stderr and activates nothing; no exception leaves :func:`init`; a ``.pth`` seen twice (or the
variable plus an explicit ``import fakegrad_patch``) applies the patch once.
"""

import os
import sys

#: The switch. Values are case-insensitive and stripped of surrounding blanks.
ENV = "FAKEGRAD_PATCH"
ON_VALUES = ("1", "true", "yes", "on")
OFF_VALUES = ("", "0", "false", "no", "off")

#: This module's name at the root of site-packages (see the module docstring).
TOPLEVEL_MODULE = "_fakegrad_patch_startup"
#: Start-up hook file names at the root of site-packages. PEP 829: a ``.start`` file with the
#: same stem as a ``.pth`` file disables the ``.pth``'s import lines on Python 3.15+, so the
#: two never both run.
PTH_NAME = "fakegrad_patch.pth"
START_NAME = "fakegrad_patch.start"

#: The single line of ``fakegrad_patch.pth``. ``os`` is already imported by ``site``; with the
#: switch off nothing else is imported. tests/test_activation.py pins the shipped file to this.
PTH_LINE = (
    f'import os; os.environ.get("{ENV}", "").strip().lower() in {OFF_VALUES!r} '
    f'or __import__("{TOPLEVEL_MODULE}").init()'
)
#: The entry point of ``fakegrad_patch.start`` (PEP 829 ``pkg.mod:callable``).
START_ENTRY = f"{TOPLEVEL_MODULE}:init"

#: Marker ending the sitecustomize line, so ``--append`` can find (and upgrade) it.
SITECUSTOMIZE_MARKER = "# fakegrad_patch start-up hook"

_PREFIX = "fakegrad_patch: "

#: What happened in this process (read by ``python -m fakegrad_patch doctor`` and the tests).
#: ``handled``: the hook ran once already (a second ``.pth`` or call is a no-op);
#: ``value``: the raw variable seen; ``deferred``: waiting for the end of ``site``;
#: ``activated_by``: "pth" / "sitecustomize" once ``fakegrad_patch`` was imported and installed;
#: ``error``: the one line printed when activation failed.
state: dict = {
    "handled": False,
    "value": None,
    "deferred": False,
    "activated_by": None,
    "error": None,
}


def parse(raw: "str | None") -> "bool | None":
    """``True`` for 1/true/yes/on, ``False`` for unset/empty/0/false/no/off, ``None`` otherwise."""
    value = (raw or "").strip().lower()
    if value in ON_VALUES:
        return True
    if value in OFF_VALUES:
        return False
    return None


def invalid_message(raw: str) -> str:
    """The one stderr line for a value that is neither on nor off."""
    return (
        f"{_PREFIX}{ENV}={raw!r} not understood (expected one of "
        f"{'/'.join(ON_VALUES)} or {'/'.join(v for v in OFF_VALUES if v)}); not activated"
    )


def sitecustomize_line() -> str:
    """The line users add to their own ``sitecustomize.py`` when ``.pth`` files are not processed
    (package reached through PYTHONPATH). Same checks as the ``.pth`` line, with the parsing
    inline because this route imports ``fakegrad_patch._startup`` (hence the package, which
    installs the patch) and must only do so for an "on" value. Printed and appended by
    ``python -m fakegrad_patch sitecustomize [--append [PATH]]``."""
    return (
        f'import os, sys; _fgp = os.environ.get("{ENV}", "").strip().lower(); '
        f"_fgp in {OFF_VALUES!r} or ("
        f'__import__("fakegrad_patch._startup")._startup.activate("sitecustomize") '
        f"if _fgp in {ON_VALUES!r} else "
        f'print("{_PREFIX}{ENV}=%r not understood; not activated" % _fgp, file=sys.stderr))  '
        f"{SITECUSTOMIZE_MARKER}"
    )


def _say(message: str) -> None:
    """One line on stderr, never raising (stderr may be closed or None at start-up)."""
    # Not contextlib.suppress: importing contextlib would cost every start-up.
    try:  # noqa: SIM105
        print(message, file=sys.stderr, flush=True)
    except Exception:
        pass


def init() -> None:
    """Entry point of ``fakegrad_patch.pth`` and ``fakegrad_patch.start``. Never raises."""
    try:
        _init()
    except Exception as exc:
        state["error"] = (
            f"{_PREFIX}start-up hook failed ({type(exc).__name__}: {exc}); not activated"
        )
        _say(state["error"])


def _init() -> None:
    if state["handled"]:
        return  # the same hook seen twice (two site dirs, .pth and .start, ...)
    state["handled"] = True
    raw = os.environ.get(ENV)
    state["value"] = raw
    flag = parse(raw)
    if flag is None:
        _say(invalid_message(raw or ""))
        return
    if not flag:
        return
    if _inside_site_main() and _defer_to_end_of_site():
        state["deferred"] = True
        return
    activate("pth")


def _inside_site_main() -> bool:
    """True while ``site.main()`` is processing ``.pth`` files (i.e. at interpreter start)."""
    site = sys.modules.get("site")
    code = getattr(getattr(site, "main", None), "__code__", None)
    getframe = getattr(sys, "_getframe", None)
    if code is None or getframe is None:
        return False
    frame = getframe(1)
    while frame is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _defer_to_end_of_site() -> bool:
    """Run the activation as the last step of ``site``, once sys.path is complete.

    ``.pth`` files are processed in name order, part way through site initialisation: a later
    ``.pth`` may be what makes wrapt or torch importable. ``site.main()`` ends by loading
    ``sitecustomize`` then, when user site-packages are enabled, ``usercustomize``; both loaders
    are wrapped (plain closures: wrapt cannot be imported yet), the first acting only when the
    second will not run. Same approach as autowrapt's bootstrap.
    """
    site = sys.modules.get("site")
    exec_site = getattr(site, "execsitecustomize", None)
    exec_user = getattr(site, "execusercustomize", None)
    if site is None or not callable(exec_site) or not callable(exec_user):
        return False

    def execsitecustomize() -> None:
        try:
            exec_site()
        finally:
            if not getattr(site, "ENABLE_USER_SITE", False):
                _activate_deferred()

    def execusercustomize() -> None:
        try:
            exec_user()
        finally:
            _activate_deferred()

    site.execsitecustomize = execsitecustomize  # type: ignore[attr-defined]
    site.execusercustomize = execusercustomize  # type: ignore[attr-defined]
    return True


def _activate_deferred() -> None:
    if state["deferred"]:
        state["deferred"] = False
        activate("pth")


def activate(origin: str) -> bool:
    """Import ``fakegrad_patch`` (which installs the patch, lazily: torch is not imported here)
    and read its settings so that an invalid ``FAKEGRAD_ON_MISSING`` is reported at start.
    Returns True on success; on any failure prints one line on stderr and returns False."""
    try:
        import fakegrad_patch

        fakegrad_patch.install()
        fakegrad_patch.settings()
    except Exception as exc:
        state["error"] = (
            f"{_PREFIX}not activated ({origin}): {type(exc).__name__}: {exc}; "
            "the program continues without the patch"
        )
        _say(state["error"])
        return False
    state["handled"] = True
    if state["activated_by"] is None:
        state["activated_by"] = origin
    return True
