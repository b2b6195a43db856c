"""What ``specdec bench`` reports: per-method figures (JSON), a table, and a plot (matplotlib, optional).

Per method, over all prompts: tokens/s = tokens / wall seconds, and its ratio to target_only's;
from the speculation counters: acceptance rate alpha = accepted / draft tokens (at k > 1 this counts
the drafts after a first rejection too, so it is lower than the per-token acceptance of
(1 - alpha^(k+1)) / (1 - alpha)), mean accepted length = 1 + accepted / drafts, overlap hit rate =
predrafted steps / steps that drafted; and the
wall time of a step (wall time / verification steps) split into verify (the target's forward and
rejection rule), draft (what steps waited for their blocks) and the rest (network and everything
else: hand-offs, detokenizing, prefill, the client call).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from specdec.bench_common import machine
from specdec.bench_methods import BASELINE
from specdec.core.sessions import SpecCounters


def report(config, results) -> dict:
    """The JSON report of one run (``config``: BenchConfig, ``results``: specdec.bench.Results)."""
    rows = {m.name: _row(m.family, results.runs[m.name]) for m in results.methods}
    base = rows[BASELINE]["tokens_per_s"]
    for row in rows.values():
        row["ratio_vs_target_only"] = round(row["tokens_per_s"] / base, 3) if base else None
    return {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(),
        "config": {"target": config.target, "draft": config.draft, "prompts": len(config.prompts),
                   "prompt_source": config.prompt_source, "max_new_tokens": config.max_new_tokens, "k": list(config.ks),
                   "methods_filter": list(config.methods), "distributed": any(m.distributed for m in results.methods),
                   "redis_url": config.redis_url, "threads": config.threads,
                   "draft_min_confidence": config.draft_min_confidence, "greedy": True,
                   "device": config.device, "dtype": config.dtype, "runner": config.runner,
                   "draft_device": config.draft_device, "draft_dtype": config.draft_dtype},
        "outputs_identical": not results.mismatches, "mismatches": results.mismatches,
        "methods": rows, "prompts": list(config.prompts),
    }


def _row(family: str, runs: list) -> dict:
    tokens = sum(len(r.token_ids) for r in runs)
    seconds = sum(r.seconds for r in runs)
    row = {"family": family, "tokens": tokens, "seconds": round(seconds, 4),
           "tokens_per_s": round(tokens / seconds, 2) if seconds else 0.0,
           "seconds_per_prompt": [round(r.seconds, 4) for r in runs]}
    if not runs or runs[0].counters is None:  # target_only: one forward per token, not split
        row["ms_per_step"] = {"total": round(1e3 * seconds / max(1, tokens), 3)}
        return row
    c = SpecCounters()
    for r in runs:
        c = c.plus(r.counters)
    steps = max(1, c.verify_steps)
    total, verify, draft = 1e3 * seconds / steps, c.verify_time_ns / 1e6 / steps, c.draft_wait_ns / 1e6 / steps
    row.update({
        "counters": c.to_dict(), "acceptance_rate": round(c.acceptance_rate, 4),
        "mean_accepted_length": round(c.mean_accepted_length, 4),
        "overlap_hit_rate": round(c.predrafted_steps / c.drafts, 4) if c.drafts else None,
        "ms_per_step": {"total": round(total, 3), "verify": round(verify, 3), "draft": round(draft, 3),
                        "network_other": round(total - verify - draft, 3)},
    })
    return row


def table(rep: dict) -> str:
    """A fixed-width table of the report, and whether all outputs were identical."""
    head = f"{'method':<24} {'tok/s':>7} {'vs HF':>6} {'acc len':>7} {'alpha':>5} {'hit':>5} {'ms/step':>7} " \
           f"{'verify':>6} {'draft':>6} {'net+oth':>7}"
    lines = [head, "-" * len(head)]

    def f(x, fmt):
        return "-" if x is None else format(x, fmt)

    for name, r in rep["methods"].items():
        ms = r["ms_per_step"]
        lines.append(f"{name:<24} {r['tokens_per_s']:>7.1f} {f(r['ratio_vs_target_only'], '.2f') + 'x':>6} "
                     f"{f(r.get('mean_accepted_length'), '.2f'):>7} {f(r.get('acceptance_rate'), '.2f'):>5} "
                     f"{f(r.get('overlap_hit_rate'), '.2f'):>5} {ms['total']:>7.2f} {f(ms.get('verify'), '.2f'):>6} "
                     f"{f(ms.get('draft'), '.2f'):>6} {f(ms.get('network_other'), '.2f'):>7}")
    cfg = rep["config"]
    lines.append(f"{cfg['prompts']} prompts ({cfg['prompt_source']}) x {cfg['max_new_tokens']} new tokens, greedy; "
                 f"one run on {rep['machine']['cpu']} ({rep['machine']['cores']} cores): compare ratios, not absolutes")
    if rep["outputs_identical"]:
        lines.append("all outputs identical to target_only")
    else:
        lines.append(f"OUTPUTS DIFFER from target_only in {len(rep['mismatches'])} (prompt, method) pairs:")
        lines += [f"  prompt {m['prompt']}, {m['method']}: first different token at {m['first_difference_at']}"
                  for m in rep["mismatches"]]
    return "\n".join(lines)


def exit_code(rep: dict) -> int:
    return 0 if rep["outputs_identical"] else 1


def write(rep: dict, out: Path, progress) -> None:
    """bench.json always; bench.png when matplotlib is installed (else say so)."""
    (out / "bench.json").write_text(json.dumps(rep, indent=2) + "\n")
    try:
        plot(rep, out / "bench.png")
    except ImportError:
        progress("matplotlib is not installed: no bench.png (pip install 'specdec[bench]')", end=True)
        return
    progress(f"wrote {out / 'bench.json'} and {out / 'bench.png'}", end=True)


def plot(rep: dict, path: Path) -> None:
    """Two panels, one bar per method: tokens/s (colored by family, target-only = 1.0x marked) and
    ms per step split into verify / draft / network+other."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(rep["methods"])
    rows = [rep["methods"][n] for n in names]
    families = list(dict.fromkeys(r["family"] for r in rows))
    colors = {fam: plt.get_cmap("tab10")(i) for i, fam in enumerate(families)}
    y = list(range(len(names)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 0.32 * len(names) + 2.6), sharey=True)

    tps = [r["tokens_per_s"] for r in rows]
    ax1.barh(y, tps, color=[colors[r["family"]] for r in rows])
    base = rep["methods"][BASELINE]["tokens_per_s"]
    ax1.axvline(base, color="black", linestyle="--", linewidth=1, label="target only = 1.0x")
    for i, r in enumerate(rows):
        ax1.text(tps[i], i, f" {r['ratio_vs_target_only']:.2f}x", va="center", fontsize=7)
    ax1.set_xlabel("tokens/s (higher is better)")
    ax1.set_yticks(y, names, fontsize=8)
    ax1.invert_yaxis()
    ax1.set_xlim(0, max(tps) * 1.15)
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[f]) for f in families] + [ax1.get_lines()[0]]
    ax1.legend(handles, families + ["target only = 1.0x"], fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))

    left = [0.0] * len(rows)
    for part, color in (("verify", "#4c72b0"), ("draft", "#dd8452"), ("network_other", "#8c8c8c")):
        widths = [max(0.0, r["ms_per_step"].get(part, 0.0)) for r in rows]
        ax2.barh(y, widths, left=left, color=color, label=part.replace("_", " + "))
        left = [a + b for a, b in zip(left, widths)]
    unsplit = [(i, r["ms_per_step"]["total"]) for i, r in enumerate(rows) if "verify" not in r["ms_per_step"]]
    ax2.barh([i for i, _ in unsplit], [w for _, w in unsplit], color="white", edgecolor="#555555", hatch="//",
             label="per token, not split (HF generate)")
    ax2.set_xlabel("ms per verification step")
    ax2.legend(fontsize=7, ncol=2, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    cfg = rep["config"]
    fig.suptitle(f"specdec bench: {cfg['prompts']} prompts x {cfg['max_new_tokens']} tokens, greedy, "
                 f"outputs identical: {rep['outputs_identical']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
