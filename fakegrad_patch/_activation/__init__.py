"""How the patch gets switched on without code changes: the start-up hook (``hooks/``: the
``.pth``/``.start`` files and the stdlib-only module they call, placed at the root of
site-packages by the wheel), the ``sitecustomize`` route, and the pytest plugin (``hooks/``, a
top-level module too). See docs/activation.md."""
