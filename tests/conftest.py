"""Shared test setup.

On a machine without CUDA, Triton kernels run in its interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported). ``OPSMATH_TEST_DEVICE=cuda`` runs the device-parametrized tests on the GPU.
"""
import os
import sys

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def _share_the_cores():
    """Under pytest-xdist each worker gets its share of the cores for torch's intra-op threads (and the
    processes the tests start inherit it through ``OMP_NUM_THREADS``). With torch's default, one thread
    per core in every worker, ``-n 2`` on two cores oversubscribes them and the tests' small ops run 2-3x
    slower. A thread count set by the user is kept."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers < 1 or "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, len(os.sched_getaffinity(0)) // workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


_share_the_cores()
DEVICE = os.environ.get("OPSMATH_TEST_DEVICE", "cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Route CPU tensors through the Triton kernels (interpreter) instead of the PyTorch reference.
    On a CUDA machine the kernels are compiled for the GPU and CUDA tensors reach them anyway."""
    if not torch.cuda.is_available():
        monkeypatch.setenv("OPSMATH_TRITON_ON_CPU", "1")
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    if "accelerate.state" in sys.modules:   # one AcceleratorState per process: each test sets its own
        sys.modules["accelerate.state"].AcceleratorState._reset_state(reset_partial_state=True)


# The quick subset (``python -m pytest -q -m quick tests``, a few minutes on two cores): unit tests of the
# rules, planner, optimizer, tuning cache and API, every family on small hand-written modules, and the
# autocast and HF-default paths on 2-layer models. The whole suite adds the kernels in Triton's interpreter,
# Inductor on CPU, the real-model zoo, the benchmark smoke runs and the notebooks.
QUICK = {
    "test_rules", "test_declare", "test_price", "test_plan_solve", "test_attention_masks", "test_autotune",
    "test_autotune_database", "test_optim_state", "test_patterns_norms", "test_patterns_attention",
    "test_patterns_activations", "test_unmatched", "test_user_errors", "test_dynamo_backend", "test_outer_compile",
    "test_autocast", "test_inference_in_training", "test_buffer_guards", "test_dropout_seeds", "test_op_times",
    "test_examples", "test_patterns_attention_spellings", "test_patterns_attention_declines", "test_layout",
    "test_capture_scalars", "test_ttir_cache", "test_cache_key", "test_loss_head",
    "test_triton_caches", "test_wgrad", "test_peak_snapshot", "test_table_gather", "test_checkpoint_side_effects",
}


# The GPU smoke subset (``OPSMATH_TEST_DEVICE=cuda python -m pytest -q -m gpu_smoke tests``, a few minutes on
# one GPU; run it after every change to GPU code): every kernel forward and backward against its reference,
# every rewrite family, Inductor with rewrites and a budget, and two real models trained beside eager.
# test module::function -> substrings of the parametrization ids kept (the first test matching each).
GPU_SMOKE = {
    "test_ttir_cache::test_on_the_gpu_a_repeated_layers_launches_are_analyzed_once_and_nothing_is_assumed_mutated":
        [""],
    "test_capture_scalars::test_a_compiled_step_with_a_scalar_store_never_syncs": [""],
    "test_offload::test_a_copy_source_freed_by_the_graph_is_still_copied_whole": [""],
    "test_experts_regional::test_inductor_trains_as_eager_on_the_device": [""],
    "test_price::test_on_the_gpu_every_priced_occurrence_is_measured_and_the_step_equals_eager": [""],
    "test_kernel_attention::test_triton_matches_eager": ["", "alibi"],
    "test_kernel_attention::test_softcap_matches_eager": [""],
    "test_kernel_attention_window::test_window_matches_eager": [""],
    "test_kernel_activations::test_swiglu_matches_eager": ["triton"],
    "test_kernel_activations::test_bias_gelu_matches_eager": ["triton"],
    "test_kernel_activations::test_scaled_softmax_matches_eager": ["triton"],
    "test_kernel_cross_entropy::test_matches_eager": ["triton"],
    "test_kernel_linear_cross_entropy::test_matches_eager": ["triton"],
    "test_kernel_linear_cross_entropy::test_returned_logits_and_their_own_gradient": ["1.5-triton"],
    "test_kernel_dropout_add_norm::test_triton_matches_eager": [""],
    "test_kernel_grouped_mm::test_grouped_mm_matches_per_group_products": [""],
    "test_kernel_grouped_mm::test_native_path_is_bf16_with_aligned_rows": [""],
    "test_patterns_experts::test_cuda_bf16_expert_parallel_rows_stay_out_of_every_gradient": [""],
    "test_kernel_grouped_mm::test_triton_grouped_mm_matches_per_group_products": ["37-24-40", "50-30-18"],
    "test_kernel_grouped_gather::test_matches_gather_then_per_group_products": ["sizes1-True-triton",
                                                                                "sizes3-True-triton"],
    "test_kernel_grouped_gather::test_a_linear_stacks_weight_gradient_arrives_in_its_layout": [""],
    "test_kernel_grouped_gather::test_a_compiled_backward_records_the_gathered_weight_gradient": [""],
    "test_patterns_experts_gather::test_triton_gather_kernels_train_like_eager": [""],
    "test_expert_load::test_cuda_graph_replays_fill_successive_slots": [""],
    "test_fp8_linear::test_fp8_linear_matches_its_quantized_reference_and_bf16": [""],
    "test_fp8_linear::test_rowwise_fp8_linear_matches_its_reference_and_every_gradient": [""],
    "test_fp8_experts::test_fp8_grouped_mm_matches_its_quantized_reference_and_every_gradient": [""],
    "test_fp8_experts::test_a_linear_stacks_weight_gradient_arrives_in_its_layout": [""],
    "test_kernel_grouped_mm::test_a_linear_stacks_weight_gradient_arrives_in_its_layout": ["dtype2-12-20"],
    "test_kernel_grouped_mm::test_fp32_on_tensor_cores_meets_the_tolerance_rule_of_cublas_fp32": ["tf32x3", "split"],
    "test_kernel_grouped_mm_split::test_split_ahead_grouped_mm_matches_per_group_products": ["0-True"],
    "test_fp8_weights::test_accumulation_reuses_copies_and_trains_as_casting_every_forward": [""],
    "test_fp8_weights::test_fused_cast_is_quantize_bit_for_bit_on_odd_sizes": [""],
    "test_optim_adamw::test_matches_torch_adamw_with_clip": ["triton"],
    "test_optim_adamw::test_cuda_step_never_syncs_with_the_host": [""],
    "test_optim_adamw_8bit::test_triton_8bit_step_matches_reference": [""],
    "test_patterns_attention::test_spelling_is_rewritten_and_exact": [""],
    "test_patterns_norms::test_norm_spelling_is_rewritten_and_exact": [""],
    "test_patterns_activations::test_swiglu_fires_and_matches": [""],
    "test_patterns_activations::test_bias_gelu_fires_and_matches": [""],
    "test_patterns_activations::test_scaled_softmax_fires_and_matches": [""],
    "test_patterns_linear_cross_entropy::test_fused_spellings_match_eager": [""],
    "test_patterns_linear_cross_entropy::test_cross_entropy_on_given_logits_reads_them_in_their_dtype": [""],
    "test_patterns_experts::test_cuda_bf16_experts_under_inductor_train_like_eager": [""],
    "test_inductor::test_inductor_matches_eager_and_keeps_the_rewrites": [""],
    "test_wgrad::test_on_the_gpu_fp32_weight_gradients_are_closer_to_fp32_than_eagers": [""],
    "test_triton_ops::test_attention_kernels_launch_from_inductor_code_and_match": ["window", "softcap", "bool-mask"],
    "test_inductor::test_budget_becomes_recompute_tags_that_inductor_honors": [""],
    "test_models::test_real_model_rewritten_and_matches_eager": ["[hf_llama_gqa_sdpa]", "[hf_mixtral_moe]"],
    "test_table_gather::test_row_sums_follow_the_tolerance_rule": ["100-33-777"],
    "test_table_gather::test_hugging_face_t5_position_bias_is_rewritten_and_trains_as_eager": ["T5-1"],
}


# The longest tests (module::function, longest first: about 25-210 s each on two busy cores), run first so
# that no worker starts one near the end while the other has run dry (pyproject.toml: ``--dist loadgroup``
# hands out the tests one by one in this order, a worker holding at most three ahead).
HEAVY_FIRST = [
    "test_plan_tensors::test_each_candidate_frees_what_it_counts_within_the_tolerance_rule",
    "test_offload::test_hf_llama_under_autocast_offloads_its_activations_not_its_weights",
    "test_weight_casts::test_hugging_face_models_under_autocast_budgets_train_as_without",
    "test_plan_selective::test_selective_plan_is_chosen_and_exact",
    "test_distributed::test_ddp_under_inductor_matches_single_process",
    "test_plan_models::test_gpt2_plans_a_quarter_of_its_activations_across_its_two_graphs",
    "test_optim_in_backward::test_under_inductor_each_block_is_a_graph_of_its_own",
    "test_notebooks::test_activation_memory",
    "test_offload::test_inductor_offload_trains_exactly_as_eager",
    "test_fleet_smoke::test_fleet_smoke_rows_for_both_recipes",
    "test_inductor::test_plan_under_inductor_is_made_for_what_its_partitioner_saves",
    "test_inductor::test_budget_becomes_recompute_tags_that_inductor_honors",
    "test_inductor::test_second_call_replan_recompiles_with_new_tags",
    "test_benchmarks_smoke::test_benchmark_script_smoke",
    "test_plan_models::test_a_graph_above_its_share_is_planned_at_its_floor_when_the_step_stays_close",
    "test_cuda_graph_loops::test_parameters_reach_inductor_as_static_inputs",
    "test_plan_selective::test_gemms_selective_plan_is_chosen_and_exact",
    "test_replan::test_fraction_one_recomputes_nothing",
    "test_plan_models::test_a_graph_far_above_its_share_still_names_its_floor",
    "test_optim_adamw_8bit::test_500_step_loss_curve_within_fp32_seed_noise",
    "test_notebooks::test_explore_rewrites",
    "test_models::test_triton_path_end_to_end",
    "test_plan::test_fraction_budgets_are_honored_and_monotone",
    "test_attention_configs::test_every_block_configuration_fits_hopper_shared_memory",
]


def pytest_collection_modifyitems(config, items):
    rank = {key: i for i, key in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(_key(item), len(rank)))   # stable: the rest keep their order
    taken = set()
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module in QUICK:
            item.add_marker(pytest.mark.quick)
        key = _key(item)
        for part in GPU_SMOKE.get(key, ()):
            if (key, part) not in taken and part in item.name:
                taken.add((key, part))
                item.add_marker(pytest.mark.gpu_smoke)


def _key(item) -> str:
    return f"{item.module.__name__.rsplit('.', 1)[-1]}::{getattr(item, 'originalname', item.name)}"
