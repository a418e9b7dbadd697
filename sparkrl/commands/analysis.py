"""Section-2 analysis of verification feedback (paper Fig. 2 and Fig. 4) on recorded rollouts.

A round log (`--round-log FILE` on `train` or `generate`) holds, per rollout, every response's tokens
with their drafting outcome (rollout.HIT / MISS / UNDRAFTED) and the round that committed them. A
drafted position is an event (token v, round t, miss?): a miss is a position where the target's token
was not among the drafter's proposals (the acceptance walk stopped at a node with children and
sampled v there); a hit is an accepted draft token. Statistics, each a ratio of miss probabilities:

* within a response (Fig. 2a top, Fig. 4): P(miss | v was missed earlier in this response, the last
  time d rounds ago) / P(miss | v not missed earlier in this response), by distance d;
* previous rollout (Fig. 2a bottom): P(miss | v was missed anywhere in the previous logged rollout)
  / P(miss | it was not), for every rollout after the first;
* within a prompt (Fig. 2b): P(miss | v was missed in an earlier round by another response of the
  same prompt) / P(miss | not);
* availability (Fig. 2c): the fraction of misses whose token was already missed earlier in the same
  response, and in the same prompt group.

Each ratio is reported raw and token-matched (`_Ratio`): frequent tokens are missed earlier more
often and are also easier to draft, which biases the raw ratio down.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch

from sparkrl.engine.records import HIT, MISS
from sparkrl.errors import UserError

DISTANCE_BINS = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 10**9)]


def read_round_log(path: str) -> list[dict]:
    p = Path(path)
    if not p.exists():
        raise UserError(f"round log {p} does not exist; write one with --round-log on train or generate")
    out = []
    for i, line in enumerate(p.read_text().splitlines()):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            rec["responses"][0]["outcome"]
        except (json.JSONDecodeError, KeyError, IndexError, TypeError):
            raise UserError(f"{p} line {i + 1} is not a round-log record (from --round-log)") from None
        out.append(rec)
    if not out:
        raise UserError(f"round log {p} is empty")
    return out


class _Ratio:
    """Miss counts of drafted positions with and without the earlier evidence, per prompt group (the
    bootstrap's unit) and stratum.

    Two forms of the ratio P(miss | evidence) / P(miss | none):

    * `ratio` (raw, the paper's wording "tokens missed earlier vs tokens not missed earlier"): both
      probabilities over all positions. Positions with evidence are mostly frequent tokens (a frequent
      token has usually been missed somewhere before), and frequent tokens are easier to draft, so where
      the drafter misses often the raw ratio is pulled below 1 whatever the recurrence.
    * `matched_ratio` (indirect standardisation): observed misses among evidence positions over the
      misses expected if each stratum missed at its own no-evidence rate, over strata seen both ways.
      The stratum is the token itself, or (where the evidence is a property of the token, as for the
      previous rollout) the token's frequency class: each token is compared with itself.
    """

    def __init__(self):
        self.counts = defaultdict(
            lambda: [0, 0, 0, 0]
        )  # (unit, stratum) -> [n without, misses without, n with, misses with]

    def add(self, unit: int, evidence: bool, miss: bool, stratum) -> None:
        c = self.counts[unit, stratum]
        c[2 * evidence] += 1
        c[2 * evidence + 1] += miss

    def tensor(self, units: int) -> torch.Tensor:
        """(units, strata, 4) float64 counts."""
        strata = {s: i for i, s in enumerate(sorted({s for _, s in self.counts}, key=str))}
        t = torch.zeros(units, max(len(strata), 1), 4, dtype=torch.float64)
        for (u, s), c in self.counts.items():
            t[u, strata[s]] = torch.tensor(c, dtype=torch.float64)
        return t


def _ratios(t: torch.Tensor) -> dict:
    """Ratio statistics of summed counts t (..., strata, 4); batched over leading dims."""
    n0, m0, n1, m1 = t.unbind(-1)
    p0, p1 = m0.sum(-1) / n0.sum(-1), m1.sum(-1) / n1.sum(-1)
    both = (n0 > 0) & (n1 > 0)
    expected = torch.where(both, n1 * m0 / n0.clamp(min=1), 0.0).sum(-1)
    observed = torch.where(both, m1, 0.0).sum(-1)
    return {
        "p_miss_with": p1,
        "p_miss_without": p0,
        "ratio": p1 / p0,
        "matched_ratio": observed / expected,
        "matched_tokens": both.sum(-1),
        "events_with": n1.sum(-1),
        "events_without": n0.sum(-1),
    }


def resample_weights(n: int, draws: int, generator: torch.Generator) -> torch.Tensor:
    """(draws, n) float64: how often each of n units is drawn in each bootstrap resample (with
    replacement); a statistic of weighted sums is then one matrix product for all resamples."""
    idx = torch.randint(n, (draws, n), generator=generator)
    return torch.zeros(draws, n, dtype=torch.float64).scatter_add_(1, idx, torch.ones(draws, n, dtype=torch.float64))


def interval95(x: torch.Tensor) -> torch.Tensor:
    """(2, ...) the 2.5% and 97.5% quantiles of bootstrap draws x (draws, ...), NaN draws ignored."""
    return torch.nanquantile(x, torch.tensor([0.025, 0.975], dtype=torch.float64), dim=0)


def _value(x: torch.Tensor):
    x = float(x)
    return x if x == x and abs(x) != float("inf") else None


def _events(resp: dict):
    """(token, round, miss) of every drafted position of a response, in order."""
    for v, o, t in zip(resp["tokens"], resp["outcome"], resp["round"]):
        if o in (HIT, MISS):
            yield v, t, o == MISS


RATIOS = ("within_response", "previous_rollout", "within_prompt")


def analyze(records: list[dict], previous: dict | None = None, bootstrap: int = 1000, seed: int = 0) -> dict:
    """Section-2 statistics of one round log (list of rollout records). previous: the record logged
    just before `records` (the previous-rollout evidence of the first one). Each ratio and share
    comes with a 95% bootstrap interval over prompt groups (`ci`), `bootstrap` resamples."""
    ratio, by_dist, unit_misses, seen_resp, seen_prompt = _count(records, previous)
    U = len(unit_misses)
    counts = {k: r.tensor(U) for k, r in ratio.items()}
    shares = torch.tensor([unit_misses, seen_resp, seen_prompt], dtype=torch.float64).T  # (U, 3)
    n_events = int(counts["within_response"][..., [0, 2]].sum())  # every drafted position is a within-response event
    n_miss = int(shares[:, 0].sum())

    def stats(w: torch.Tensor) -> dict:  # w: (B, U) weights of the prompt groups
        out = {k: _ratios(torch.einsum("bu,usk->bsk", w, c)) for k, c in counts.items()}
        s = w @ shares
        out["misses_seen_earlier_in_response"] = s[:, 1] / s[:, 0]
        out["misses_seen_earlier_in_prompt"] = s[:, 2] / s[:, 0]
        return out

    point = stats(torch.ones(1, U, dtype=torch.float64))
    res = {
        k: {n: _value(x[0]) if n.startswith(("p_", "ratio", "matched_r")) else int(x[0]) for n, x in v.items()}
        for k, v in point.items()
        if k in RATIOS
    }
    res.update({k: _value(point[k][0]) for k in ("misses_seen_earlier_in_response", "misses_seen_earlier_in_prompt")})
    if bootstrap and U > 1:
        g = torch.Generator().manual_seed(seed)
        draws = []
        for lo in range(0, bootstrap, 100):  # bounded memory: 100 resamples at a time
            draws.append(stats(resample_weights(U, min(100, bootstrap - lo), g)))
        ci = lambda x: [_value(q) for q in interval95(x)]
        for k in RATIOS:
            for n in ("ratio", "matched_ratio"):
                res[k][n + "_ci"] = ci(torch.cat([d[k][n] for d in draws]))
        for k in ("misses_seen_earlier_in_response", "misses_seen_earlier_in_prompt"):
            res[k + "_ci"] = ci(torch.cat([d[k] for d in draws]))
    dist = _by_distance(ratio["within_response"], by_dist, res["within_response"]["p_miss_without"])
    return {
        "rollouts": len(records),
        "prompt_groups": U,
        "drafted_positions": n_events,
        "misses": n_miss,
        "miss_rate": n_miss / n_events if n_events else None,
        **{k: res[k] for k in RATIOS},
        "within_response_by_distance": dist,
        **{k: v for k, v in res.items() if k not in RATIOS},
    }


def _count(records: list[dict], previous: dict | None):
    """The counts behind `analyze`, one prompt group (a bootstrap unit) at a time: the `_Ratio` of each of
    RATIOS, one `_Ratio` per DISTANCE_BINS (evidence: the token's last earlier miss in the response is at
    that distance), and per unit its misses and how many of them were missed earlier in the same response
    and in the same group."""
    ratio = {k: _Ratio() for k in RATIOS}
    by_dist = [_Ratio() for _ in DISTANCE_BINS]
    unit_misses, seen_resp, seen_prompt = [], [], []  # per prompt group
    prev_missed = None if previous is None else {v for resp in previous["responses"] for v, _, m in _events(resp) if m}
    for rec in records:
        G = rec["group_size"]
        missed_here = set()
        freq = defaultdict(int)  # drafted occurrences of each token in this rollout
        for resp in rec["responses"]:
            for v, _, _ in _events(resp):
                freq[v] += 1
        groups = defaultdict(list)
        for r, resp in enumerate(rec["responses"]):
            groups[r // G].append(resp)
        for resps in groups.values():
            u = len(unit_misses)
            unit_misses.append(0), seen_resp.append(0), seen_prompt.append(0)
            miss_rounds = defaultdict(list)  # token -> [(round, response)] of its misses in the group
            for j, resp in enumerate(resps):
                for v, t, m in _events(resp):
                    if m:
                        miss_rounds[v].append((t, j))
            for j, resp in enumerate(resps):
                last_miss = {}
                for v, t, m in _events(resp):
                    earlier = last_miss.get(v)
                    ratio["within_response"].add(u, earlier is not None, m, v)
                    if earlier is not None:
                        d = t - earlier
                        b = next(i for i, (lo, hi) in enumerate(DISTANCE_BINS) if lo <= d <= hi)
                        by_dist[b].add(u, True, m, v)
                    other = any(tt < t and jj != j for tt, jj in miss_rounds.get(v, ()))
                    ratio["within_prompt"].add(u, other, m, v)
                    if prev_missed is not None:
                        ratio["previous_rollout"].add(u, v in prev_missed, m, freq[v].bit_length())
                    if m:
                        unit_misses[u] += 1
                        seen_resp[u] += earlier is not None
                        seen_prompt[u] += any(tt < t for tt, _ in miss_rounds.get(v, ()))
                        last_miss[v] = t
                        missed_here.add(v)
        prev_missed = missed_here
    return ratio, by_dist, unit_misses, seen_resp, seen_prompt


def _by_distance(within: _Ratio, by_dist: list[_Ratio], base: float | None) -> list[dict]:
    """Per DISTANCE_BINS: P(miss | the token's last earlier miss in the response is in the bin), its ratio to
    P(miss | no earlier miss) `base`, and that ratio token-matched (each token against its own rate without
    an earlier miss, from `within`, the within-response counts)."""
    w0 = {}
    for (u, v), c in within.counts.items():
        a = w0.setdefault(v, [0, 0])
        a[0] += c[0]
        a[1] += c[1]
    dist = []
    for (lo, hi), rt in zip(DISTANCE_BINS, by_dist):
        tot = defaultdict(lambda: [0, 0])
        for (u, v), c in rt.counts.items():
            tot[v][0] += c[2]
            tot[v][1] += c[3]
        n, m = sum(c[0] for c in tot.values()), sum(c[1] for c in tot.values())
        p = m / n if n else None
        expected = sum(c[0] * w0[v][1] / w0[v][0] for v, c in tot.items() if w0.get(v, [0])[0])
        observed = sum(c[1] for v, c in tot.items() if w0.get(v, [0])[0])
        dist.append(
            {
                "from": lo,
                "to": hi if hi < 10**9 else None,
                "p_miss": p,
                "events": n,
                "ratio": p / base if p is not None and base else None,
                "matched_ratio": observed / expected if expected else None,
            }
        )
    return dist


def stages(records: list[dict], k: int, **kw) -> list[dict]:
    """`analyze` of k consecutive parts of a log (early, middle, late ... of a run), split by step
    (by order for logs without steps); each part's first rollout takes its previous-rollout evidence
    from the record before it."""
    key = [r.get("step", i) for i, r in enumerate(records)]
    steps = sorted(set(key))
    if len(steps) < k:
        raise UserError(f"--stages {k}: the log has only {len(steps)} steps; use at most {len(steps)} stages")
    out = []
    for i in range(k):
        part = set(steps[len(steps) * i // k : len(steps) * (i + 1) // k])
        idx = [j for j, s in enumerate(key) if s in part]
        r = analyze([records[j] for j in idx], records[idx[0] - 1] if idx[0] else None, **kw)
        out.append({"steps": [min(part), max(part)], **r})
    return out


def run(logs: list[str], labels: list[str], out: str, n_stages: int = 1, bootstrap: int = 1000) -> dict:
    """Analyse each log (and, n_stages > 1, each stage of it), write analysis.json and PNG plots into
    out; returns the results."""
    if labels and len(labels) != len(logs):
        raise UserError(f"--labels names {len(labels)} logs, --logs gives {len(logs)}")
    labels = labels or [Path(p).stem for p in logs]
    records = {lab: read_round_log(p) for lab, p in zip(labels, logs)}  # all read (and checked) before work
    res = {}
    for lab, recs in records.items():
        res[lab] = analyze(recs, bootstrap=bootstrap)
        if n_stages > 1:
            res[lab]["stages"] = stages(recs, n_stages, bootstrap=bootstrap)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "analysis.json").write_text(json.dumps({"logs": dict(zip(labels, logs)), "results": res}, indent=2))
    plot(res, out)
    if n_stages > 1:
        plot_stages(res, out)
    return res


def plot(res: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    for lab, r in res.items():
        pts = [(i, d["p_miss"]) for i, d in enumerate(r["within_response_by_distance"]) if d["p_miss"] is not None]
        if pts:
            ax[0].plot([i for i, _ in pts], [p for _, p in pts], "o-", label=f"{lab}: after a miss")
        if r["within_response"]["p_miss_without"] is not None:
            ax[0].axhline(
                r["within_response"]["p_miss_without"],
                ls="--",
                lw=1,
                color=ax[0].lines[-1].get_color() if pts else None,
                label=f"{lab}: no earlier miss",
            )
    ax[0].set_xticks(range(len(DISTANCE_BINS)))
    ax[0].set_xticklabels(
        [f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+") for lo, hi in DISTANCE_BINS]
    )
    ax[0].set_xlabel("rounds since the token's last miss in the response")
    ax[0].set_ylabel("P(miss)")
    ax[0].set_title("Recurrence within a response (Fig. 2a top / Fig. 4)")
    if ax[0].get_legend_handles_labels()[0]:  # a log of autoregressive rollouts has no drafted position
        ax[0].legend(fontsize=7)
    names = ["within response", "previous rollout", "within prompt"]
    keys = ["within_response", "previous_rollout", "within_prompt"]
    w = 0.8 / max(len(res), 1)
    for i, (lab, r) in enumerate(res.items()):
        ax[1].bar([j + i * w for j in range(3)], [r[k]["matched_ratio"] or 0 for k in keys], w, label=lab)
        ax[2].bar(
            [j + i * w for j in range(2)],
            [r["misses_seen_earlier_in_response"] or 0, r["misses_seen_earlier_in_prompt"] or 0],
            w,
            label=lab,
        )
    ax[1].axhline(1.0, color="k", lw=0.8)
    ax[1].set_xticks([j + w * (len(res) - 1) / 2 for j in range(3)])
    ax[1].set_xticklabels(names)
    ax[1].set_ylabel("P(miss | missed before) / P(miss | not), token-matched")
    ax[1].set_title("Miss-probability ratios (Fig. 2a, 2b)")
    ax[1].legend(fontsize=7)
    ax[2].set_xticks([j + w * (len(res) - 1) / 2 for j in range(2)])
    ax[2].set_xticklabels(["same response", "same prompt"])
    ax[2].set_ylabel("fraction of misses")
    ax[2].set_title("Misses with an earlier miss of the token (Fig. 2c)")
    ax[2].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out) / "analysis.png", dpi=120)
    plt.close(fig)


def plot_stages(res: dict, out: str) -> None:
    """Each ratio (raw and token-matched) by stage, with its bootstrap interval: analysis_stages.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 3, figsize=(15, 4), sharey=True)
    names = {
        "within_response": "within a response",
        "previous_rollout": "previous rollout (control)",
        "within_prompt": "within a prompt group",
    }
    for a, (k, name) in zip(ax, names.items()):
        for i, (lab, r) in enumerate(res.items()):
            for form, ls in (("ratio", "--"), ("matched_ratio", "-")):
                pts = [
                    (j, s[k][form], s[k].get(form + "_ci")) for j, s in enumerate(r["stages"]) if s[k][form] is not None
                ]
                if not pts:
                    continue
                x = [j + 0.08 * i for j, _, _ in pts]
                y = [v for _, v, _ in pts]
                err = [
                    [v - (c[0] if c and c[0] is not None else v) for _, v, c in pts],
                    [(c[1] if c and c[1] is not None else v) - v for _, v, c in pts],
                ]
                a.errorbar(
                    x,
                    y,
                    yerr=err,
                    fmt="o" + ls,
                    capsize=3,
                    label=f"{lab}, {'token-matched' if form == 'matched_ratio' else 'raw'}",
                )
        a.axhline(1.0, color="k", lw=0.8)
        a.set_xticks(range(len(next(iter(res.values()))["stages"])))
        a.set_xticklabels([f"steps {s['steps'][0]}-{s['steps'][1]}" for s in next(iter(res.values()))["stages"]])
        a.set_title(f"P(miss | missed before) / P(miss | not): {name}", fontsize=9)
    ax[0].set_ylabel("ratio (95% bootstrap interval over prompts)")
    for a in ax:
        if a.get_legend_handles_labels()[0]:  # a stage may have no events of a kind
            a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(Path(out) / "analysis_stages.png", dpi=120)
    plt.close(fig)
