"""Each test's time budget, in seconds on the slowest box the suite is held to (a 2-core AMD EPYC
without AVX-512, fp32 only, in two pytest-xdist workers): a test that runs longer is reported in
the run's summary, so that a change which slows one test cannot slow the suite unnoticed
(conftest's makereport and terminal-summary hooks). It fails only in strict mode
(SMALLGPT_TEST_BUDGET_STRICT=1, for a developer's own check): a slower box, or one shared with other
work, must not turn the suite red over time alone. A test's call is held to its budget: DEFAULT_S,
or its own below, where it is also marked `slow`, which `-m "not slow"` leaves out (the fast tier
is the tests not listed). Its setup is held to SETUP_S: the fixtures it builds, among them the runs
several tests share, built by whichever runs first.

The budgets were set from a profile (`bash scripts/test.sh --durations=0`, docs/testing.md) on a
2-core AMD EPYC with AVX512-BF16, which runs the suite about 2.6x faster than the slowest box: each
is its measured time there times 2.6, times 2 for the noise of two workers sharing two cores. A test
that needs more after a change says so here, in the same commit.

SMALLGPT_TEST_BUDGET scales every budget (2 on a box slower still, 0.33 to see what a box 3x slower
would report; 0 turns the check off, e.g. under a debugger or coverage)."""

import os
import re

# Seconds on the slowest box for a test not listed below (the fast tier): about 0.38 s on the
# AVX512-BF16 Xeon, so that its ~850 tests fit the 30 s the tier is held to there, two workers
# and their ~10 s of start-up included (docs/testing.md); a test that needs more is listed, slow.
DEFAULT_S = 2.0
# Seconds on the slowest box for a test's setup: the largest shared fixture is a sweep of 8 runs,
# which took 61.9 s there (2026-11-28, issue 85)
SETUP_S = 90.0

# {file: {test function (every parametrized case of it): seconds on the slowest box}}
BUDGETS: dict[str, dict[str, float]] = {
    "test_bench.py": {
        # over DEFAULT_S, so slow: 0.38-2.11 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_decode_bench_runs_and_reports_every_setting": 4,
        "test_hf_bench_with_no_llama_cpp_build_is_one_line": 11,
        "test_tokenizer_files_for_llama_cpp_encode_as_tiktoken": 7,
        "test_train_bench_times_each_chunk_of_a_gated_deltanet_model": 3,
        "test_hf_bench_checks_greedy_tokens_against_hugging_face": 100,
        "test_recipes_bench_trains_each_config_and_reports_its_final_val_loss": 30,
        "test_gguf_check_refuses_a_char_level_run_before_llama_cpp_runs": 6,
        "test_memory_bench_reports_ddp_and_fsdp_bytes_per_process": 6,
    },
    "test_bpe.py": {
        "test_a_bpe_run_samples_and_exports_with_its_own_tokenizer": 6,
    },
    "test_budgets.py": {
        "test_pytest_reports_a_test_over_its_budget_and_fails_it_only_when_strict": 50,
    },
    "test_checkpoint_compat.py": {
        # the first test of a process to import transformers (export.py's): 1.6 s alone on a
        # 2-core Intel Xeon with AVX512-BF16 (2026-11-27), about 5x that on the slowest box
        "test_export_py_exports_an_old_run_or_refuses_it_as_before": 10,
    },
    "test_compare.py": {
        # over DEFAULT_S, so slow: 0.38-0.58 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_variants_name_mla_beside_the_others_with_their_flags_conversions_and_costs": 4,
        "test_sigterm_and_sigint_stop_the_sweep_with_its_run_and_a_later_sweep_resumes": 60,
        "test_sweep_over_seeds_with_params_match_and_conversions": 40,
        "test_a_sweep_over_rates_trains_each_variant_at_each_and_reports_each_at_its_best": 44,
        # 4 runs of 20 iterations, 2 of them decided by the first: 9.8 s on a 2-core Intel Xeon with
        # AVX512-BF16 beside a sweep (2026-11-28)
        "test_bracket_trains_a_variant_best_at_an_edge_a_step_further_until_the_limit": 30,
        "test_killing_compare_ends_its_train_py_which_saves_first": 30,
        # 3 runs, then the same command 3 times: 7.9 s on a 2-core Intel Xeon with AVX512-BF16
        # (2026-11-29)
        "test_a_distilled_conversion_sweep_resumes_with_its_own_command_even_moved": 40,
        "test_a_run_whose_final_record_was_torn_is_evaluated_again_by_the_sweep": 15,
        "test_a_windowed_variant_trains_and_the_report_counts_its_cache_per_layer": 12,
        "test_converted_checkpoint_trains_samples_and_resumes": 6,
        "test_sizes_repeat_the_sweep_per_size_in_the_plan": 6,
        "test_student_t_interval_and_paired_difference_match_hand_computation": 6,
    },
    "test_convert_mla.py": {
        "test_a_run_converted_to_mla_starts_from_the_converted_model_trains_and_resumes": 6,
    },
    "test_ddp.py": {
        "test_sigterm_to_one_rank_stops_both_and_rank_0_saves_once": 30,
        "test_two_gloo_processes_match_one_process_with_twice_the_accumulation": 30,
        "test_accumulation_not_divisible_by_world_size_is_one_clear_error": 15,
    },
    "test_decode_matrix.py": {
        # over DEFAULT_S, so slow: 0.38-0.68 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_padded_batch_decodes_what_each_prompt_does_alone": 3,
        "test_an_hf_folder_decodes_what_its_run_does": 4,
        "test_the_compiled_int8_step_decodes_the_greedy_tokens": 120,
        "test_int8_decoding_through_the_cache_follows_the_float_model": 6,
        "test_sample_py_decodes_an_mla_run_with_int8_weights": 6,
    },
    "test_export.py": {
        "test_export_loads_in_transformers_and_decodes_as_sample_py": 10,
        "test_gguf_alone_keeps_no_folder_is_named_after_the_run_and_replaces_only_a_gguf": 6,
        "test_gpt2_bpe_dataset_exports_its_bpe_tokenizer": 6,
        "test_overwrite_never_deletes_the_run_nor_a_folder_holding_it": 6,
    },
    "test_fsdp.py": {
        "test_sharded_checkpoint_resumes_at_another_process_count": 40,
        "test_the_gathered_checkpoint_samples_and_converts": 40,
        "test_a_missing_or_corrupt_sharded_checkpoint_is_one_line": 6,
        "test_an_fsdp_run_ends_its_gloo_threads_before_the_process_exits": 6,
        "test_keep_last_keeps_the_sharded_folders_its_checkpoints_name": 6,
    },
    "test_generate.py": {
        # over DEFAULT_S, so slow: 0.38-0.61 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_stream_asked_for_endless_tokens_keeps_bounded_memory": 3,
        "test_the_compiled_steps_cache_name_is_the_same_in_a_checkout_elsewhere": 4,
        "test_compiled_cpu_step_decodes_the_eager_tokens_past_block_size": 100,
        "test_compiled_bf16_step_gives_the_eager_logits_through_blocked_weights": 80,
        "test_compiled_steps_of_two_models_in_turns_each_decode_their_own_tokens": 80,
        "test_each_row_of_a_padded_batch_equals_its_prompt_alone_far_past_block_size": 6,
        "test_the_compiled_step_reads_the_weights_as_they_are_at_each_stream": 6,
        # loads the batch-1 DECODE step twice: 2.35 s on a 2-core Intel Xeon with AVX512-BF16
        # (2026-11-28)
        "test_release_steps_removes_the_unpacked_steps_of_models_still_alive": 12,
    },
    "test_gpt2.py": {
        "test_no_weights_offline_is_one_clear_line": 20,
        "test_finetune_gpt2_into_gqa_then_sample": 8,
    },
    "test_hybridize.py": {
        # 4 short trainings and 8 refusals: 1.6 s on a 2-core Intel Xeon with AVX512-BF16
        # (2026-11-29)
        "test_a_conversion_and_its_teacher_are_checked_before_any_work": 10,
        "test_train_py_converts_ranks_calibrates_distills_and_resumes": 12,
    },
    "test_latent.py": {
        # over DEFAULT_S, so slow: 0.38-0.53 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_greedy_tokens_past_block_size_from_the_cache_equal_recomputation": 3,
        "test_mla_trains_and_compiles_without_graph_breaks": 6,
    },
    "test_layout.py": {
        # over DEFAULT_S, so slow: 0.38-0.79 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_no_code_outside_a_kinds_file_names_it": 5,
        "test_pip_install_declares_the_requirements_and_installs_only_imported_modules": 3,
        "test_every_module_imports_first_and_alone_and_does_nothing": 30,
        "test_a_bug_keeps_its_traceback_and_a_user_error_is_one_line": 12,
        # a process importing every script: 2.2 s here
        "test_the_scripts_start_without_the_compiler_or_the_hub_libraries": 12,
    },
    "test_lm_eval.py": {
        # the first to scan the harness's ~15,000 task files (5 s here), and to import lm-eval
        "test_the_harness_out_of_reach_or_not_installed_is_one_line_before_any_work": 25,
        "test_the_harness_scores_the_projects_tasks_as_the_project_scorer_does_pair_for_pair": 20,
        "test_a_true_line_preferring_model_scores_1_and_a_constant_one_exactly_half": 12,
    },
    "test_mistake_classes.py": {
        "test_a_full_disk_in_train_py_is_one_line": 15,
        "test_ctrl_c_while_the_libraries_import_is_one_line": 10,
        "test_the_checkpoint_size_estimate_is_close": 6,
        "test_the_decode_summary_finds_the_step_that_compiled_wherever_it_falls": 6,
        "test_token_ids_beyond_the_vocabulary_are_one_line": 6,
    },
    "test_mistakes.py": {
        # over DEFAULT_S, so slow: 0.38-0.63 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_stop_takes_a_typed_backslash_n_as_the_newline_meant": 4,
        "test_a_long_sample_does_not_grow_memory": 20,
        "test_ctrl_c_in_dataset_py_writes_nothing": 20,
        "test_ctrl_c_in_sample_is_one_line_and_status_130": 6,
        "test_gpt2_weights_need_their_own_tokens_and_positions": 6,
        "test_one_out_dir_holds_one_run_at_a_time_and_a_killed_holder_leaves_no_lock": 6,
    },
    "test_model.py": {
        # one torch.compile of three attention calls, from a cold cache: 8.4 s
        "test_compiled_one_query_attention_over_a_bf16_cache_equals_sdpa": 45,
        "test_each_variant_overfits_one_batch": 6,
        "test_training_forward_compiles_without_graph_breaks": 6,
    },
    "test_mqar.py": {
        # over DEFAULT_S, so slow: 0.38-0.88 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_sweep_judging_solved_at_its_stop_says_so_up_front": 3,
        "test_training_stops_early_at_the_accuracy_and_that_evaluation_is_final": 5,
        "test_train_py_trains_on_it": 6,
    },
    "test_mqar_scripts.py": {
        "test_the_zoology_script_draws_accuracy_against_width_per_pair_count": 60,
    },
    "test_nothing_lost.py": {
        "test_a_comparison_writes_only_into_a_folder_of_its_kind": 6,
        "test_a_leading_tilde_is_the_home_folder": 6,
        "test_a_log_without_a_checkpoint_is_refused_unless_it_is_this_runs": 6,
    },
    "test_prepare.py": {
        # over DEFAULT_S, so slow: 0.38-0.95 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_an_empty_corpus_file_is_one_line": 5,
        "test_corpus_offline_is_one_clear_line": 10,
        "test_pycode_char_is_deterministic_and_round_trips": 8,
        "test_corpus_pipeline_on_local_parquet": 6,
        "test_gpt2_bpe_offline_is_a_clear_error": 6,
        "test_unusable_corpus_is_one_line": 6,
    },
    "test_quantize.py": {
        "test_quantized_model_decodes_close_to_fp32_and_compiles": 60,
        "test_int8_bench_reports_val_loss_and_agreement_of_a_checkpoint": 6,
    },
    "test_long_recall.py": {
        # scipy's import for the Clopper-Pearson intervals (1 s here), and 2,400 guesses
        "test_a_lookup_model_solves_every_cell_and_a_uniform_one_scores_chance": 8,
    },
    "test_recall.py": {
        "test_eval_py_refuses_a_dataset_it_cannot_read_before_any_work": 6,
        "test_eval_py_with_no_settings_prints_exactly_what_the_run_logged": 6,
        # with needle and mqar_long on the run, and their refusal past block_size: 2 more evals
        "test_eval_py_with_no_settings_prints_the_mqar_accuracy_the_run_logged": 10,
        "test_train_logs_its_final_evals_and_eval_py_prints_the_same": 6,
        # a run, a copy of its checkpoint and three evaluations
        "test_a_zeroed_mixer_scores_as_the_model_whose_mixer_projects_to_zero": 8,
    },
    "test_reliability.py": {
        "test_torchrun_restarts_a_killed_worker_and_resumes_exactly": 120,
        "test_wandb_online_without_network_falls_back_to_offline": 25,
        "test_kill_9_during_a_save_leaves_the_previous_checkpoint_loadable": 20,
        "test_weights_gone_non_finite_are_never_saved": 15,
        "test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint": 6,
        "test_keep_last_copies_where_the_file_system_has_no_hard_links": 6,
        "test_keep_last_keeps_the_k_newest_checkpoints": 6,
        "test_skip_mode_counts_skipped_steps_in_the_log": 6,
    },
    "test_report.py": {
        # over DEFAULT_S, so slow: 0.38-1.42 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_hybrids_cache_bytes_are_its_attention_kv_and_its_state": 4,
        "test_a_rate_at_which_a_seed_diverged_is_never_chosen": 3,
        "test_a_ratio_sweep_reports_each_share_of_attention_at_its_best_rate_with_solved_runs": 6,
        "test_an_lm_eval_task_no_run_was_scored_on_is_said_not_left_an_empty_column": 4,
        "test_capacity_curves_are_reported_from_runs_on_a_mix_early_stopped_ones_included": 3,
        "test_each_variant_is_reported_at_its_own_best_rate_measured_on_the_test_split": 8,
        "test_mqar_solved_counts_the_runs_past_the_threshold_with_their_interval": 5,
        "test_speed_ratios_are_stated_only_where_the_repeats_separate_them": 6,
        "test_a_report_made_while_the_sweep_runs_says_so_at_its_top": 6,
        "test_a_run_whose_final_record_is_torn_is_left_out_and_named": 6,
        "test_recall_accuracies_are_pooled_over_seeds_and_paired_against_mha": 6,
        "test_runs_trained_for_other_iterations_than_the_command_plans_are_marked": 9,
    },
    "test_sample.py": {
        # over DEFAULT_S, so slow: 0.38-0.42 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_greedy_with_and_without_cache_agree": 3,
        "test_compiled_step_writes_the_eager_text": 6,
        "test_compiling_with_no_cpp_compiler_is_one_line": 6,
    },
    "test_train.py": {
        # over DEFAULT_S, so slow: 0.38-0.44 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_new_run_never_replaces_another_runs_checkpoint": 3,
        "test_wandb_offline_records_the_run": 60,  # eval.py --lm_eval into its summary too
        "test_keep_freed_memory_stops_the_page_faults_of_each_step": 30,
        "test_sigterm_finishes_the_step_saves_and_exits_cleanly": 15,
        "test_an_mfu_over_100_percent_probes_the_cpu_peak_again": 6,
        "test_dtype_auto_trains_in_bf16_only_where_its_products_measure_faster": 6,
        "test_resume_reproduces_the_uninterrupted_run_bit_for_bit": 6,
        "test_resume_takes_the_keys_not_given_from_the_run": 6,
        "test_training_lowers_val_loss_writes_checkpoint_and_resumes": 6,
    },
    "test_window.py": {
        "test_a_windowed_model_trains_and_compiles_without_graph_breaks": 6,
        "test_greedy_tokens_past_block_size_equal_recomputation_with_the_windows": 6,
    },
    "test_capacity.py": {
        # over DEFAULT_S, so slow: 0.38-0.82 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_each_cell_takes_the_best_rate_and_says_whether_it_is_bracketed": 3,
        "test_the_knee_is_where_the_curve_first_falls": 5,
        "test_the_script_reads_a_protocols_parts_together_and_refuses_a_run_twice": 4,
    },
    "test_delta_rule_kernel.py": {
        # over DEFAULT_S, so slow: 0.38-2.74 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_compiled_training_through_the_op_is_eager": 15,
        "test_the_convolution_op_is_the_shifted_products_with_every_gradient": 4,
        "test_the_op_passes_torch_librarys_opcheck": 5,
        "test_views_of_the_layers_layout_give_the_contiguous_results": 5,
    },
    "test_hf.py": {
        # over DEFAULT_S, so slow: 0.38-0.41 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_an_hf_folder_without_its_tokenizer_is_read_as_gpt2_only_if_it_is_gpt2": 3,
    },
    "test_hybrid.py": {
        # over DEFAULT_S, so slow: 0.38-0.85 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_a_hybrid_trains_and_qwen3_5_holds_it_trained": 5,
        "test_prefill_then_steps_is_one_forward_and_cut_anywhere": 3,
        "test_the_bugs_a_recurrent_layer_can_have_fail_these_tests": 5,
    },
    "test_kda.py": {
        # over DEFAULT_S, so slow: 0.38-0.48 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_the_model_is_transformers_kimi_linear_on_the_same_weights": 3,
    },
    "test_optim.py": {
        # over DEFAULT_S, so slow: 0.38-0.54 s on the AVX512-BF16 Xeon (2026-11-29, a slow hour)
        "test_muon_chain_covers_every_parameter_once_and_trains": 3,
    },
}


def scale() -> float:
    """SMALLGPT_TEST_BUDGET as a number (1 when unset); a clear error for anything else."""
    value = os.environ.get("SMALLGPT_TEST_BUDGET", "1")
    try:
        factor = float(value)
    except ValueError:
        raise ValueError(
            f"SMALLGPT_TEST_BUDGET={value!r} is not a number (0 turns it off)"
        ) from None
    if factor < 0:
        raise ValueError(f"SMALLGPT_TEST_BUDGET={value!r} must be 0 (off) or more")
    return factor


def key(nodeid: str) -> tuple[str, str]:
    """The file's name and the function of a test id, without parameters, class or xdist group
    ('tests/test_x.py::test_y[a-b]@group' -> ('test_x.py', 'test_y'))."""
    path, _, rest = nodeid.partition("::")
    name = re.split(r"[\[@]", rest.split("::")[-1])[0]
    return path.rsplit("/", 1)[-1], name


def listed(nodeid: str) -> bool:
    """Whether a test has a budget of its own (then it is slow)."""
    file, name = key(nodeid)
    return name in BUDGETS.get(file, {})


def budget(nodeid: str, phase: str = "call") -> float:
    """The seconds a test's phase ('setup' or 'call') may take on the slowest box."""
    if phase == "setup":
        return SETUP_S
    file, name = key(nodeid)
    return BUDGETS.get(file, {}).get(name, DEFAULT_S)


def strict() -> bool:
    """Whether an overrun fails its test (SMALLGPT_TEST_BUDGET_STRICT=1) rather than being reported
    in the summary; a clear error for a value other than 0 or 1."""
    value = os.environ.get("SMALLGPT_TEST_BUDGET_STRICT", "0")
    if value not in ("0", "1"):
        raise ValueError(f"SMALLGPT_TEST_BUDGET_STRICT={value!r} must be 0 (report) or 1 (fail)")
    return value == "1"


def overrun(nodeid: str, phase: str, seconds: float, factor: float) -> str | None:
    """The line of a test whose phase took seconds against its budget times factor; None while
    within it, or with the check off (factor 0)."""
    allowed = budget(nodeid, phase) * factor
    if factor == 0 or seconds <= allowed:
        return None
    return (
        f"{nodeid}: its {phase} took {seconds:.1f} s, over its budget of {allowed:.1f} s "
        f"(tests/budgets.py: make it cheaper, or raise its budget there and say why)"
    )
