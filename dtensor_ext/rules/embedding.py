"""`embedding_renorm_` (F.embedding with `max_norm`), which torch 2.13 has no strategy for.

It rescales, in place, every weight row the indices name whose norm exceeds max_norm. Index values are global row
numbers, so a vocab-sharded weight would rescale the wrong local rows; a row's norm needs the whole row, so the
embedding dim cannot shard either; and sharded indices would rescale different rows on different replicas. Only the
all-Replicate layout (implied by every rule) is valid: declaring no other row gives DTensor a strategy at all.
"""

from __future__ import annotations

from dtensor_ext._compat import RuntimeSchemaInfo
from dtensor_ext.registry import single_dim_rule


@single_dim_rule("aten::embedding_renorm_", family="indexing", schema_info=RuntimeSchemaInfo(2))
def embedding_renorm_rule(op, args, kwargs):
    return []
