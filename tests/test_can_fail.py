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
    "test_correctness.py::test_gradients_summed_in_the_engine_input_buffer_still_reach_the_pre_hook[2]",
    "test_correctness.py::test_gradients_summed_in_the_engine_input_buffer_still_reach_the_pre_hook[5]",
    "test_correctness.py::test_in_place_ops_on_real_grads_inside_the_mode_apply_once[zero_-mul_3]",
    "test_correctness.py::test_in_place_ops_on_real_grads_inside_the_mode_apply_once[mul_3-zero_]",
    "test_correctness.py::test_in_place_ops_on_real_grads_inside_the_mode_apply_once[mul_3-mul_3]",
    "test_correctness.py::test_in_place_ops_on_real_grads_inside_the_mode_apply_once[zero_-add_fake-mul_3]",
    # conjugate views inside the mode: upstream's real kernels read their raw storage
    "test_programs.py::test_kernels_that_read_a_bit_themselves_give_eagers_values_to_the_bit[fast-mm_of_an_adjoint-3]",
    "test_programs.py::test_kernels_that_read_a_bit_themselves_give_eagers_values_to_the_bit[fast-linear_with_a_conj_weight-3]",
    "test_programs.py::test_kernels_that_read_a_bit_themselves_give_eagers_values_to_the_bit[fast-addmm_in_place_of_column_major_operands-3]",
    "test_programs.py::test_kernels_that_read_a_bit_themselves_give_eagers_values_to_the_bit[fast-svd_lowrank_of_a_low_rank_product-3]",
    # issue 10: every family of tests/test_correctness.py that upstream gets wrong on every build
    "test_correctness.py::test_clip_grad_norm_inside_the_mode_changes_the_real_grads",
    "test_correctness.py::test_custom_function_returning_its_gradient_twice_is_not_aliased",
    "test_correctness.py::test_every_alias_of_a_parameter_is_repaired[reshape]",
    "test_correctness.py::test_every_alias_of_a_parameter_is_repaired[select]",
    "test_correctness.py::test_every_alias_of_a_parameter_is_repaired[slice]",
    "test_correctness.py::test_every_alias_of_a_parameter_is_repaired[transpose]",
    "test_correctness.py::test_fake_gradient_into_a_real_graph[autograd.backward]",
    "test_correctness.py::test_fake_gradient_into_a_real_graph[leaf.backward]",
    "test_correctness.py::test_fake_gradient_into_a_real_graph[out.backward]",
    "test_correctness.py::test_fake_gradient_into_a_real_graph_without_values_follows_the_policy",
    "test_correctness.py::test_frozen_parameter_values_feed_the_other_gradients",
    "test_correctness.py::test_gradient_mutated_in_a_sibling_branch_after_accumulation",
    "test_correctness.py::test_gradient_sent_to_two_leaves_gives_each_its_own_buffer",
    "test_correctness.py::test_leaf_switched_off_before_backward_gets_no_grad",
    "test_correctness.py::test_meta_model_gets_meta_gradients_of_its_shape[1-policy_asked]",
    "test_correctness.py::test_meta_model_gets_meta_gradients_of_its_shape[2-policy_asked]",
    "test_correctness.py::test_no_leaf_gradient_shares_memory_with_another_in_a_model",
    "test_correctness.py::test_one_mode_reused_across_an_optimizer_step_sees_the_new_parameters",
    "test_correctness.py::test_plain_set_path_still_takes_the_buffer_over",
    "test_correctness.py::test_reentrant_checkpoint_then_backward_after_the_mode_has_no_internal_error",
    "test_correctness.py::test_retained_real_non_leaf_feeding_the_mode_gets_a_real_grad[False]",
    "test_correctness.py::test_retained_real_non_leaf_feeding_the_mode_gets_a_real_grad[True]",
    "test_correctness.py::test_reused_user_gradient_is_never_adopted",
    "test_correctness.py::test_sparse_embedding_gets_a_real_sparse_gradient[1]",
    "test_correctness.py::test_sparse_embedding_gets_a_real_sparse_gradient[2]",
    "test_correctness.py::test_uninstall_while_another_thread_is_in_a_fake_backward",
    "test_correctness.py::test_user_gradient_passed_through_every_api_behaves_as_in_eager[autograd.backward]",
    "test_correctness.py::test_user_gradient_passed_through_every_api_behaves_as_in_eager[retain_graph]",
    "test_correctness.py::test_user_gradient_passed_through_every_api_behaves_as_in_eager[tensor.backward]",
    "test_correctness.py::test_view_of_a_parameter_taken_outside_the_mode_has_real_values",
    "test_correctness.py::test_weight_view_saved_by_a_real_prefix_and_used_in_a_fake_backward",
    "test_correctness.py::test_zero_grad_without_set_to_none_inside_the_mode[eager]",
    "test_correctness.py::test_zero_grad_without_set_to_none_inside_the_mode[none]",
    # issue 18.1: one tensor converted by several modes (converters)
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[two_modes_sequential]",
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[nested_modes]",
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[mode_per_micro_batch_summed_in_the_last]",
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[loss_summed_outside_the_modes]",
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[module_output_feeds_another_mode]",
    "test_multi_mode.py::test_one_parameter_converted_by_several_modes_gets_eager_gradients[view_of_a_parameter_in_two_modes]",
    "test_multi_mode.py::test_each_converter_resyncs_its_own_stale_copy_after_an_optimizer_step",
    "test_multi_mode.py::test_a_buffer_changed_between_two_graphs_of_one_mode_is_resynced",
    # issue 19.1: concurrent writes into one leaf
    "test_concurrency.py::test_concurrent_writes_into_one_leaf_lose_no_update_forced[set]",
    "test_concurrency.py::test_concurrent_writes_into_one_leaf_lose_no_update_forced[accumulate]",
    "test_concurrency.py::test_concurrent_fake_backward_into_one_leaf_loses_no_update[set]",
    "test_concurrency.py::test_concurrent_fake_backward_into_one_leaf_loses_no_update[accumulate]",
    "test_concurrency.py::test_concurrent_sparse_gradients_are_all_kept",
    "test_concurrency.py::test_concurrent_mirrored_gradients_reach_the_source_exactly",
    # issue 18.2: buffers="write_back" (the buffers stay stale without the patch)
    "test_write_back.py::test_a_decomposed_op_updates_once[cpu]",
    "test_write_back.py::test_a_frozen_parameter_updated_as_an_ema_follows_eager[cpu]",
    "test_write_back.py::test_a_real_input_updated_in_place_is_updated_as_in_eager[cpu]",
    "test_write_back.py::test_a_view_of_a_flat_buffer_is_written_through_to_the_base[cpu]",
    "test_write_back.py::test_an_out_argument_is_written[cpu]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-batchnorm1d]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-batchnorm2d]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-batchnorm2d_channels_last]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-batchnorm3d]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-instance_norm_tracking]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-spectral_norm]",
    "test_write_back.py::test_buffers_updated_inside_the_mode_match_eager[cpu-spectral_norm_legacy]",
    "test_write_back.py::test_eval_mode_reads_the_written_back_statistics",
    "test_write_back.py::test_threads_each_with_their_own_mode_and_model",
    "test_write_back.py::test_two_modes_writing_one_buffer_apply_both_updates_in_order",
    # issue 18.3: CPU autocast norms (said plainly; the workaround's gradients are real)
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[layer_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[layer_norm-torch.float16]",
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[batch_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[batch_norm-torch.float16]",
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[group_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_documented_workaround_trains_like_eager[group_norm-torch.float16]",
    # issue 25: in-place updates of real tensors inside the mode: reported, or exact
    "test_inplace_updates.py::test_a_gradient_seen_when_its_leaf_is_armed_is_updated_in_place",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[batchnorm]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[clip_grad_norm]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[optimizer_in_backward]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[out_argument]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[scaler_overflow]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[sgd_momentum]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[view_of_a_grad]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[zero_grad]",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[scaler_made_inside]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[batchnorm]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[clip_grad_norm]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[optimizer_in_backward]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[out_argument]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[scaler_overflow]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[sgd_momentum]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[view_of_a_grad]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[zero_grad]",
    "test_inplace_updates.py::test_write_back_makes_optimizer_state_born_inside_the_mode_real",
    "test_inplace_updates.py::test_max_norm_through_detach_is_reported_then_written_back",
    "test_inplace_updates.py::test_by_default_a_lost_update_is_reported[embedding_max_norm]",
    "test_inplace_updates.py::test_with_write_back_the_loop_is_exact[embedding_max_norm]",
    "test_inplace_updates.py::test_updates_that_reach_the_real_tensor_are_not_reported",
    "test_inplace_updates.py::test_the_trace_reader_counts_lost_updates",
    "test_inplace_updates.py::test_lbfgs_closure_entering_the_mode_matches_eager",
    "test_inplace_updates.py::test_status_and_doctor_count_lost_updates",
}
#: only where this build's propagation refuses CPU autocast norms (2.13, 2.14; not 2.4)
MUST_FAIL_WHERE_REFUSED = {
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[layer_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[layer_norm-torch.float16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[batch_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[batch_norm-torch.float16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[batch_norm_eval-torch.bfloat16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[batch_norm_eval-torch.float16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[group_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_norms_train_like_eager_from_the_real_kernels_outputs[group_norm-torch.float16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[layer_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[layer_norm-torch.float16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[batch_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[batch_norm-torch.float16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[batch_norm_eval-torch.bfloat16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[batch_norm_eval-torch.float16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[group_norm-torch.bfloat16]",
    "test_autocast_norm.py::test_the_mismatch_is_traced_and_explained_on_the_exception[group_norm-torch.float16]",
}
#: issue 39: the propagation repairs' tests fail with the repairs off (``propagation="upstream"``,
#: patch installed); the autocast norms' only where this build refuses them (see below)
#: issue 46: a parameter's values lent, not copied, and following the parameter; where the build
#: can lend (2.13+), they fail without the patch and without its repairs (which lending is one of)
MUST_FAIL_WITHOUT_LENDING = {
    "test_lending.py::test_a_parameter_read_inside_the_mode_is_not_copied",
    "test_lending.py::test_lent_values_follow_the_parameter_updated_outside_the_mode",
}

MUST_FAIL_WITHOUT_REPAIRS = {
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[index_add_]",
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[index_add_alpha]",
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[index_add_2d]",
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[view_index_add_]",
    "test_propagation.py::test_overlapping_as_strided_backward_gives_eager_gradients[stft_frames]",
    "test_propagation.py::test_overlapping_as_strided_backward_gives_eager_gradients[diagonal_bands]",
    "test_propagation.py::test_overlapping_as_strided_backward_gives_eager_gradients[half_overlap]",
    "test_propagation.py::test_stft_gradient_is_eager",
    "test_propagation.py::test_the_repair_is_traced",
    "test_propagation.py::test_an_op_without_a_meta_kernel_gets_the_real_kernels_values[meta_raises]",
    "test_propagation.py::test_an_op_without_a_meta_kernel_gets_the_real_kernels_values[no_meta]",
    "test_propagation.py::test_an_op_without_a_meta_kernel_and_without_values_is_reported",
    "test_propagation.py::test_the_fallback_repair_is_traced",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[masked_select]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[mask_read]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[nonzero_read]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[index_put_mask]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[repeat_interleave]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[unique_count]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[item]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[bool]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[equal]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[narrow_tensor]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[index_fill]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[gaussian_nll_loss]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[cov]",
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[corrcoef]",
    "test_propagation.py::test_nonzero_shape_and_values_come_from_the_real_kernel",
    "test_propagation.py::test_a_wrong_fake_kernel_gives_way_to_the_real_kernels_outputs[wrong_shape]",
    "test_propagation.py::test_a_wrong_fake_kernel_gives_way_to_the_real_kernels_outputs[wrong_dtype]",
    "test_propagation.py::test_a_wrong_fake_kernel_gives_way_to_the_real_kernels_outputs[wrong_device]",
    "test_propagation.py::test_a_wrong_fake_kernel_gives_way_to_the_real_kernels_outputs[wrong_second_output]",
    "test_inplace_updates.py::test_loss_item_gives_eager_value_and_upstream_raises",
    "test_verify.py::test_data_dependent_control_flow_trains_like_eager",
}
#: where this build's propagation checks fake kernels against real ones (2.13+; 2.4 checks
#: none): the CPU LSTM's mkldnn_rnn_layer mismatch
MUST_FAIL_WITHOUT_REPAIRS_WHERE_CHECKED = {
    "test_propagation.py::test_recurrent_layers_on_cpu_train_like_eager[lstm_2layer_bidirectional]",
    "test_propagation.py::test_recurrent_layers_on_cpu_train_like_eager[lstm]",
}
#: (tensor_split with 0-dim sections is in none of these: 2.14.1's propagation answers it.)
#: where FakeTensor leaves tolist() to the dispatcher (2.4 answers it itself: skipped there)
MUST_FAIL_WITHOUT_REPAIRS_WHERE_DISPATCHED = {
    "test_propagation.py::test_a_data_dependent_op_gives_eager_values_and_gradients[tolist]",
}
MUST_PASS_WITHOUT_REPAIRS = {  # controls: right upstream, and what the setting must leave alone
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[index_copy_]",
    "test_propagation.py::test_a_decomposed_in_place_op_updates_the_values_once[scatter_add_]",
    "test_propagation.py::test_overlapping_as_strided_backward_gives_eager_gradients[no_overlap]",
    "test_propagation.py::test_recurrent_layers_on_cpu_train_like_eager[gru]",
    "test_propagation.py::test_recurrent_layers_on_cpu_train_like_eager[rnn]",
    "test_propagation.py::test_a_real_gradient_inside_the_block_is_written_as_in_eager[first-add_real]",
    "test_write_back.py::test_a_decomposed_op_updates_once[cpu]",
}
#: controls where the build checks fake kernels against real ones (MetadataMismatchError, 2.13+;
#: 2.4 has no such check and skips them)
MUST_PASS_WITHOUT_REPAIRS_WHERE_CHECKED = {
    "test_propagation.py::test_where_the_repair_is_off_or_a_tracer_owns_the_mode_upstream_refuses[upstream]",
}
MUST_PASS_UPSTREAM = {  # they pin upstream behaviour that the patch leaves alone
    "test_inplace_updates.py::test_modes_without_real_values_and_tracers_report_nothing",
    "test_write_back.py::test_upstream_semantics_stay_the_default[batchnorm2d]",
    "test_write_back.py::test_from_tensor_fakes_are_never_written_back",
    "test_interplay.py::test_real_gradients_after_the_block_are_left_to_autograd",
    "test_interplay.py::test_autograd_grad_keeps_working_and_leaves_grad_untouched",
}


def _can_lend() -> set[str]:
    """:data:`MUST_FAIL_WITHOUT_LENDING` where this build can lend (its tests skip elsewhere)."""
    from fakegrad_patch._core.convert import lending

    return set(MUST_FAIL_WITHOUT_LENDING) if lending._State.available else set()


def _outcomes(env: dict[str, str], tests: set[str]) -> tuple[set[str], set[str]]:
    """Run ``tests`` (node ids, relative to this folder) in a fresh pytest with ``env``; the tests
    that failed and that passed (the run as a whole must fail). Only the tests whose outcome is
    checked run: the rest of their files would cost the CI minutes per build and prove nothing
    here. A node id that no longer exists stops the run (pytest exits 4), so a renamed test
    cannot drop out of these sets unnoticed."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", *sorted(tests), "-q", "-rA", "-p", "no:cacheprovider"],
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
    return failed, passed


@pytest.mark.slow
def test_behaviour_tests_fail_without_the_patch() -> None:
    env = {**os.environ, "FAKEGRAD_TEST_UNPATCHED": "1"}
    lending = _can_lend()
    failed, passed = _outcomes(
        env, MUST_FAIL_UPSTREAM | MUST_FAIL_WHERE_REFUSED | MUST_PASS_UPSTREAM | lending
    )
    from test_autocast_norm import _upstream_refuses

    must_fail = MUST_FAIL_UPSTREAM | (MUST_FAIL_WHERE_REFUSED if _upstream_refuses() else set())
    must_fail |= lending
    assert failed >= must_fail, must_fail - failed
    assert passed >= MUST_PASS_UPSTREAM, MUST_PASS_UPSTREAM - passed


@pytest.mark.slow
def test_propagation_repairs_fail_without_them() -> None:
    """Issue 39: the patch installed, its propagation repairs off: their tests fail, the
    controls pass."""
    env = {**os.environ, "FAKEGRAD_TEST_PROPAGATION": "upstream"}
    failed, passed = _outcomes(
        env,
        MUST_FAIL_WITHOUT_REPAIRS
        | {t for t in MUST_FAIL_WHERE_REFUSED if "real_kernels_outputs" in t}
        | MUST_FAIL_WITHOUT_REPAIRS_WHERE_CHECKED
        | MUST_FAIL_WITHOUT_REPAIRS_WHERE_DISPATCHED
        | MUST_PASS_WITHOUT_REPAIRS
        | MUST_PASS_WITHOUT_REPAIRS_WHERE_CHECKED
        | _can_lend(),
    )
    from test_autocast_norm import _upstream_refuses
    from torch._subclasses import fake_tensor as fake_tensor_module
    from torch._subclasses.fake_tensor import FakeTensor

    must_fail = set(MUST_FAIL_WITHOUT_REPAIRS) | _can_lend()
    if _upstream_refuses():
        must_fail |= {t for t in MUST_FAIL_WHERE_REFUSED if "real_kernels_outputs" in t}
        must_fail |= MUST_FAIL_WITHOUT_REPAIRS_WHERE_CHECKED
    if "tolist" not in FakeTensor.__dict__:
        must_fail |= MUST_FAIL_WITHOUT_REPAIRS_WHERE_DISPATCHED
    assert failed >= must_fail, must_fail - failed
    must_pass = set(MUST_PASS_WITHOUT_REPAIRS)
    if getattr(fake_tensor_module, "MetadataMismatchError", None) is not None:
        must_pass |= MUST_PASS_WITHOUT_REPAIRS_WHERE_CHECKED
    assert passed >= must_pass, must_pass - passed
