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
Each ratio is reported raw and token-matched (`_Ratio`): frequent tokens are missed earlier more
often and are also easier to draft, which biases the raw ratio down.
* availability (Fig. 2c): the fraction of misses whose token was already missed earlier in the same
  response, and in the same prompt group.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from sparkrl.errors import UserError
from sparkrl.rollout import HIT, MISS

DISTANCE_BINS = [(1, 1), (2, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 10**9)]


def append_round_log(path: str, rollout, **meta) -> None:
    """Append one rollout's per-token outcomes to a JSONL round log."""
    rec = {**meta, "group_size": rollout.group_size, "prompts": len(rollout.prompt_ids),
           "responses": [{"tokens": t, "outcome": o, "round": r}
                         for t, o, r in zip(rollout.tokens, rollout.outcome, rollout.round_of)]}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


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
    """Miss counts of two event groups, with and without the earlier evidence, per stratum.

    `ratio` is P(miss | evidence) / P(miss | none) over all events. `matched_ratio` compares each
    stratum with itself (indirect standardisation): observed misses among evidence events over the
    misses expected if each stratum missed at its own no-evidence rate, over strata seen both ways.
    The stratum is the token itself, or (where the evidence is a property of the token, as for the
    previous rollout) the token's frequency class. It removes the confound that frequent tokens are
    both missed earlier more often and easier to draft.
    """

    def __init__(self):
        self.n = [0, 0]
        self.miss = [0, 0]
        self.by_token = defaultdict(lambda: [0, 0, 0, 0])  # token -> [n without, misses without, n with, misses with]

    def add(self, evidence: bool, miss: bool, token) -> None:
        self.n[evidence] += 1
        self.miss[evidence] += miss
        c = self.by_token[token]
        c[2 * evidence] += 1
        c[2 * evidence + 1] += miss

    def to_dict(self) -> dict:
        p = [m / n if n else None for m, n in zip(self.miss, self.n)]
        both = [c for c in self.by_token.values() if c[0] and c[2]]
        expected = sum(c[2] * c[1] / c[0] for c in both)
        observed = sum(c[3] for c in both)
        return {"p_miss_with": p[1], "p_miss_without": p[0], "ratio": p[1] / p[0] if p[0] and p[1] is not None else None,
                "matched_ratio": observed / expected if expected else None, "matched_tokens": len(both),
                "events_with": self.n[1], "events_without": self.n[0]}


def _events(resp: dict):
    """(token, round, miss) of every drafted position of a response, in order."""
    for v, o, t in zip(resp["tokens"], resp["outcome"], resp["round"]):
        if o in (HIT, MISS):
            yield v, t, o == MISS


def analyze(records: list[dict]) -> dict:
    """Section-2 statistics of one round log (list of rollout records)."""
    within = _Ratio()
    by_dist = [_Ratio() for _ in DISTANCE_BINS]  # evidence = last earlier miss at this distance
    prev_rollout, prompt = _Ratio(), _Ratio()
    n_miss = n_events = miss_seen_resp = miss_seen_prompt = 0
    prev_missed: set | None = None
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
            # misses of each token by (response, round) within the group
            miss_rounds = defaultdict(list)  # token -> [(round, response)]
            for j, resp in enumerate(resps):
                for v, t, m in _events(resp):
                    if m:
                        miss_rounds[v].append((t, j))
            for j, resp in enumerate(resps):
                last_miss = {}
                for v, t, m in _events(resp):
                    n_events += 1
                    n_miss += m
                    earlier = last_miss.get(v)
                    within.add(earlier is not None, m, v)
                    if earlier is not None:
                        d = t - earlier
                        b = next(i for i, (lo, hi) in enumerate(DISTANCE_BINS) if lo <= d <= hi)
                        by_dist[b].add(True, m, v)
                    other = any(tt < t and jj != j for tt, jj in miss_rounds.get(v, ()))
                    prompt.add(other, m, v)
                    if prev_missed is not None:
                        prev_rollout.add(v in prev_missed, m, freq[v].bit_length())
                    if m:
                        miss_seen_resp += earlier is not None
                        miss_seen_prompt += any(tt < t for tt, _ in miss_rounds.get(v, ()))
                        last_miss[v] = t
                        missed_here.add(v)
        prev_missed = missed_here
    # by distance: P(miss | last earlier miss in the bin) against P(miss | no earlier miss)
    base = within.to_dict()["p_miss_without"]
    dist = []
    rate0 = {v: c[1] / c[0] for v, c in within.by_token.items() if c[0]}  # each token's no-earlier-miss rate
    for (lo, hi), rt in zip(DISTANCE_BINS, by_dist):
        d = rt.to_dict()
        p = d["p_miss_with"]
        expected = sum(c[2] * rate0[v] for v, c in rt.by_token.items() if v in rate0)
        observed = sum(c[3] for v, c in rt.by_token.items() if v in rate0)
        dist.append({"from": lo, "to": hi if hi < 10**9 else None, "p_miss": p, "events": d["events_with"],
                     "ratio": p / base if p is not None and base else None,
                     "matched_ratio": observed / expected if expected else None})
    return {
        "rollouts": len(records), "drafted_positions": n_events, "misses": n_miss,
        "miss_rate": n_miss / n_events if n_events else None,
        "within_response": within.to_dict(), "within_response_by_distance": dist,
        "previous_rollout": prev_rollout.to_dict(), "within_prompt": prompt.to_dict(),
        "misses_seen_earlier_in_response": miss_seen_resp / n_miss if n_miss else None,
        "misses_seen_earlier_in_prompt": miss_seen_prompt / n_miss if n_miss else None,
    }


def run(logs: list[str], labels: list[str], out: str) -> dict:
    """Analyse each log, write analysis.json and PNG plots into out; returns the results."""
    if labels and len(labels) != len(logs):
        raise UserError(f"--labels names {len(labels)} logs, --logs gives {len(logs)}")
    labels = labels or [Path(p).stem for p in logs]
    records = {lab: read_round_log(p) for lab, p in zip(labels, logs)}  # all read (and checked) before work
    res = {lab: analyze(recs) for lab, recs in records.items()}
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "analysis.json").write_text(json.dumps({"logs": dict(zip(labels, logs)), "results": res}, indent=2))
    plot(res, out)
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
            ax[0].axhline(r["within_response"]["p_miss_without"], ls="--", lw=1,
                          color=ax[0].lines[-1].get_color() if pts else None, label=f"{lab}: no earlier miss")
    ax[0].set_xticks(range(len(DISTANCE_BINS)))
    ax[0].set_xticklabels([f"{lo}" if lo == hi else (f"{lo}-{hi}" if hi < 10**9 else f"{lo}+") for lo, hi in DISTANCE_BINS])
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
        ax[2].bar([j + i * w for j in range(2)], [r["misses_seen_earlier_in_response"] or 0,
                                                  r["misses_seen_earlier_in_prompt"] or 0], w, label=lab)
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
