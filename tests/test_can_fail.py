"""Proof that the behaviour tests can fail: run them against upstream torch (patch uninstalled by
``FAKEGRAD_TEST_UNPATCHED=1``, see conftest.py) and check that they do."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent

MUST_FAIL_UPSTREAM = {
    "test_materialize.py::test_mlp_parameters_equal_eager[cpu]",
    "test_materialize.py::test_prior_real_grad_is_accumulated_in_place[cpu]",
    "test_materialize.py::test_conv_channels_last_follows_layout_contract[cpu]",
    "test_materialize.py::test_leaf_reached_only_through_real_graph_d3[cpu]",
    "test_materialize.py::test_set_path_takes_over_propagated_buffer_without_copy",
    "test_materialize.py::test_threads_each_with_their_own_mode",
    "test_interplay.py::test_activation_checkpointing[True]",
    "test_interplay.py::test_optimizer_step_after_patched_fake_backward_moves_parameters",
}
MUST_PASS_UPSTREAM = {  # they pin upstream behaviour that the patch leaves alone
    "test_interplay.py::test_real_gradients_after_the_block_are_left_to_autograd",
    "test_interplay.py::test_autograd_grad_keeps_working_and_leaves_grad_untouched",
}


@pytest.mark.slow
def test_behaviour_tests_fail_without_the_patch() -> None:
    env = {**os.environ, "FAKEGRAD_TEST_UNPATCHED": "1"}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_materialize.py",
            "test_interplay.py",
            "-q",
            "-rA",
            "-p",
            "no:cacheprovider",
        ],
        cwd=HERE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert out.returncode == 1, out.stdout[-3000:]
    failed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("FAILED ")}
    passed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("PASSED ")}
    assert failed >= MUST_FAIL_UPSTREAM, MUST_FAIL_UPSTREAM - failed
    assert passed >= MUST_PASS_UPSTREAM, MUST_PASS_UPSTREAM - passed
