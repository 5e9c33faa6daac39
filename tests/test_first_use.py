"""`import dtensor_ext` installs the rules at once and the torch fixes at DTensor's first use, to the same end state."""

import os
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

from dtensor_ext import _compat

# Run in a fresh interpreter: torch._dynamo and the fixes' handlers must be absent after the import, and the first
# use (FIRST_USE) must leave exactly what an explicit install() leaves.
FRESH = r"""
import os, sys
import torch
from torch.distributed.tensor import DTensor, Replicate
pristine, new = dict(DTensor._op_dispatcher._custom_op_handlers), DTensor.__dict__["__new__"]
import dtensor_ext
from dtensor_ext import _compat
assert "torch._dynamo" not in sys.modules, "import dtensor_ext pulled torch._dynamo"
assert dict(DTensor._op_dispatcher._custom_op_handlers) == pristine, "fixes applied at import"
assert dtensor_ext.is_installed()
FIRST_USE
fast = os.environ.get("DTENSOR_EXT_FAST_PROPAGATION") == "1"
assert dtensor_ext.fast_propagation.is_enabled() == fast, "the first use changed the N-D expansion"
assert DTensor.__dict__["__new__"] is new
assert "propagate_op_sharding_non_cached" not in vars(_compat.propagator())
def state():
    handlers = {str(op): h.__qualname__ for op, h in DTensor._op_dispatcher._custom_op_handlers.items()}
    return handlers, sorted((e.op, e.family, e.status) for e in dtensor_ext.registry.__wrapped__())
lazy = state()
assert any(family == "torch fix" and status == "fixed" for _, family, status in lazy[1])
dtensor_ext.uninstall()
dtensor_ext.install()
assert state() == lazy, "the first use left another state than install()"
print("ok")
"""

FIRST_USES = {
    "a DTensor made": "DTensor.from_local(torch.zeros(2), _compat.probe_mesh((2,)), [Replicate()], run_check=False)",
    "a strategy asked for": "_compat.propagator().propagate_op_sharding(_compat.OpSchema(torch.ops.aten.neg.default, "
                            "(_compat.probe_spec(torch.zeros(2), (Replicate(),)),), {}))",
}


@pytest.mark.parametrize("first_use, fast", [(use, False) for use in FIRST_USES] + [("a DTensor made", True)],
                         ids=["dtensor", "propagation", "dtensor-fast-propagation"])
def test_fixes_wait_for_the_first_use_and_then_match_install(first_use, fast):
    code = FRESH.replace("FIRST_USE", FIRST_USES[first_use])
    env = {**os.environ, "DTENSOR_EXT_FAST_PROPAGATION": "1" if fast else "0"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_hook_runs_once_outside_modes_and_leaves_torch_as_it_was(mesh_1d2):
    """Here, under the simulated ranks of `mesh_1d2`, as the first DTensor of a test would be made."""
    prop = _compat.propagator()
    new, cached = DTensor.__dict__["__new__"], prop.__dict__["propagate_op_sharding"]
    seen = []

    def callback():
        seen.append(_compat.enabled_local_tensor_mode())
        DTensor.from_local(torch.zeros(2), _compat.probe_mesh((2,)), [Replicate()], run_check=False)  # passes through

    settle = _compat.at_first_dtensor_use(callback)
    assert DTensor.__dict__["__new__"] is not new
    DTensor.from_local(torch.zeros(2), mesh_1d2, [Replicate()], run_check=False)
    DTensor.from_local(torch.zeros(2), mesh_1d2, [Replicate()], run_check=False)
    settle(True)
    assert seen == [None]  # once, outside LocalTensorMode
    assert DTensor.__dict__["__new__"] is new and prop.__dict__["propagate_op_sharding"] is cached
    assert "propagate_op_sharding_non_cached" not in prop.__dict__


def test_settle_runs_or_drops_a_waiting_callback():
    ran = []
    _compat.at_first_dtensor_use(lambda: ran.append("run"))(True)
    _compat.at_first_dtensor_use(lambda: ran.append("dropped"))(False)
    DTensor.from_local(torch.zeros(2), _compat.probe_mesh((2,)), [Replicate()], run_check=False)  # nothing fires
    assert ran == ["run"]


# The first DTensor use of a process inside a meta device, a default device or a fake mode, as torchtitan-style
# meta-device init does it (issue 38): the deferred fixes' feature probes must run on real CPU tensors there, leave
# the DTensor as torch alone makes it, and reach the same verdicts as an install() outside any mode.
UNDER_A_MODE = r"""
import sys, tempfile
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
import dtensor_ext
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
AMBIENT
weight = model.weight
assert isinstance(weight, DTensor) and weight.placements == (Shard(0),), weight
local = weight._local_tensor
assert weight.device.type == DEVICE and type(local).__name__ == LOCAL, (weight.device, type(local))
def state():
    return sorted((e.op, e.family, e.status) for e in dtensor_ext.registry.__wrapped__())
lazy = state()
assert any(family == "torch fix" and status == "fixed" for _, family, status in lazy)
dtensor_ext.uninstall()
dtensor_ext.install()
assert state() == lazy, "the probes decided otherwise under the mode than outside it"
dist.destroy_process_group()
print("ok")
"""

AMBIENTS = {  # how the first use is made -> (code, the weight's device type, its local tensor's type)
    "meta device": ("with torch.device('meta'):\n"
                    "    model = parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())", "meta", "Tensor"),
    "default device": ("torch.set_default_device('meta')\nmodel = parallelize_module(nn.Linear(4, 4), mesh, "
                       "ColwiseParallel())\ntorch.set_default_device('cpu')", "meta", "Tensor"),
    "fake mode": ("from torch._subclasses.fake_tensor import FakeTensorMode\nwith FakeTensorMode():\n    model = "
                  "parallelize_module(nn.Linear(4, 4), mesh, ColwiseParallel())", "cpu", "FakeTensor"),
}


@pytest.mark.parametrize("ambient", sorted(AMBIENTS))
def test_first_use_under_a_meta_device_or_a_fake_mode_parallelizes_as_torch_does(ambient):
    code, device, local = AMBIENTS[ambient]
    program = UNDER_A_MODE.replace("AMBIENT", code).replace("DEVICE", repr(device)).replace("LOCAL", repr(local))
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
