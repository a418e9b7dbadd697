"""Datasets of math problems with checkable answers, and the prompt every problem is asked with.

Formats (detected per row, so a mixed file works too):
  * GSM8K: `question`, `answer` (worked solution ending in `#### N`).
  * MATH: `problem` with `answer`, or with `solution` (the last `\\boxed{}` is the answer).
  * DAPO-Math-17K: `prompt` (chat list; the last user turn is the problem), `reward_model.ground_truth`.
  * SimpleLR (SimpleRL-Zoo): `question`, `gt_answer`.
Rows with missing fields or an empty answer are skipped and counted by reason.

`default` is generated here: grade-school arithmetic word problems from varied templates at three
difficulty levels, seeded, each with an exact integer answer.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from sparkrl.errors import UserError
from sparkrl.train.rewards import last_boxed

# Step-by-step reasoning and a boxed answer (paper, appendix A). The example helps small models
# (SmolLM2-135M boxes 8/32 answers with it, 3/32 with the plain "within \boxed{}" wording).
INSTRUCTION = "Solve it step by step. Then write the final answer as \\boxed{answer}, for example \\boxed{42}."

HUB_DATASETS = {
    # name: (hub id, config, split, data_files)
    "gsm8k": ("openai/gsm8k", "main", "train", None),
    "math": ("DigitalLearningGmbH/MATH-lighteval", None, "train", None),
    "dapo": ("BytedTsinghua-SIA/DAPO-Math-17k", None, "train", None),
    "simplelr": ("hkust-nlp/SimpleRL-Zoo-Data", None, "train", "simplelr_qwen_level3to5/train.parquet"),
}


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str  # ground truth, as text (e.g. "72", "\\frac{3}{4}")
    solution: str = ""  # a worked solution ending in the boxed answer, where the dataset has one (GSM8K, MATH)


@dataclass
class Dataset:
    name: str
    problems: list[Problem]
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows

    def summary(self) -> str:
        s = f"{self.name}: {len(self.problems)} problems"
        if self.skipped:
            s += " (skipped " + ", ".join(f"{n} {why}" for why, n in sorted(self.skipped.items())) + ")"
        return s


def _gsm8k_answer(text: str) -> str:
    if "####" not in text:
        return ""
    return text.rsplit("####", 1)[1].strip().replace(",", "").rstrip(".")


def _gsm8k_solution(text: str) -> str:
    """GSM8K's worked solution as a model would write it: calculator annotations `<<48/2=24>>` removed,
    the final `#### N` line as a boxed answer (the format the prompt asks for)."""
    if "####" not in text:
        return ""
    steps = re.sub(r"<<[^>]*>>", "", text.rsplit("####", 1)[0]).strip()
    return f"{steps}\nThe final answer is \\boxed{{{_gsm8k_answer(text)}}}."


def _chat_last_user(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    turns = [t for t in (prompt or []) if isinstance(t, dict) and t.get("role") == "user"]
    return str(turns[-1].get("content") or "") if turns else ""


def parse_row(row: dict) -> tuple[Problem | None, str]:
    """One raw row -> (Problem, "") or (None, reason it was skipped)."""
    if not isinstance(row, dict):
        return None, "rows that are not objects"
    sol = ""
    if "gt_answer" in row:  # SimpleLR
        q, a = row.get("question"), row.get("gt_answer")
    elif "reward_model" in row and "prompt" in row:  # DAPO
        rm = row["reward_model"]
        if isinstance(rm, str):  # some exports stringify the struct
            try:
                rm = json.loads(rm.replace("'", '"'))
            except ValueError:
                rm = {}
        q, a = _chat_last_user(row["prompt"]), (rm or {}).get("ground_truth")
    elif "problem" in row:  # MATH
        q, sol = row["problem"], str(row.get("solution") or "")
        a = row.get("answer")
        if not a and row.get("solution"):
            a = last_boxed(row["solution"])
    elif "question" in row and "answer" in row:  # GSM8K
        q, a = row["question"], _gsm8k_answer(str(row["answer"] or ""))
        sol = _gsm8k_solution(str(row["answer"] or ""))
    else:
        return None, "rows with an unknown format"
    q = str(q).strip() if q is not None else ""
    a = str(a).strip() if a is not None else ""
    if not q:
        return None, "rows with no question"
    if not a:
        return None, "rows with no answer"
    return Problem(q, a, sol.strip()), ""


def _read_rows(path: Path) -> list[dict]:
    if path.suffix == ".jsonl" or path.suffix == ".json":
        rows = []
        with path.open(encoding="utf-8", errors="replace") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except ValueError:
                        rows.append(None)  # counted as unusable
        return rows
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    raise UserError(f"dataset file {path} must be .jsonl or .parquet")


def _hub_rows(name: str) -> list[dict]:
    import datasets

    hub_id, config, split, files = HUB_DATASETS.get(name, (name, None, "train", None))
    try:
        ds = datasets.load_dataset(hub_id, config, split=split, data_files=files)
    except Exception as e:  # offline, unknown id
        raise UserError(
            f"could not load dataset {hub_id!r} from the hub ({type(e).__name__}); "
            "pass a local .jsonl/.parquet file, or 'default' for the built-in problems"
        ) from None
    return list(ds)


def load_problems(spec: str, default_size: int = 2000, seed: int = 0) -> Dataset:
    """`default`, a local .jsonl/.parquet file, a known name (gsm8k, math, dapo, simplelr) or a hub id."""
    if spec == "default":
        return Dataset("default", generate_default(default_size, seed))
    path = Path(spec).expanduser()
    if path.exists():
        rows, name = _read_rows(path), str(path)
    elif spec in HUB_DATASETS or spec.count("/") == 1:
        rows, name = _hub_rows(spec), spec
    else:
        raise UserError(
            f"dataset {spec!r} is not a file, a known name ({', '.join(HUB_DATASETS)}) or a hub id; "
            "pass a local .jsonl/.parquet file or 'default'"
        )
    problems, skipped = [], {}
    for row in rows:
        p, why = parse_row(row)
        if p is None:
            skipped[why] = skipped.get(why, 0) + 1
        else:
            problems.append(p)
    ds = Dataset(name, problems, skipped)
    if not problems:
        raise UserError(
            f"dataset {name} has no usable rows ({ds.summary()}); expected GSM8K, MATH, DAPO or SimpleLR fields"
        )
    return ds


def held_out(problem: Problem, fraction: float) -> bool:
    """Whether a problem belongs to the held-out share `fraction` of every dataset: decided by a hash of
    its question, so the split is the same in every run, file order and subset (draft pretraining never
    sees these problems; the drafter benchmarks measure on them)."""
    h = int.from_bytes(hashlib.sha256(problem.question.encode("utf-8")).digest()[:8], "big")
    return h / 2**64 < fraction


# --- the generated default dataset ------------------------------------------------------------

_NAMES = [
    "Ava",
    "Ben",
    "Chloe",
    "Diego",
    "Emma",
    "Farah",
    "Gus",
    "Hana",
    "Ivan",
    "Jade",
    "Kofi",
    "Lena",
    "Mateo",
    "Nora",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sami",
    "Tara",
    "Uma",
    "Victor",
    "Wen",
    "Yara",
]
_ITEMS = ["apples", "marbles", "stickers", "books", "pencils", "cookies", "stamps", "shells", "cards", "beads"]
_CONTAINERS = ["boxes", "bags", "jars", "baskets", "crates"]


def _level1(r: random.Random) -> Problem:
    n, m, item = r.choice(_NAMES), r.randint(5, 60), r.choice(_ITEMS)
    k = r.randint(2, 40)
    if r.random() < 0.5:
        q = f"{n} has {m} {item}. A friend gives {n} {k} more. How many {item} does {n} have now?"
        return Problem(q, str(m + k))
    m = m + k
    q = f"{n} had {m} {item} and gave away {k} of them. How many {item} does {n} have left?"
    return Problem(q, str(m - k))


def _level2(r: random.Random) -> Problem:
    n, item, box = r.choice(_NAMES), r.choice(_ITEMS), r.choice(_CONTAINERS)
    a, b, c = r.randint(2, 12), r.randint(3, 25), r.randint(1, 30)
    kind = r.randrange(3)
    if kind == 0:
        q = f"{n} buys {a} {box} of {item} with {b} {item} in each, then finds {c} more. How many {item} does {n} have?"
        return Problem(q, str(a * b + c))
    if kind == 1:
        price = r.randint(2, 9)
        q = (
            f"A shop sells {item} for ${price} each. {n} buys {a} {item} and pays with a ${price * a + c} bill. "
            f"How much change does {n} get, in dollars?"
        )
        return Problem(q, str(c))
    total = a * b
    q = (
        f"{n} shares {total} {item} equally among {a} friends and then eats {min(c, b)} of one share. How "
        f"many {item} are left in that share?"
    )
    return Problem(q, str(b - min(c, b)))


def _level3(r: random.Random) -> Problem:
    n1, n2 = r.sample(_NAMES, 2)
    item = r.choice(_ITEMS)
    kind = r.randrange(3)
    if kind == 0:
        a, k, d = r.randint(4, 30), r.randint(2, 5), r.randint(2, 20)
        q = (
            f"{n1} has {a} {item}. {n2} has {k} times as many as {n1}, minus {d}. "
            f"How many {item} do they have together?"
        )
        return Problem(q, str(a + k * a - d))
    if kind == 1:
        pct = r.choice([10, 20, 25, 50, 75])
        base = r.randint(2, 40) * 20  # a multiple of 20: every listed percentage is a whole number
        extra = r.randint(1, 15)
        q = (
            f"A class collected {base} {item}. They gave {pct}% of them to a school and then received {extra} more. "
            f"How many {item} does the class have now?"
        )
        return Problem(q, str(base - base * pct // 100 + extra))
    days, per, rest = r.randint(3, 9), r.randint(4, 20), r.randint(2, 6)
    q = (
        f"{n1} reads {per} pages a day for {days} days, then {rest} fewer pages a day for twice as many days. "
        f"How many pages does {n1} read in total?"
    )
    return Problem(q, str(days * per + 2 * days * (per - rest)))


_LEVELS = (_level1, _level2, _level3)


def generate_default(size: int, seed: int = 0) -> list[Problem]:
    """`size` problems, levels cycling 1-2-3; problem i depends only on (seed, i)."""
    out = []
    for i in range(size):
        r = random.Random(f"sparkrl-default/{seed}/{i}")
        out.append(_LEVELS[i % 3](r))
    return out


# --- prompts ----------------------------------------------------------------------------------


@dataclass
class PromptSet:
    """Tokenized prompts for the problems that fit the prompt limit."""

    problems: list[Problem]
    prompt_ids: list[list[int]]
    skipped: int = 0
    truncated: int = 0


def read_prompts_file(path: str) -> list[str]:
    """`generate --prompts-file`: one prompt per non-empty line, or for a .jsonl one JSON object with a
    'prompt' string per line."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"--prompts-file {p} does not exist")
    texts = []
    for i, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        if p.suffix != ".jsonl":
            texts.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(
                f"{p}:{i}: not JSON ({e.msg}); a .jsonl prompts file has one object with a 'prompt' "
                "field per line (use a .txt file for one plain prompt per line)"
            ) from None
        if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
            raise UserError(f'{p}:{i}: no \'prompt\' string in this row; each line needs {{"prompt": "..."}}')
        texts.append(row["prompt"])
    if not texts:
        raise UserError(f"--prompts-file {p} has no prompts")
    return texts


def chat_prompt_ids(tokenizer, text: str) -> list[int]:
    """The model's chat template around one user message, ready for generation."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def build_prompts(tokenizer, problems: list[Problem], max_tokens: int, overflow: str) -> PromptSet:
    """Format every problem as a chat prompt asking for step-by-step reasoning and a boxed answer."""
    out = PromptSet([], [])
    for p in problems:
        ids = chat_prompt_ids(tokenizer, f"{p.question}\n\n{INSTRUCTION}")
        if len(ids) > max_tokens:
            if overflow == "skip":
                out.skipped += 1
                continue
            q_ids = tokenizer(p.question, add_special_tokens=False)["input_ids"]
            cut = len(q_ids)
            while len(ids) > max_tokens and cut >= 1:  # re-tokenizing may shift a token: repeat
                cut -= len(ids) - max_tokens
                ids = chat_prompt_ids(tokenizer, f"{tokenizer.decode(q_ids[: max(cut, 0)])}\n\n{INSTRUCTION}")
            if len(ids) > max_tokens or cut < 1:
                out.skipped += 1
                continue
            out.truncated += 1
        out.problems.append(p)
        out.prompt_ids.append(ids)
    return out
