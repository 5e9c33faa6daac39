"""torch.compile applies the pass as an inductor post-grad custom pass (CPU inductor, fake 4-rank group)."""

from __future__ import annotations

import torch
import torch._inductor.config as inductor_config
from expecttest import assert_expected_inline
from torch._inductor.utils import run_and_get_code

from dtensor_ext.passes.inductor import SequenceParallelPass
from dtensor_ext.testing import simulated_mesh
from dtensor_ext.testing.mesh import active_mode
from tests.passes.graphs import all_reduce, rms

T, H, F_ = 8, 16, 8
INPUTS = (torch.randn(T, H), torch.randn(H), torch.randn(H, F_), torch.randn(F_, H))


def test_compiled_block_gets_reduce_scatter_and_all_gather():
    compile_pass = SequenceParallelPass()
    with simulated_mesh((4,)) as mesh, active_mode().disable():
        group = mesh.get_group().group_name

        def block(e, ln, w1, w2):
            h = all_reduce(e, group)
            h = h + all_reduce(torch.nn.functional.silu(rms(h, ln) @ w1) @ w2, group)
            return rms(h, ln)

        with inductor_config.patch(post_grad_custom_post_pass=compile_pass, fx_graph_cache=False):
            out, (code, *_) = run_and_get_code(torch.compile(block, fullgraph=True), *INPUTS)
    assert out.shape == (T, H)
    assert_expected_inline(
        "\n".join(r.summary() for r in compile_pass.reports),
        """sequence_parallel: 2/2 all_reduce -> reduce_scatter (P1=1, P3=1), 2 all_gather inserted""",
    )
    assert "all_reduce" not in code
    assert code.count("reduce_scatter_tensor") >= 2 and code.count("all_gather_into_tensor") >= 2


def test_uuid_is_stable_and_follows_options():
    assert SequenceParallelPass().uuid() == SequenceParallelPass().uuid()
    assert SequenceParallelPass(token_dim=0).uuid() != SequenceParallelPass().uuid()
    rules = {torch.ops.aten.gelu.default: lambda node, dims, size: None}
    assert SequenceParallelPass(token_local=rules).uuid() == SequenceParallelPass(token_local=dict(rules)).uuid()
