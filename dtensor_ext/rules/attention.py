"""Fused attention kernels torch 2.13 cannot shard.

Attention is independent per (batch, head): softmax(q k^T * scale + mask) v never mixes two batch entries or
two heads, so sharding q, k, v, the output and the logsumexp alike on the batch dim or on the heads dim needs no
communication (heads only when q and k have as many heads, or, for the even-only CPU kernel, under grouped-query
attention: query head i reads key head i // (q heads / k heads), so equal even shards keep each group together).
The CPU kernel, which runs here, is also proven on two more splits:

* query rows: each query attends to all keys on its own, so q, the output and the logsumexp split along the
  query sequence with k and v whole; in the backward the key and value gradients are then partial sums over
  the query rows. Not with is_causal: the causal mask is laid out from each shard's own first row.
* linearity: the output is linear in v, and the backward is linear in the output gradient.

The CUDA kernels (flash, memory-efficient, the overrideable fused op) reuse exactly the batch/head split, and
only on dense batches (no variable-length cumulative sequence tensors) without dropout (a random mask drawn
per shard is not the one drawn on the whole). Their extra tensors (RNG state, debug masks) stay replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtensor_ext._compat import Partial, Replicate, RuntimeSchemaInfo, Shard, StridedShard
from dtensor_ext._compat import ShardingPlaceholder as S
from dtensor_ext.registry import single_dim_rule

FAMILY = "attention"

R = Replicate


@dataclass(frozen=True)
class Layout:
    """Where batch, heads and sequence sit in q, k, v, the output and their gradients."""

    batch: int
    heads: int
    seq: int


BHLE = Layout(batch=0, heads=1, seq=2)  # the SDPA layout (CPU flash, overrideable fused)
BLHE = Layout(batch=0, heads=2, seq=1)  # the CUDA flash / memory-efficient kernels
LOGSUMEXP = Layout(batch=0, heads=1, seq=2)  # every kernel's logsumexp is (batch, heads, query seq)
MASK = Layout(batch=0, heads=1, seq=2)  # masks and biases broadcast against (batch, heads, query seq, key seq)


@dataclass(frozen=True)
class Split:
    """One communication-free way to split attention: placements of each role."""

    query: object  # q, the output, the output gradient, the query gradient
    key_value: object  # k and v
    key_value_grad: object  # their gradients
    logsumexp: object
    mask: object  # attention mask / bias (and its gradient)


def _follow(meta, dim: int, rank: int = 4):
    """A broadcast operand aligned from the right against a `rank`-dim tensor split on `dim`."""
    if meta is None:
        return None
    d = dim - (rank - len(meta.shape))
    return R() if d < 0 or meta.shape[d] == 1 else S(d)


def mask_placements(query_placements, mask_shape) -> tuple:
    """Where a mask of `mask_shape` belongs once q (BHLE) is placed so: every split above gives the mask q's split
    of batch, heads or query rows (a size-1 dim broadcasts, so stays whole), and every other row keeps it whole."""
    placements = []
    for placement in query_placements:
        dim = placement.dim if isinstance(placement, (Shard, StridedShard)) else None
        own_dim = None if dim is None else dim - (4 - len(mask_shape))
        if own_dim is None or own_dim < 0 or mask_shape[own_dim] == 1:
            placements.append(R())
        elif isinstance(placement, StridedShard):
            placements.append(StridedShard(own_dim, split_factor=placement.split_factor))
        else:
            placements.append(Shard(own_dim))
    return tuple(placements)


def batch_head_splits(query, key, layout: Layout, mask=None, *, even_only: bool = False) -> list[Split]:
    """Batch and heads: every role split alike. With grouped-query attention (query head i reads key head
    i // group) a heads split keeps each query head with its key head only where every shard is even."""
    q_heads, k_heads = query.shape[layout.heads], key.shape[layout.heads]
    splits = []
    roles = [("batch", True), ("heads", q_heads == k_heads or even_only and k_heads and q_heads % k_heads == 0)]
    for role, allowed in roles:
        if not allowed:
            continue
        own = S(getattr(layout, role))
        splits.append(Split(own, own, own, S(getattr(LOGSUMEXP, role)), _follow(mask, getattr(MASK, role))))
    return splits


def query_row_split(layout: Layout, mask=None) -> Split:
    """Queries split along their sequence with keys and values whole: key/value gradients are partial sums."""
    return Split(S(layout.seq), R(), Partial("sum"), S(LOGSUMEXP.seq), _follow(mask, MASK.seq))


def _present(*metas):
    return [m for m in metas if m is not None]


# ---------------------------------------------------------------------------------------------------- CPU flash


def _cpu_splits(query, key, dropout_p, is_causal, mask):
    if dropout_p:
        return []
    splits = batch_head_splits(query, key, BHLE, mask, even_only=True)
    if not is_causal:
        splits.append(query_row_split(BHLE, mask))
    return splits


def _dropout_causal(args, kwargs, first):
    """(dropout_p, is_causal) from positional args starting at `first`, or their defaults."""
    dropout_p = args[first] if len(args) > first else kwargs.get("dropout_p", 0.0)
    is_causal = args[first + 1] if len(args) > first + 1 else kwargs.get("is_causal", False)
    return dropout_p, is_causal


# Even shards only: on torch 2.13 the CPU kernel kills the process (SIGFPE) when heads, query or key sequence are
# empty (or k has more heads than q), and so does the CUDA flash kernel on empty heads (H200, torch 2.11); an uneven
# shard can be empty.
_EVEN_SHARDS = {"family": FAMILY, "allow_uneven_sharding": False}


@single_dim_rule("aten::_scaled_dot_product_flash_attention_for_cpu", schema_info=RuntimeSchemaInfo(3), **_EVEN_SHARDS)
def cpu_flash_attention_rule(op, args, kwargs):
    """(q, k, v[, mask]) -> (out, logsumexp)."""
    query, key, value = args[:3]
    dropout_p, is_causal = _dropout_causal(args, kwargs, 3)
    mask = kwargs.get("attn_mask")
    rows = [
        [s.query, s.logsumexp, s.query, s.key_value, s.key_value, *_present(s.mask)]
        for s in _cpu_splits(query, key, dropout_p, is_causal, mask)
    ]
    if not dropout_p:  # out is linear in v (the logsumexp does not depend on it)
        extra = [R()] if mask is not None else []
        rows += [[Partial(k), R(), R(), R(), Partial(k), *extra] for k in ("sum", "avg")]
    return rows


@single_dim_rule(
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward", schema_info=RuntimeSchemaInfo(6), **_EVEN_SHARDS
)
def cpu_flash_attention_backward_rule(op, args, kwargs):
    """(grad_out, q, k, v, out, logsumexp[, mask]) -> (grad_q, grad_k, grad_v)."""
    grad_out, query, key, value, out, logsumexp, dropout_p, is_causal = args[:8]
    mask = kwargs.get("attn_mask")
    rows = [
        [s.query, s.key_value_grad, s.key_value_grad, s.query, s.query, s.key_value, s.key_value, s.query,
         s.logsumexp, *_present(s.mask)]
        for s in _cpu_splits(query, key, dropout_p, is_causal, mask)
    ]
    if not dropout_p:  # every gradient is linear in grad_out once out and logsumexp are fixed
        extra = [R()] if mask is not None else []
        rows += [[Partial(k)] * 3 + [Partial(k)] + [R()] * 5 + extra for k in ("sum", "avg")]
    return rows


# ------------------------------------------------------------------------------------------- CUDA-only kernels


def _dense_splits(query, key, layout, dropout_p, mask=None, ragged=()):
    """Batch/head splits of a CUDA kernel, or none where the batch is ragged or dropout is on."""
    if dropout_p or any(m is not None and any(m.shape) for m in ragged):
        return []
    return batch_head_splits(query, key, layout, mask)


@single_dim_rule("aten::_flash_attention_forward", **_EVEN_SHARDS, schema_info=RuntimeSchemaInfo(3))
def flash_attention_rule(op, args, kwargs):
    """(q, k, v, cum_seq_q?, cum_seq_k?) -> (out, logsumexp, rng_state, unused, debug_attn_mask); BLHE."""
    query, key, value, cum_seq_q, cum_seq_k = args[:5]
    extras = [kwargs.get(k) for k in ("seqused_k", "alibi_slopes", "block_table")]
    if any(e is not None for e in extras):  # paged / ALiBi / per-batch key lengths: not proven, not claimed
        return []
    dropout_p = args[7]
    return_debug_mask = args[9]
    return [
        [s.query, s.logsumexp, R(), R(), s.logsumexp if return_debug_mask else R(),
         s.query, s.key_value, s.key_value, *(R() for _ in _present(cum_seq_q, cum_seq_k))]
        for s in _dense_splits(query, key, BLHE, dropout_p, ragged=(cum_seq_q, cum_seq_k))
    ]


@single_dim_rule("aten::_flash_attention_backward", **_EVEN_SHARDS, schema_info=RuntimeSchemaInfo(8))
def flash_attention_backward_rule(op, args, kwargs):
    """(grad_out, q, k, v, out, logsumexp, cum_seq_q, cum_seq_k, rng_state, unused) -> grads; BLHE."""
    grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k = args[:8]
    dropout_p = args[10]
    rng_state, unused = args[12:14]
    aux = _present(cum_seq_q, cum_seq_k, rng_state, unused)
    return [
        [s.query, s.key_value, s.key_value, s.query, s.query, s.key_value, s.key_value, s.query, s.logsumexp,
         *(R() for _ in aux)]
        for s in _dense_splits(query, key, BLHE, dropout_p, ragged=(cum_seq_q, cum_seq_k))
    ]


@single_dim_rule("aten::_efficient_attention_forward", **_EVEN_SHARDS, schema_info=RuntimeSchemaInfo(3))
def efficient_attention_rule(op, args, kwargs):
    """(q, k, v, bias?, cu_seqlens_q?, cu_seqlens_k?[, seqlen_k]) -> (out, logsumexp, philox_seed, philox_offset)."""
    query, key, value, bias, cu_seqlens_q, cu_seqlens_k = args[:6]
    dropout_p = args[8]
    seqlen_k = kwargs.get("seqlen_k")
    return [
        [s.query, s.logsumexp, R(), R(), s.query, s.key_value, s.key_value, *_present(s.mask)]
        for s in _dense_splits(query, key, BLHE, dropout_p, bias, ragged=(cu_seqlens_q, cu_seqlens_k, seqlen_k))
    ]


@single_dim_rule("aten::_efficient_attention_backward", **_EVEN_SHARDS, schema_info=RuntimeSchemaInfo(8))
def efficient_attention_backward_rule(op, args, kwargs):
    """(grad_out, q, k, v, bias?, out, cu_seqlens_q?, cu_seqlens_k?, logsumexp, philox_seed, philox_offset)
    -> (grad_q, grad_k, grad_v, grad_bias)."""
    grad_out, query, key, value, bias, out, cu_seqlens_q, cu_seqlens_k = args[:8]
    dropout_p = args[11]
    return [
        [s.query, s.key_value, s.key_value, s.mask if bias is not None else R(),
         s.query, s.query, s.key_value, s.key_value, *_present(s.mask), s.query,
         *(R() for _ in _present(cu_seqlens_q, cu_seqlens_k)), s.logsumexp, R(), R()]
        for s in _dense_splits(query, key, BLHE, dropout_p, bias, ragged=(cu_seqlens_q, cu_seqlens_k))
    ]


@single_dim_rule(
    "aten::_scaled_dot_product_fused_attention_overrideable", **_EVEN_SHARDS, schema_info=RuntimeSchemaInfo(4)
)
def fused_attention_overrideable_rule(op, args, kwargs):
    """(q, k, v, attn_bias?) -> (out, logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset, debug_mask)."""
    query, key, value = args[:3]
    attn_bias = args[3] if len(args) > 3 else kwargs.get("attn_bias")
    dropout_p = args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)
    return [
        [s.query, s.logsumexp, R(), R(), R(), R(), R(), s.query, s.key_value, s.key_value, *_present(s.mask)]
        for s in _dense_splits(query, key, BHLE, dropout_p, attn_bias)
    ]


@single_dim_rule(
    "aten::_scaled_dot_product_fused_attention_overrideable_backward",
    **_EVEN_SHARDS,
    schema_info=RuntimeSchemaInfo(5),
)
def fused_attention_overrideable_backward_rule(op, args, kwargs):
    """(grad_out, q, k, v, attn_bias, out, logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset)
    -> (grad_q, grad_k, grad_v, grad_bias)."""
    grad_out, query, key, value, attn_bias = args[:5]
    out, logsumexp, cum_seq_q, cum_seq_k, philox_seed, philox_offset = args[6:12]
    dropout_p = args[12]
    aux = _present(cum_seq_q, cum_seq_k, philox_seed, philox_offset)
    return [
        [s.query, s.key_value, s.key_value, s.mask if attn_bias is not None else R(),
         s.query, s.query, s.key_value, s.key_value, *_present(s.mask), s.query, s.logsumexp, *(R() for _ in aux)]
        for s in _dense_splits(query, key, BHLE, dropout_p, attn_bias, ragged=(cum_seq_q, cum_seq_k))
    ]
