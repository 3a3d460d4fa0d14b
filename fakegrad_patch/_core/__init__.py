"""The fix itself: what the patch puts into torch and what runs there, in the order a real tensor,
an op and a gradient meet it (docs/how-it-works.md, "The house"):

* ``install/``: ``install()``/``uninstall()``/``configure()``/``status()`` (``__init__``), one
  application of the patch that builds the parts and puts their wrappers in place
  (``applied``), and what is measured at first need (``first_need``);
* ``touchpoints/``: every private torch touch point with its banner (``targets``), the behaviour
  probes (``probes``), and the wrappers put in place only while needed (``sites``);
* ``convert/``: real tensors entering a propagating mode: the converter wrapper (``values``),
  the records of conversions and copies (``records``), per-leaf bookkeeping (``leaves``) and
  ``from_tensor`` fake leaves (``fakeleaves``);
* ``dispatch/``: every op of a propagating user mode: the one wrapper of
  ``FakeTensorMode.dispatch`` (``wrapper``) and the parts it calls (the fast path, upstream's
  path with its repairs, nested ops, refused ops, methods, the write-back watch);
* ``accumulate/``: gradients reaching real leaves: the backward interception (``arming``), the
  AccumulateGrad pre-hook (``hooks``), DDP/FSDP2 inside a mode (``ddp``), profiler ranges;
* ``state``, ``weak``, ``typing``: what every part may read: the one warning per process and
  the installation in force, the O(1) weak registries, the narrow collaborators' Protocols.

Imports only go down (tests/test_layout.py ranks every module).
"""
