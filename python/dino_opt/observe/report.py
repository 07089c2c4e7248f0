"""The text of ``dino-opt report``: the analyser's convergence, performance and
checkpoint reports as aligned tables."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["format_report"]


# ------------------------------------------------------------------- text


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Plain-text columns: the first left-aligned, the others right-aligned."""
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return (indent + "  ".join(parts)).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def _convergence_lines(c: Mapping[str, Any]) -> list[str]:
    loss = c.get("loss") or {}
    lines = [f"Convergence ({c.get('rows', 0)} logged rows, {loss.get('points', 0)} finite losses)"]
    for key in ("first", "last", "min"):
        point = loss.get(key)
        if point:
            lines.append(
                f"  loss {key:<5} {_fmt(point['value'], '.5g'):>10}  (step {point['step']})"
            )
    trend = c.get("trend")
    if trend:
        lines.append(
            f"  trend        {_fmt(trend['per_1k_steps'], '+.4g')} per 1k steps "
            f"(least squares, steps {trend['from_step']}-{trend['to_step']})"
        )
    plateau = c.get("plateau")
    if plateau:
        imp = plateau["relative_improvement"]
        lines.append(
            f"  plateau      {_fmt(plateau['detected'])}: smoothed loss improved "
            f"{_fmt(None if imp is None else 100 * imp, '.3g')}% over the last "
            f"{plateau['window_points']} points (steps {plateau['from_step']}-"
            f"{plateau['to_step']}), threshold {_fmt(100 * plateau['threshold'], '.3g')}%"
        )
    nf = c.get("nonfinite") or {}
    if nf.get("seen"):
        lines.append(
            f"  non-finite   yes, first at step {nf.get('first_step')} "
            f"({nf.get('rows_with_nonfinite_loss', 0)} rows with a non-finite loss, "
            f"{_fmt(nf.get('nonfinite_steps', 0), 'g')} skipped steps)"
        )
    else:
        lines.append("  non-finite   no")
    alerts = c.get("alerts") or {}
    if alerts:
        text = ", ".join(
            f"{name} x{a['count']} (first at step {a['first_step']})" for name, a in alerts.items()
        )
        lines.append(f"  alerts       {text}")
    else:
        lines.append("  alerts       none")
    lines.append(f"  verdict      {c.get('verdict')}")
    return lines


def _performance_lines(p: Mapping[str, Any]) -> list[str]:
    lines = []
    t = p.get("throughput")
    if t:
        note = ", first row left out as warm-up" if t.get("warmup_excluded") else ""
        lines.append(
            f"Throughput (images/s over {t['rows']} logged rows{note}): median "
            f"{_fmt(t['median'], '.1f')}, p10 {_fmt(t['p10'], '.1f')}, p90 {_fmt(t['p90'], '.1f')}"
        )
    else:
        lines.append("Throughput: no logged images/s")
    mem = p.get("peak_memory_gb") or {}
    if mem:
        lines.append(
            "Peak memory (GiB): " + ", ".join(f"{k} {_fmt(v, '.3f')}" for k, v in mem.items())
        )
    prof = p.get("profile")
    if prof and prof.get("phases"):
        lines.append(
            f"Time per phase ({prof.get('clock')} clock, {prof.get('steps')} profiled steps):"
        )
        body = [
            [
                name,
                _fmt(ph.get("mean"), ".4f"),
                _fmt(ph.get("median"), ".4f"),
                _fmt(ph.get("p90"), ".4f"),
                _fmt(ph.get("total"), ".2f"),
                _fmt(None if ph.get("share_of_step") is None else 100 * ph["share_of_step"], ".1f"),
            ]
            for name, ph in prof["phases"].items()
        ]
        other = prof.get("other_share_of_step")
        body.append(["other", "", "", "", "", _fmt(None if other is None else 100 * other, ".1f")])
        lines += _table(["phase", "mean s", "median s", "p90 s", "total s", "share %"], body)
    else:
        lines.append("Time per phase: no profile.json")
    return lines


def _checkpoint_lines(r: Mapping[str, Any]) -> list[str]:
    s = r.get("summary") or {}
    lines = [
        f"Checkpoints ({s.get('count', 0)} in {r.get('checkpoint_dir')}: "
        f"{s.get('verified', 0)} verified, {s.get('skipped', 0)} skipped, "
        f"{s.get('milestones', 0)} milestone(s), {_fmt(s.get('total_size', 0) / 1e6, '.1f')} MB)"
    ]
    evolution = r.get("evolution") or []
    if not evolution:
        return lines
    modules = []
    for row in evolution:
        modules += [m for m in row.get("modules", {}) if m not in modules]
    sizes = {c["path"]: c.get("size") for c in r.get("checkpoints", [])}
    headers = ["epoch", "step", "milestone", "MB", "|student|", "drift prev", "drift first"]
    headers += ["teacher dist"] + [f"{m} drift first" for m in modules]
    body, notes = [], []
    for row in evolution:
        size = sizes.get(row["path"])
        cells = [
            str(row["epoch"]),
            str(row["step"]),
            "yes" if row.get("milestone") else "",
            _fmt(None if size is None else size / 1e6, ".1f"),
        ]
        if row.get("skipped"):
            cells += ["skipped"] + [""] * (len(headers) - len(cells) - 1)
            notes.append(f"  step {row['step']}: skipped, {row.get('reason')}")
        else:
            cells += [
                _fmt(row.get("student_norm"), ".5g"),
                _fmt(row.get("drift_from_previous"), ".3e"),
                _fmt(row.get("drift_from_first"), ".3e"),
                _fmt(row.get("teacher_student_distance"), ".3e"),
            ]
            mods = row.get("modules", {})
            cells += [_fmt(mods.get(m, {}).get("drift_from_first"), ".3e") for m in modules]
        body.append(cells)
    return lines + _table(headers, body) + notes


#: The evaluation's numbers in a run's report.json: (key stem, label).
EVALUATION_KEYS = (
    ("knn_top1", "k-NN top-1"),
    ("linear_top1", "linear probe top-1"),
    ("logreg_top1", "logistic regression top-1"),
    ("dense_miou", "dense mIoU"),
)


def _evaluation_lines(run: Mapping[str, Any], pictures: Sequence[str]) -> list[str]:
    """The trained teacher against random initialisation, val and test."""
    lines = []
    for stem, label in EVALUATION_KEYS:
        for split, prefix in (("val", stem), ("test", stem.replace("_", "_test_", 1))):
            trained, rand = run.get(f"{prefix}_trained"), run.get(f"{prefix}_random_init")
            if trained is not None and rand is not None:
                lines.append(
                    f"  {label} ({split}): {_fmt(trained, '.1f')} % trained vs "
                    f"{_fmt(rand, '.1f')} % at random init"
                )
    if run.get("verdict"):
        lines.append(f"  warning: {run['verdict']}")
    if pictures:
        lines.append(f"  pictures: {len(pictures)} in {Path(pictures[0]).parent}")
    return ["", "Evaluation:", *lines] if lines else []


def format_report(report: Mapping[str, Any]) -> str:
    """A plain-text summary of :meth:`DINOTrainingAnalyzer.generate_report`'s
    dict (what ``dino-opt report`` prints). Also takes the dict of
    ``generate_checkpoint_report`` or ``generate_performance_report`` alone."""
    if "checkpoints" in report and isinstance(report["checkpoints"], Mapping):
        ck, perf = report.get("checkpoints"), report.get("performance")
    elif "evolution" in report:
        ck, perf = report, None
    else:
        ck, perf = None, report
    lines = [f"Run: {report.get('run_dir') or '-'}"]
    files = []
    if perf:
        lines += ["", *_convergence_lines(perf.get("convergence") or {})]
        lines += ["", *_performance_lines(perf)]
        lines += _evaluation_lines(perf.get("run_report") or {}, perf.get("pictures") or [])
        files += [perf.get("report"), perf.get("plot")]
    if ck:
        lines += ["", *_checkpoint_lines(ck)]
        files += [ck.get("report"), ck.get("plot")]
    files = [f for f in files if f]
    if files:
        lines += ["", "Written: " + ", ".join(files)]
    return "\n".join(lines) + "\n"
