"""Benchmarks of fakegrad_patch (pytest-benchmark); see docs/performance.md."""
