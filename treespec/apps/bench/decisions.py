"""What each decoder chose in a bench run: drafted and AR rounds, explorations, tree sizes, and the
break-even the cost-aware methods priced with, so a reader sees why a method ran as AR.

Contract: `decisions_table(records, order)` is a pure function of the records' ``decisions`` (filled by
`treespec.apps.bench.records.decisions_of` for every method but AR) and ``cost_models``: one row per
method that priced its trees (a cost model) or ran any round without drafting; "" when none did.  The
break-even is the τ a tree of the method's budget needs to match AR under the last curve the method
priced with, at the curve's shortest context: (C_d + C_v(B + 1)) / C_v(1).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from treespec.apps.bench.records import BenchRecord

__all__ = ["LEGEND", "break_even", "decisions_table"]

LEGEND = ("rounds that drafted and that ran as AR steps, explorations, the mean tokens of a drafted round's tree, "
          "the generations decoded without drafting, and the tau a tree of the budget needs to match AR under the "
          "last curve the method priced with")


def break_even(model: dict, budget: int) -> float | None:
    """The τ a tree of ``budget`` non-root nodes needs under ``model`` (a `CostModel.to_dict` form),
    or None when the record's model cannot be read back."""
    from treespec.pricing.cost import CostModelError, cost_model_from_dict

    try:
        cost = cost_model_from_dict({k: v for k, v in model.items() if k != "calibration"})
    except (CostModelError, ValueError, KeyError, TypeError):
        return None
    context = min(getattr(cost, "contexts", None) or (0,))
    verify = cost.verify_costs(budget + 1, context)
    return float((cost.draft_cost + verify[budget + 1]) / verify[1])


def decisions_table(records: Sequence[BenchRecord], order: Sequence[str]) -> str:
    """The table of the module docstring (methods in ``order``)."""
    by_method: dict[str, list[BenchRecord]] = defaultdict(list)
    for r in records:
        if r.decisions:
            by_method[r.method].append(r)
    rows = []
    for method in (m for m in order if m in by_method):
        rs = by_method[method]
        total = {k: sum(r.decisions.get(k, 0) for r in rs) for k in ("drafted", "ar", "explored", "tree_tokens")}
        undrafted = sum(bool(r.decisions.get("undrafted")) for r in rs)
        priced = [m for r in rs for m in r.cost_models]
        if not priced and not total["ar"]:
            continue
        size = total["tree_tokens"] / total["drafted"] if total["drafted"] else 0.0
        even = break_even(priced[-1], rs[0].budget) if priced and rs[0].budget else None
        rows.append(f"{method:<26}{total['drafted']:>8}{total['ar']:>6}{total['explored']:>9}{size:>11.1f}"
                    f"{undrafted:>5}/{len(rs):<4}{'' if even is None else f'{even:.2f}':>12}")
    if not rows:
        return ""
    head = (f"{'what it decided':<26}{'drafted':>8}{'AR':>6}{'explored':>9}{'tree size':>11}{'no-draft':>10}"
            f"{'break-even':>12}")
    return "\n".join([head, "-" * len(head), *rows])
