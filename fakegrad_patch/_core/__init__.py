"""The fix itself: what the patch puts into torch and what runs there.

Layers, lowest first (imports only go down; tests/test_layout.py):

* ``state``, ``weak``, ``targets``: the one-warning-per-process helper and the installation in
  force, the O(1) weak registries, and every private torch touch point (with its banner);
* ``leaves``, ``probes``: per-leaf bookkeeping (names, write locks, managed gradients) and the
  behaviour probes (D1, D2, D4, D5, P1);
* ``values`` (the converter wrapper), ``arming`` (the backward interception), ``accumulate``
  (the AccumulateGrad rule), ``writeback`` (in-place updates of real tensors inside a mode),
  ``ddp`` (DistributedDataParallel and FSDP2 inside a mode), ``mismatch`` (propagation's
  metadata errors said plainly);
* ``fakeleaves``: ``from_tensor`` fake leaves (grad-copy repair, ``mirror_to_sources``);
* ``install``: ``install()``/``uninstall()``/``configure()``/``patched()``, which build and remove
  all of the above.
"""
