"""Every `sparkrl ...` command the README and the guides (docs/*.md; not docs/experiments/) show still parses: its
subcommand exists and each `--flag` (also `--flag=value`, `--no-flag`) is one of that subcommand's options, with a
listed choice where the option has choices. Read from `make_parser()`'s option strings; nothing is parsed or run
(parsing may check paths), so placeholders such as M, DIR and FILE stand as they are.

Commands are found in fenced code blocks (backslash-newline continuations joined, `#` comments dropped) and inline
code spans, as `sparkrl`, `.venv/bin/sparkrl`, `python -m sparkrl` or `torchrun ... -m sparkrl`; `&&`, `||`, `|`
and `;` end a command. A flag mentioned alone in prose (`--spark`) must be an option of some command.
"""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from sparkrl.commands.cli import make_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SEPARATORS = {"&&", "||", "|", ";"}
# A value that stands for one: M, DIR, RUN_DIR, <command>, ..., a Python placeholder.
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$|[<>]|\.\.\.")
# Flags of other tools that the guides mention in prose (pip's).
OTHER_TOOLS = {"--no-deps", "--no-build-isolation"}


def subcommands() -> dict[str, argparse.ArgumentParser]:
    return next(a for a in make_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices


def snippets(text: str) -> list[tuple[int, str]]:
    """(line number, text) of every logical line of the fenced code blocks and of every inline code span."""
    out, prose, in_fence, start, pending = [], [], False, 0, ""
    for i, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
            prose.append("")
            continue
        if not in_fence:
            prose.append(line)
            continue
        prose.append("")  # keeps the prose's line numbers
        start = start if pending else i
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    body = "\n".join(prose)
    for m in re.finditer(r"(`+)(.+?)\1", body, re.DOTALL):  # a span may wrap onto the next line
        out.append((body.count("\n", 0, m.start()) + 1, m.group(2).replace("\n", " ")))
    return out


def tokens(snippet: str) -> list[str]:
    try:
        return shlex.split(snippet, comments=True)
    except ValueError:  # an unbalanced quote in a fragment of prose or Python
        return snippet.split()


def segments(toks: list[str]) -> list[list[str]]:
    """The commands of a chain: `a && b | c; d` -> [a], [b], [c], [d]."""
    out = [[]]
    for t in toks:
        if t in SEPARATORS:
            out.append([])
        else:
            out[-1].append(t)
    return out


def is_sparkrl(token: str) -> bool:
    """`sparkrl` (also as in `python -m sparkrl`, `torchrun ... -m sparkrl`) or a venv's `bin/sparkrl`."""
    return token == "sparkrl" or token.endswith("bin/sparkrl")


def commands(text: str) -> list[tuple[int, str, list[str]]]:
    """(line, subcommand, its arguments) of every sparkrl command in a markdown text."""
    found = []
    for line, snippet in snippets(text):
        for seg in segments(tokens(snippet)):
            k = next((k for k, t in enumerate(seg) if is_sparkrl(t)), None)
            if k is None or k + 1 >= len(seg):
                continue
            cmd = seg[k + 1]
            if cmd.startswith("-") or PLACEHOLDER.search(cmd):  # `sparkrl --help`, `sparkrl <command> --help`
                continue
            found.append((line, cmd, seg[k + 2 :]))
    return found


def value_problem(action: argparse.Action, value: str) -> str | None:
    """Why a shown value cannot be the option's, or None (placeholders and alternatives `a|b` are checked as such)."""
    if not value or value.startswith("-") or PLACEHOLDER.search(value):
        return None
    if action.choices:
        bad = [v for v in value.split("|") if v not in map(str, action.choices)]
        return f"{bad[0]!r} is not one of {sorted(map(str, action.choices))}" if bad else None
    if action.type in (int, float):
        try:
            action.type(value)
        except ValueError:
            return f"{value!r} is not {action.type.__name__}"
    return None


def problems(text: str, name: str = "text") -> list[str]:
    """One line per way a command in `text` does not parse."""
    subs, out = subcommands(), []
    for line, cmd, args in commands(text):
        where = f"{name}:{line}: sparkrl {cmd}"
        if cmd not in subs:
            out.append(f"{where}: no such command (commands: {', '.join(subs)})")
            continue
        options = {s: a for a in subs[cmd]._actions for s in a.option_strings}
        args = [a.lstrip("[(").rstrip("])") for a in args]  # a usage line's [--flag N]
        for j, arg in enumerate(args):
            if not arg.startswith("--") or arg in ("--", "--help"):
                continue
            flag, eq, value = arg.partition("=")
            action = options.get(flag)
            if action is None:
                out.append(f"{where}: {flag} is not one of its options")
                continue
            if action.nargs == 0:  # --x / --no-x
                if eq:
                    out.append(f"{where}: {flag} takes no value")
                continue
            if not eq and j + 1 < len(args):
                value = args[j + 1]
            why = value_problem(action, value)
            if why:
                out.append(f"{where} {flag}: {why}")
    return out


def prose_flag_problems(text: str, name: str = "text") -> list[str]:
    """Inline spans that begin with a flag (`--tree-depth`, `--draft-checkpoint default`) name an option of some
    command."""
    known = {s for p in subcommands().values() for a in p._actions for s in a.option_strings} | OTHER_TOOLS
    out = []
    for line, snippet in snippets(text):
        toks = tokens(snippet)
        if not toks or not toks[0].startswith("--"):
            continue
        for t in toks:
            flag = t.partition("=")[0]
            if flag.startswith("--") and len(flag) > 2 and flag not in known:
                out.append(f"{name}:{line}: {flag} is no command's option")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_documented_command_parses(doc):
    text = doc.read_text()
    name = str(doc.relative_to(ROOT))
    bad = problems(text, name) + prose_flag_problems(text, name)
    assert not bad, "a documented command does not match the CLI:\n" + "\n".join(bad)


def test_the_readme_shows_its_commands():
    """The scan finds the README's quick start, so a change in its form cannot make this test check nothing."""
    found = commands((ROOT / "README.md").read_text())
    assert any(cmd == "train" and "--group-size" in args for _, cmd, args in found)
    assert sum(len(commands(d.read_text())) for d in DOCS) >= 20


DOC = """\
Run `sparkrl train --no-spark --group-size=4` or

```bash
bash scripts/setup.sh && .venv/bin/sparkrl generate --model M \\
    --n 2 --prompt TEXT   # a comment --not-a-flag
torchrun --nproc-per-node 2 -m sparkrl train --out DIR | tee log
```
"""


def test_the_scan_reads_chains_continuations_and_every_form():
    assert [(line, cmd, args) for line, cmd, args in commands(DOC)] == [
        (4, "generate", ["--model", "M", "--n", "2", "--prompt", "TEXT"]),
        (6, "train", ["--out", "DIR"]),
        (1, "train", ["--no-spark", "--group-size=4"]),
    ]
    assert problems(DOC) == []


# (a doc, what its one problem says)
WRONG = [
    ("`sparkrl train --out DIR --made-up-flag 3`", "--made-up-flag is not one of its options"),
    ("```\n.venv/bin/sparkrl generate --model M \\\n    --group-size 4\n```", "--group-size is not one of its"),
    ("`python -m sparkrl trian --out DIR`", "no such command"),
    ("`sparkrl train --draft eagle4`", "'eagle4' is not one of"),
    ("`sparkrl train --steps=many`", "'many' is not int"),
    ("`sparkrl train --spark=1`", "--spark takes no value"),
]


@pytest.mark.parametrize("doc, expected", WRONG)
def test_a_wrong_command_is_caught(doc, expected):
    bad = problems(doc)
    assert len(bad) == 1 and expected in bad[0], bad


def test_a_flag_alone_in_prose_must_exist():
    assert prose_flag_problems("use `--tree-depth` or `--draft-checkpoint default`") == []
    assert prose_flag_problems("use `--tree-dpth`") == ["text:1: --tree-dpth is no command's option"]
