"""The one door to torch internals.

Every private torch import and every version/feature check lives in this package, so that a torch release that
moves something breaks exactly one place. Features are detected by keyword, attribute or a probe on a tiny input,
never by version string alone: CI runs 2.13 and 2.15, the GPU machine 2.11, and 2.12-2.15 must keep working.

One module per part of torch the package reaches into:

* ``types``: DTensor specs, placements, op schemas and cost formulas, re-exported;
* ``propagation``: the sharding propagator (its tables, rule registration, N-D expansion, strategy choice);
* ``dispatch``: DTensor's dispatcher (custom op handlers, the redistribution it calls);
* ``probes``: feature checks that run torch on a tiny input;
* ``testing``: simulated ranks (LocalTensorMode) and the OpInfo database;
* ``collectives``: process groups, meshes and collectives;
* ``compile``: fake tensors, inductor pass slots, symbolic sizes.

Everything is importable from ``dtensor_ext._compat`` itself; callers need not know the module.
"""

from __future__ import annotations

from dtensor_ext._compat.types import (  # noqa: F401
    allgather_cost, allreduce_cost, compute_local_shape_and_global_offset, DTensor, DTensorSpec, fill_placeholders,
    funcol, is_placeholder, is_tensor_evenly_shardable, is_tensor_shardable, LocalTensor, LocalTensorMode,
    MaskPartial, MeshTopoInfo, NormPartial, OpOverload, OpOverloadPacket, OpSchema, OpSpec, OpStrategy, Partial,
    Placement, pytree, redistribute_cost, reduce_scatter_cost, Replicate, RuntimeSchemaInfo, Shard, ShardingPlaceholder,
    StridedShard, tensor_meta, TensorMeta, torch_op_names, TORCH_VERSION, TorchDispatchMode, TupleStrategy,
)
from dtensor_ext._compat.testing import (  # noqa: F401
    current_local_tensor_mode, enabled_local_tensor_mode, local_int, local_int_values, local_tensor_values, opinfo_db,
    outside_dispatch_modes, outside_simulated_ranks, outside_torch_function_modes, per_simulated_rank, probing_context,
    rank_results_combiner, set_rank_results_combiner,
)
from dtensor_ext._compat.propagation import (  # noqa: F401
    auto_register_variants, can_adjust_scalars, can_derive_variants, clear_sharding_caches, compare_operator,
    DIRECT_STRATEGY_KINDS, dtensor_collective_costs, expand_sharding, expands_optional_tensor_lists,
    full_mesh_strategy_filter, full_single_dim_expansion, greedy_redistribution_planned, has_strategy_validator,
    known_equal, local_shapes, min_cost_selector, named_variants, op_strategy_func, op_strategy_rows,
    OPTIONAL_TENSOR_LISTS, output_tensor_meta, placement_transition_cost, PreparedSingleDimStrategy, propagate_cold,
    propagator, rank_in_mesh, redistribute_costs, register_op_strategy, register_scalar_adjuster, register_single_dim,
    register_view_strategy, registered_strategy, REPLICATE_ROW_ALLOWED, restore_registration, RULES_KEEP_EMPTY_SHARDS,
    SCALAR_ADJUSTERS, schema_info, set_min_cost_selector, set_schema_info, set_single_dim_expansion,
    single_dim_even_only, single_dim_expansion, single_dim_func, single_dim_info_allowing_uneven,
    snapshot_registration, STRATEGY_VALIDATOR, takes_optional_tensor_list, torch_strategy_kind, TorchLacks,
    VARIANT_DERIVATION, wrap_decomposition_strategy, wrap_single_dim_func,
)
from dtensor_ext._compat.probes import (  # noqa: F401
    at_first_dtensor_use, conv_handler_applies_redistribution, inplace_placement_refusal, output_placements, probe_dtensor, probe_mesh,
    probe_spec, probing_dtensor_ops, propagates, shard_to_partial_refused, shard_to_partial_sum_supported,
    view_groups_drops_empty_dims,
)
from dtensor_ext._compat.dispatch import (  # noqa: F401
    custom_op_handler, dispatch_redistributor, load_linear_cross_entropy_ops, mask_buffer_type, own_rows,
    propagate_and_redistribute, quiet_redistribute_warnings, quiet_torch_log, redistribution_plans_kept,
    redistribution_steps,
    redistribution_transforms, respec_inplace, shard_to_shard_gathers, suggested_input_specs, redistribute_local_tensor_functions,
    set_custom_op_handler, set_dispatch_redistributor, set_redistribute_local_tensor, tp_convolution_kernels,
    tracing_for_compile, view_layout_spec, wrap_local_results,
)
from dtensor_ext._compat.collectives import (  # noqa: F401
    default_store, flat_collectives, group_size, mesh_description, mesh_coordinates_by_rank, process_group_of,
)
from dtensor_ext._compat.compile import (  # noqa: F401
    aot_eager_with_joint_pass, custom_op_autotuning_api, dynamo_backend, fake_mode_of, fake_tensor_mode,
    inductor_cache_dir, inductor_custom_pass_api, inductor_joint_pass_slot, override_meta_kernel,
    process_groups_by_name, route_group_names, set_collective_choice_benchmark, size_hint, storage_key,
    strided_offsets_on_plain_ints, swap_dynamo_backend, value_dependent_errors, wrap_inductor_entry, called_in_graph,
)
