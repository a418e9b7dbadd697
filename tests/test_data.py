"""Dataset formats, skipped-row accounting, the generated default set, prompt limits."""

from __future__ import annotations

import json
import re

import pytest
from helpers import shared_file

from sparkrl.errors import UserError
from sparkrl.train.data import build_prompts, generate_default, load_problems, parse_row


def _jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_formats_are_detected_per_row(tmp_path):
    rows = [
        {"question": "Q1", "answer": "work\n#### 1,234"},  # GSM8K
        {"problem": "Q2", "answer": "\\frac{1}{2}", "level": "Level 3"},  # MATH with answer
        {"problem": "Q3", "solution": "so \\boxed{7}."},  # MATH with solution
        {
            "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "Q4"}],
            "reward_model": {"ground_truth": "34", "style": "rule"},
        },  # DAPO
        {"question": "Q5", "gt_answer": "9", "answer": "9"},  # SimpleLR
    ]
    ds = load_problems(_jsonl(tmp_path / "mixed.jsonl", rows))
    assert [(p.question, p.answer) for p in ds.problems] == [
        ("Q1", "1234"),
        ("Q2", "\\frac{1}{2}"),
        ("Q3", "7"),
        ("Q4", "34"),
        ("Q5", "9"),
    ]
    assert ds.skipped == {}


def test_dapo_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": [{"role": "user", "content": f"Problem {i}"}],
            "reward_model": {"ground_truth": str(i), "style": "rule"},
        }
        for i in range(1, 4)
    ]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "dapo.parquet")
    ds = load_problems(str(tmp_path / "dapo.parquet"))
    assert [p.answer for p in ds.problems] == ["1", "2", "3"]


def test_bad_rows_are_skipped_and_counted(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"question": "ok", "answer": "#### 3"}\n{"question": "no answer", "answer": "#### "}\n'
        '{"question": "no marker", "answer": "3"}\nnot json\n{"foo": 1}\n{"problem": "", "answer": "2"}\n'
    )
    ds = load_problems(str(path))
    assert len(ds.problems) == 1
    assert ds.skipped == {
        "rows with no answer": 2,
        "rows that are not objects": 1,
        "rows with an unknown format": 1,
        "rows with no question": 1,
    }
    assert "skipped" in ds.summary()


def test_no_usable_rows_is_a_clear_error(tmp_path):
    with pytest.raises(UserError, match="no usable rows.*2 rows with no answer"):
        load_problems(_jsonl(tmp_path / "empty.jsonl", [{"question": "a", "answer": "x"}] * 2))
    with pytest.raises(UserError, match="not a file"):
        load_problems("no-such-dataset")
    with pytest.raises(UserError, match=".jsonl or .parquet"):
        (tmp_path / "x.csv").write_text("a,b\n")
        load_problems(str(tmp_path / "x.csv"))


def test_default_dataset_is_seeded_varied_and_exact():
    a, b = generate_default(300, seed=0), generate_default(300, seed=0)
    assert a == b and generate_default(300, seed=1) != a
    assert generate_default(10, seed=0) == a[:10]  # problem i does not depend on the size
    assert len({p.question for p in a}) == 300
    assert all(re.fullmatch(r"\d+", p.answer) for p in a)
    # spot-check the arithmetic of each template family by recomputing from the text
    for p in a:
        nums = [int(x) for x in re.findall(r"\d+", p.question)]
        if " more. How many" in p.question and "gives" in p.question:
            assert int(p.answer) == nums[0] + nums[1]
        if "gave away" in p.question:
            assert int(p.answer) == nums[0] - nums[1]
    assert load_problems("default", 50).summary() == "default: 50 problems"


def test_prompt_limit_skip_and_truncate():
    from helpers import default_tokenizer_dir
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(default_tokenizer_dir()))
    problems = generate_default(4) + [type(generate_default(1)[0])("word " * 400, "1")]
    skip = build_prompts(tok, problems, 120, "skip")
    assert (len(skip.problems), skip.skipped, skip.truncated) == (4, 1, 0)
    cut = build_prompts(tok, problems, 120, "truncate")
    assert (len(cut.problems), cut.skipped, cut.truncated) == (5, 0, 1)
    assert all(len(ids) <= 120 for ids in cut.prompt_ids)
    assert "boxed" in tok.decode(cut.prompt_ids[-1])  # the instruction survives truncation


@pytest.mark.parametrize(
    "rel,n", [("gsm8k/train.jsonl", 7473), ("math/train.jsonl", 7500), ("simplelr/train.parquet", 8523)]
)
def test_real_datasets_load(rel, n):
    ds = load_problems(str(shared_file(rel)))
    assert len(ds.problems) + sum(ds.skipped.values()) == n
    assert len(ds.problems) > 0.99 * n


def test_parse_row_gsm8k_answer():
    p, _ = parse_row({"question": "q", "answer": "x\n#### 1,000."})
    assert p.answer == "1000"
