"""Random chains of token-local and token-mixing ops around all_reduces: the pass keeps numerics, rewrites a
layer exactly when its chain starts with token-local arithmetic (a later token-mixing op reads gathered tokens)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from dtensor_ext.passes import sequence_parallel
from dtensor_ext.testing import simulated_mesh
from tests.passes.graphs import WORLD, all_reduce, per_rank, rms, run, trace

H = 8
TOKEN_LOCAL = {
    "silu": lambda x: F.silu(x),
    "scale": lambda x, w: x * w,
    "rms_norm": lambda x, w: rms(x, w),
    "layer_norm": lambda x, w: F.layer_norm(x, (H,), w, w),
    "softmax_hidden": lambda x: torch.softmax(x, -1),
    "center_hidden": lambda x: x - x.mean(-1, keepdim=True),
    "split_heads_view": lambda x: (x.view(x.shape[0], 2, H // 2) * 2).view(x.shape[0], H),
}
MIXES_TOKENS = {
    "softmax_tokens": lambda x: torch.softmax(x, 0),
    "cumsum_tokens": lambda x: x.cumsum(0),
    "flip_tokens": lambda x: x.flip(0),
}
OPS = {**TOKEN_LOCAL, **MIXES_TOKENS}
chains = st.lists(st.lists(st.sampled_from(sorted(OPS)), max_size=3), min_size=1, max_size=3)


def apply(name, x, w):
    fn = OPS[name]
    return fn(x, w) if fn.__code__.co_argcount == 2 else fn(x)


@given(chains=chains, tokens=st.sampled_from([8, 12, 6]))
def test_random_chains_keep_numerics(chains, tokens):
    partial, weights, scale = per_rank(tokens, H, seed=0), per_rank(len(chains), H, H, seed=1), per_rank(H, seed=2)[0]
    with simulated_mesh((WORLD,)) as mesh:
        group = mesh.get_group().group_name

        def model(p, ws, w):
            x = p
            for layer, chain in enumerate(chains):
                h = all_reduce(x, group)
                for name in chain:
                    h = apply(name, h, w)
                x = h @ ws[layer]
            return x

        inputs = [partial, weights, scale]
        examples = [partial[0], weights[0], scale]
        before = run(trace(model, *examples), inputs)
        gm = sequence_parallel(trace(model, *examples))
        gm.graph.lint()
        after = run(gm, inputs)
        for rank in range(WORLD):
            torch.testing.assert_close(after[0][rank], before[0][rank])

    expected = sum(tokens % WORLD == 0 and bool(chain) and chain[0] not in MIXES_TOKENS for chain in chains)
    assert gm.meta["sequence_parallel"].converted == expected
