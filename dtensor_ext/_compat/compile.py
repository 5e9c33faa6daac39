"""Graph passes under torch.compile: fake tensor modes, inductor's pass slots and symbolic sizes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch


def fake_mode_of(values: Sequence[Any]):
    """The FakeTensorMode the traced ``values`` live in (a fresh one where they carry none), for graph passes."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)]) or FakeTensorMode()


def fake_tensor_mode(like: Sequence[Any] = ()):
    """The FakeTensorMode the fake tensors among `like` live in, else a fresh one (shapes and dtypes only, no
    data), for running ops to see what DTensor does; plain tensors may meet its fake ones."""
    from torch._guards import detect_fake_mode
    from torch._subclasses.fake_tensor import FakeTensorMode

    return detect_fake_mode([v for v in like if isinstance(v, torch.Tensor)]) or FakeTensorMode(
        allow_non_fake_inputs=True)


def value_dependent_errors() -> tuple[type[Exception], ...]:
    """What a fake tensor raises where a call needs tensor values it does not have (``.item()``, ``bool(t)``,
    an output shape that depends on values)."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    return DataDependentOutputException, DynamicOutputShapeException


def storage_key(t: torch.Tensor) -> int:
    """Identity of the memory a tensor lives in (views share their base's), also for fake and meta tensors,
    whose memory has no address."""
    return t.untyped_storage()._cdata


@contextlib.contextmanager
def strided_offsets_on_plain_ints() -> Iterator[None]:
    """Inside the block, DTensor works out a strided shard's local size and offsets (``_StridedShard``: an
    ``arange`` of the dim split into chunks, then ``tolist``) outside any dispatch mode whenever its sizes and rank
    are plain ints, as a real run does. Under a fake tensor mode the ``arange`` would be a fake tensor whose values
    cannot be read (``aten._local_scalar_dense``), so DTensor failed on fake DTensors exactly where two mesh dims
    shard tensor dims that a view flattens together. Restored on exit."""
    from torch.distributed.tensor.placement_types import _StridedShard
    from torch.utils._python_dispatch import _disable_current_modes

    original = _StridedShard.__dict__["local_shard_size_and_offset"]

    def on_plain_ints(self, curr_local_size, num_chunks, rank, *args, **kwargs):
        if all(type(v) is int for v in (curr_local_size, num_chunks, rank)):
            with _disable_current_modes():
                return original(self, curr_local_size, num_chunks, rank, *args, **kwargs)
        return original(self, curr_local_size, num_chunks, rank, *args, **kwargs)

    _StridedShard.local_shard_size_and_offset = on_plain_ints
    try:
        yield
    finally:
        _StridedShard.local_shard_size_and_offset = original


def inductor_custom_pass_api():
    """(CustomGraphPass, get_hash_for_files): inductor's base class for post-grad passes and its source hasher."""
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    return CustomGraphPass, get_hash_for_files


def inductor_joint_pass_slot() -> tuple[Any, str]:
    """(inductor's config, the name of its joint-graph custom pass slot). That pass sees AOTAutograd's joint
    forward+backward graph before the partitioner splits it (and the inference graph when nothing needs grad)."""
    import torch._inductor.config as config

    if not hasattr(config, "joint_custom_pre_pass"):
        raise RuntimeError(f"torch {torch.__version__}: inductor has no joint_custom_pre_pass slot to install into")
    return config, "joint_custom_pre_pass"


def size_hint(size: Any) -> int:
    """An int or SymInt's example value, without installing a guard on it."""
    if isinstance(size, int):
        return size
    try:
        from torch.fx.experimental.symbolic_shapes import optimization_hint
    except ImportError:  # torch 2.12
        return size.node.hint
    return optimization_hint(size)


_META_OVERRIDES: dict[Any, list] = {}


def override_meta_kernel(op: torch._ops.OpOverload, make_kernel: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Make ``make_kernel(torch's Python meta kernel of op)`` ``op``'s Meta kernel in both places torch looks:
    the dispatcher's Meta key (DTensor's propagation, fake tensors) and the op's Python-dispatcher table (what
    dynamo and AOTAutograd tracing call). The returned undo makes torch's kernel answer again.

    The dispatcher entry is registered once per process and never removed: it forwards to the current override
    or to torch's kernel. (Fake tensors keep calling a Python Meta kernel after its registration is removed or
    overridden, in torch 2.13, so swapping registrations would not undo.)"""
    import warnings

    from torch._C import DispatchKey
    from torch._decomp import meta_table

    if op not in _META_OVERRIDES:
        torch_kernel = meta_table[op]
        current = _META_OVERRIDES[op] = [None]

        def forward(*args, **kwargs):
            return (current[0] or torch_kernel)(*args, **kwargs)

        namespace, name = op._schema.name.split("::")
        library = torch.library.Library(namespace, "IMPL")
        with warnings.catch_warnings():  # the dispatcher warns that a Meta kernel is overridden: that is the point
            warnings.simplefilter("ignore", UserWarning)
            # torch 2.11/2.12 refuse to replace a Python Meta kernel of torch's own unless asked (2.13+ allow it)
            library.impl(name if op._overloadname == "default" else f"{name}.{op._overloadname}", forward, "Meta",
                         allow_override=True)
        current.append(library)  # kept alive for the process
        op.py_kernels[DispatchKey.Meta] = forward
        op._dispatch_cache.clear()
    current = _META_OVERRIDES[op]
    current[0] = make_kernel(meta_table[op])
    _forget_cached_metas()

    def undo() -> None:
        current[0] = None
        _forget_cached_metas()

    return undo


def _forget_cached_metas() -> None:
    """Fake tensors cache each op's output metadata by its inputs' metadata: a result the other kernel gave would
    otherwise outlive a swap (torch alone would then 'run' what its own kernel refuses)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    FakeTensorMode.cache_clear()


def aot_eager_with_joint_pass(joint_pass: Callable[[torch.fx.Graph], None]) -> Callable:
    """A dynamo backend doing what torch's ``aot_eager`` does (AOTAutograd, min-cut partitioner, graphs run
    eagerly) with ``joint_pass`` applied to the joint forward+backward graph before partitioning, and to the
    inference graph when nothing needs grad: inductor's joint-graph slot, without inductor."""
    from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    def partition(joint_module, joint_inputs, **kwargs):
        joint_pass(joint_module.graph)
        joint_module.recompile()
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)

    def run_eagerly(gm, example_inputs):
        return make_boxed_func(gm.forward)

    def inference(gm, example_inputs):
        joint_pass(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=run_eagerly, bw_compiler=run_eagerly, inference_compiler=inference,
                        partition_fn=partition, keep_inference_input_mutations=True)


def swap_dynamo_backend(name: str, backend: Callable) -> Callable[[], None]:
    """Make ``torch.compile(backend=name)`` use ``backend``; the returned undo puts torch's back."""
    from torch._dynamo.backends import registry

    previous = registry.lookup_backend(name)
    registry._COMPILER_FNS[name] = backend

    def undo() -> None:
        registry._COMPILER_FNS[name] = previous

    return undo


def wrap_inductor_entry(wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Make ``torch.compile(backend="inductor")`` call ``wrap(torch's compile_fx)`` (looked up at every compile),
    which runs on every inductor compile, cache hits included; the returned undo puts torch's back."""
    from torch._inductor import compile_fx as module

    previous = module.compile_fx
    module.compile_fx = wrap(previous)

    def undo() -> None:
        module.compile_fx = previous

    return undo


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache directory (TORCHINDUCTOR_CACHE_DIR or its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def dynamo_backend(name: str) -> Callable:
    """The compiler ``torch.compile(backend=name)`` uses (e.g. "aot_eager", "inductor"), to wrap with a counter."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(name)


def set_collective_choice_benchmark(benchmark: Callable[..., float]) -> Callable[[], None]:
    """Make ``benchmark(prepare, run, name, fingerprint, inputs) -> ms`` what inductor's autotuner calls for each
    choice of an op whose choices issue collectives, instead of torch's (CUDA events only, mean over ranks).
    ``prepare()`` compiles the choice (inductor otherwise compiles it lazily inside its first run, i.e. after the
    ranks synchronised and while peers may already wait in the choice's collectives); ``run()`` runs it once on
    ``inputs``, its benchmark tensors. ``name`` is the choice's name without the counter inductor appends to
    subgraph choices (the same in every compile); ``fingerprint`` hashes inductor's own identity of the choice
    (its name, input sizes and strides, and for a subgraph choice its FX graph), or is None where inductor gives
    none. inf means failed or timed out: inductor then falls back to the op's default. Inductor's FX-graph and
    autotune caches are off meanwhile (a rank that hit them would not benchmark while its peers do). The returned
    undo puts back torch's benchmark and the caches."""
    import hashlib

    from torch._inductor import config
    from torch._inductor.select_algorithm import AlgorithmSelectorCache

    previous = AlgorithmSelectorCache.__dict__["benchmark_collective_choice"]

    def benchmark_choice(cls, choice, autotune_args):
        inputs, output = autotune_args.get_benchmark_tensors(cls._is_extern(choice)).unpack()
        output.zero_()
        prepare = getattr(choice, "_ensure_compiled", None) or (lambda: None)  # subgraph choices compile lazily
        name = getattr(choice, "name", "?")
        if getattr(choice, "gm", None) is not None:  # a subgraph choice: "<op>_<implementation>_<counter>"
            name = name.rsplit("_", 1)[0]
        try:
            fingerprint = hashlib.sha256(choice.hash_key().encode()).hexdigest()[:16]
        except Exception:  # a choice kind without an identity: never reused from a record
            fingerprint = None

        def run() -> None:
            # Inductor benchmarks while lowering, with the Python dispatcher on. There, on gloo, a choice's
            # all_gather_into_tensor + wait_tensor blocked on every rank until the group's timeout (the same
            # compiled code completes with the dispatcher off, as it runs in the compiled step).
            with torch._C._DisablePythonDispatcher():
                choice.benchmark_collective(*inputs, out=output)

        return benchmark(prepare, run, name, fingerprint, [t for t in inputs if isinstance(t, torch.Tensor)])

    caches = config.patch(fx_graph_cache=False, autotune_local_cache=False, autotune_remote_cache=False)
    caches.__enter__()
    AlgorithmSelectorCache.benchmark_collective_choice = classmethod(benchmark_choice)

    def undo() -> None:
        AlgorithmSelectorCache.benchmark_collective_choice = previous
        caches.__exit__(None, None, None)

    return undo


def process_groups_by_name() -> dict[str, Any]:
    """group name -> process group, for every group this rank belongs to: the names functional collectives (and so
    Inductor's generated code) address groups by."""
    from torch.distributed.distributed_c10d import _world

    return {name: pg for pg, name in _world.pg_names.items() if pg in _world.pg_group_ranks}


def route_group_names(routes: Mapping[str, Any]) -> Callable[[], None]:
    """Make collectives addressed by group name (functional collectives) run on ``routes[name]`` instead of the
    group registered under that name; the returned undo registers the original groups again. Collectives called
    with a ProcessGroup object (``dist.all_reduce(x, group=pg)``) are not rerouted."""
    import torch._C._distributed_c10d as c10d

    originals: dict[str, Any] = {}

    def undo() -> None:
        for name, group in originals.items():
            c10d._unregister_process_group(name)
            c10d._register_process_group(name, group)

    try:
        for name, group in routes.items():
            originals[name] = c10d._resolve_process_group(name)
            c10d._unregister_process_group(name)
            c10d._register_process_group(name, group)
    except BaseException:
        undo()
        raise
    return undo


def custom_op_autotuning_api():
    """(register_custom_op_autotuning, CustomOpConfig): inductor's registration of alternative implementations
    of a custom op, chosen by benchmarking when the op is compiled with max_autotune."""
    from torch._inductor.kernel.custom_op import CustomOpConfig, register_custom_op_autotuning

    return register_custom_op_autotuning, CustomOpConfig


def called_in_graph(fn: Callable) -> Callable:
    """``fn`` as dynamo records it: one call in the graph, its body run when AOTAutograd traces that graph (and
    eagerly outside torch.compile), not traced by dynamo. For a function that decides by its DTensor arguments'
    placements inside an autograd.Function's backward: dynamo traces such a backward with gradients shaped like the
    forward's outputs (a Replicate value's gradient as Replicate), so a decision made there bakes the guessed
    placement into the graph, and a gradient that arrives Partial passes through unreduced. Recorded as a call,
    ``fn`` runs again when AOTAutograd traces the joint graph with the gradients' real placements."""
    return torch.compiler.allow_in_graph(fn)
