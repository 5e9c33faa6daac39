"""Single-dim strategies from a factor signature such as ``"mk,kn->mn"``.

Each letter names a factor (a tensor dim shared by name across operands). For one mesh dim:

* a factor that reaches the output may be sharded everywhere it appears: every operand holding it is sharded on
  it, the rest are replicated;
* a factor contracted away (in the operands, not in the output) may be sharded in every operand holding it; the
  output is then Partial, as are the operands marked additive (a bias added to the product);
* where the op is linear in an operand, a Partial (sum/avg) operand with the others replicated gives a Partial
  output, additive operands Partial alongside (for avg they may also stay replicated, or be the only Partial).

Operands are aligned to their letters from the right, and an operand whose dim is 1 where the output's is not (a
broadcast bias) is replicated instead of sharded. Absent optional operands (``None`` metas) are skipped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from dtensor_ext._compat import Partial, Replicate, ShardingPlaceholder, TensorMeta

__all__ = ["FactorSignature", "factor_strategies"]


@dataclass(frozen=True)
class FactorSignature:
    inputs: tuple[str, ...]
    output: str

    @classmethod
    def parse(cls, text: str) -> FactorSignature:
        lhs, arrow, rhs = text.replace(" ", "").partition("->")
        if not arrow:
            raise ValueError(f"factor signature {text!r}: expected 'operands->output', e.g. 'mk,kn->mn'")
        inputs = tuple(lhs.split(","))
        for letters in (*inputs, rhs):
            if not letters.isalpha() and letters != "":
                raise ValueError(f"factor signature {text!r}: operand {letters!r} must be letters only")
            if len(set(letters)) != len(letters):
                raise ValueError(f"factor signature {text!r}: operand {letters!r} repeats a factor")
        return cls(inputs, rhs)


def _operand_dims(letters: str, meta: TensorMeta | None, out_sizes: dict[str, int]) -> dict[str, int]:
    """factor -> tensor dim of this operand, leaving out broadcast (size-1 or missing) dims."""
    if meta is None:
        return {f: d for d, f in enumerate(letters)}
    ndim = len(meta.shape)
    if ndim > len(letters):
        raise ValueError(f"operand of rank {ndim} has more dims than its factors {letters!r}")
    aligned = letters[len(letters) - ndim :]
    return {
        f: d
        for d, f in enumerate(aligned)
        if not (meta.shape[d] == 1 and out_sizes.get(f, 1) != 1)
    }


def factor_strategies(
    signature: str | FactorSignature,
    metas: Sequence[TensorMeta | None] | None = None,
    *,
    additive: Sequence[int] = (),
    contracted_reductions: Sequence[str] = ("sum",),
    linear_reductions: Sequence[str] = ("sum", "avg"),
    linear_in: Sequence[int] | None = None,
) -> list[list]:
    """Rows ``[output, *operands]`` for one mesh dim; operands whose meta is None are omitted from the rows.

    additive: operands added to the product (bias); they go Partial whenever the output does.
    contracted_reductions: the Partial kinds a contracted factor produces (``("sum",)`` for products).
    linear_reductions: the Partial kinds that pass through an operand the op is linear in.
    linear_in: the operands the op is linear in (default: every non-additive operand).
    """
    sig = FactorSignature.parse(signature) if isinstance(signature, str) else signature
    if metas is None:
        metas, present = [None] * len(sig.inputs), list(range(len(sig.inputs)))
    else:
        metas = list(metas)
        if len(metas) != len(sig.inputs):
            raise ValueError(f"signature {signature!r} has {len(sig.inputs)} operands, got {len(metas)} metas")
        present = [i for i, m in enumerate(metas) if m is not None]
    out_sizes = _output_sizes(sig, metas)
    dims = {i: _operand_dims(sig.inputs[i], metas[i], out_sizes) for i in present}
    products = [i for i in present if i not in additive]
    rows: list[list] = []

    def row(output, per_operand) -> list:
        return [output, *(per_operand(i) for i in present)]

    for factor in dict.fromkeys("".join(sig.inputs) + sig.output):
        holders = [i for i in present if factor in dims[i]]
        if not holders:
            continue
        if factor in sig.output:
            out = ShardingPlaceholder(sig.output.index(factor))
            rows.append(row(out, lambda i: ShardingPlaceholder(dims[i][factor]) if i in holders else Replicate()))
        else:
            for reduce_op in contracted_reductions:
                partial = Partial(reduce_op)

                def operand(i, partial=partial):
                    if i in holders:
                        return ShardingPlaceholder(dims[i][factor])
                    return partial if i in additive else Replicate()

                rows.append(row(partial, operand))
    for i in products if linear_in is None else linear_in:
        for reduce_op in linear_reductions:
            partial = Partial(reduce_op)
            rows.append(row(partial, lambda j, i=i, p=partial: p if j == i or j in additive else Replicate()))
            if reduce_op == "avg" and additive:  # the mean of (b + x_r) is b + mean(x_r): b may stay replicated
                rows.append(row(partial, lambda j, i=i, p=partial: p if j == i else Replicate()))
    if "avg" in linear_reductions and additive:  # likewise mean(b_r) + x is the mean of (b_r + x)
        rows.append(row(Partial("avg"), lambda j: Partial("avg") if j in additive else Replicate()))
    return rows


def _output_sizes(sig: FactorSignature, metas: Sequence[TensorMeta | None]) -> dict[str, int]:
    """Size of each factor in the result: the largest size any operand gives it (broadcasting)."""
    sizes: dict[str, int] = {}
    for letters, meta in zip(sig.inputs, metas):
        if meta is None:
            continue
        aligned = letters[len(letters) - len(meta.shape) :]
        for f, size in zip(aligned, meta.shape):
            sizes[f] = max(sizes.get(f, 1), int(size))
    return sizes
