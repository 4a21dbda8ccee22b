"""README and docs stay true: links and repository paths exist, every command in a code block parses, every table
of numbers names the command that made it, and the README stays a newcomer's page."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import runpy
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = sorted([REPO / "README.md", REPO / "CONTRIBUTING.md", REPO / "CHANGELOG.md", *REPO.glob("docs/*.md"),
                *REPO.glob("*/README.md")], key=str)
TOP = ("configs", "slurm", "launch", "bench", "research", "checks", "results", "docs", "tests", "sigmanens_dist")


def _rel(page: Path) -> str:
    return str(page.relative_to(REPO))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _code_blocks(text: str) -> Iterator[str]:
    yield from re.findall(r"^```[a-z]*\n(.*?)^```", text, flags=re.S | re.M)


def _prose(text: str) -> str:
    return re.sub(r"^```[a-z]*\n.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path) -> None:
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            missing.append(target)
        elif anchor and dest.suffix == ".md":
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+)$", _prose(dest.read_text()), flags=re.M)}
            if anchor not in anchors:
                missing.append(target)
    assert not missing, f"{_rel(page)} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_repository_paths_named_exist(page: Path) -> None:
    pattern = r"(?<![\w./$-])((?:" + "|".join(TOP) + r")/[\w./*-]*)"
    missing = set()
    for name in re.findall(pattern, page.read_text()):
        name = name.split("::")[0].rstrip(".,")
        if "<" in name or not name:
            continue
        if not any(REPO.glob(name)) and not (REPO / name).exists():
            missing.add(name)
    assert not missing, f"{_rel(page)} names paths that do not exist: {sorted(missing)}"


def _commands(text: str) -> Iterator[list[str]]:
    """Each ``sigmanens …`` / ``python -m sigmanens_dist…`` / ``torchrun … -m sigmanens_dist…`` line of the code
    blocks, continuation lines joined, comments and output lines dropped."""
    for block in _code_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.strip()
            if not re.match(r"(sigmanens |python -m sigmanens_dist|torchrun )", line):
                continue
            try:
                words = shlex.split(line, comments=True)
            except ValueError:  # an output line quoting a command
                continue
            if words[0] == "torchrun":
                words = words[words.index("-m") + 1:] if "-m" in words else []
            elif words[0] == "python":
                words = words[2:]
            if words and words[0].startswith("sigmanens"):
                yield words


class _Parsed(Exception):
    def __init__(self, namespace: argparse.Namespace) -> None:
        self.namespace = namespace


def _parse_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outermost argparse parse raises its namespace once parsed (parse_intermixed_args calls parse_known_args
    inside): the command is checked, nothing runs."""
    depth = [0]
    for name in ("parse_args", "parse_known_args", "parse_intermixed_args"):
        original = getattr(argparse.ArgumentParser, name)

        def parse(self, *args, _original=original, **kwargs):
            depth[0] += 1
            try:
                result = _original(self, *args, **kwargs)
            finally:
                depth[0] -= 1
            if depth[0]:
                return result
            raise _Parsed(result[0] if isinstance(result, tuple) else result)

        monkeypatch.setattr(argparse.ArgumentParser, name, parse)


DOC_COMMANDS = [(page, words) for page in PAGES for words in _commands(page.read_text())]


@pytest.mark.parametrize(("page", "words"), DOC_COMMANDS,
                         ids=[f"{_rel(p)}:{' '.join(w)[:60]}" for p, w in DOC_COMMANDS])
def test_commands_in_code_blocks_parse(page: Path, words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from sigmanens_dist.config import load_config

    words = ["1" if w.startswith("$") else w for w in words]  # $SLURM_ARRAY_TASK_ID: a value at run time
    module = "sigmanens_dist.cli" if words[0] == "sigmanens" else words[0]  # the console script runs cli's main
    monkeypatch.setattr(sys, "argv", [module, *words[1:]])
    _parse_only(monkeypatch)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:  # as `python -m module` runs it: its __main__ block (or a package's __main__.py)
            runpy.run_module(module, run_name="__main__")
            status = 0
        except _Parsed as parsed:
            ns = parsed.namespace
            overrides = [o for o in getattr(ns, "overrides", None) or [] if "=" in o and "<" not in o]
            if getattr(ns, "config", None) is not None or overrides:
                load_config(getattr(ns, "config", None), overrides, check_data=False)
            return
        except SystemExit as exit_:
            status = exit_.code
    pytest.fail(f"{_rel(page)}: `{shlex.join(words)}` did not parse (status {status}): {err.getvalue()[-600:]}")


def _sections(text: str) -> Iterator[tuple[list[str], list[bool]]]:
    """Each section (the lines between two headings outside code blocks) with, per line, whether it is code."""
    lines, code, in_code = text.splitlines(), [], False
    for line in lines:
        if line.startswith("```"):
            in_code = not in_code
            code.append(True)
        else:
            code.append(in_code)
    heads = [i for i, line in enumerate(lines) if line.startswith("#") and not code[i]] + [len(lines)]
    for start, end in zip([0, *heads[:-1]], heads, strict=True):
        yield lines[start:end], code[start:end]


COMMAND = r"(sigmanens|python|python3|bash|torchrun|OMP_NUM_THREADS=1 python|CI=true bash)\b"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_every_table_of_numbers_names_its_command(page: Path) -> None:
    orphans = []
    for lines, code in _sections(page.read_text()):
        table = [line for line, is_code in zip(lines, code, strict=True) if line.startswith("|") and not is_code]
        if len(re.findall(r"(?<![\w.])[−+-]?\d+\.\d{3,}", "\n".join(table))) < 3:  # measured, not settings
            continue
        named = any(re.match(COMMAND, line.strip()) for line, is_code in zip(lines, code, strict=True) if is_code) \
            or re.search("`" + COMMAND, "\n".join(lines))
        if not named:
            orphans.append(lines[0][:80])
    assert not orphans, f"{_rel(page)}: these sections hold a table of numbers but name no command: {orphans}"


def test_readme_is_a_newcomers_page() -> None:
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines (at most 200; the rest belongs in docs/)"
    slurm = next(i for i, line in enumerate(lines) if line.startswith("## ImageNet on Slurm"))
    assert slurm < 120 and any("bash slurm/imagenet_vit.sh" in line for line in lines[slurm:slurm + 12])


def test_one_imagenet_path() -> None:
    """One ImageNet folder has one name: the recipes, the scripts and the docs all say /data/imagenet_ffcv (the
    ImageFolder it is converted from: /data/imagenet). The changelog may name the old ones."""
    named = set()
    for path in [*REPO.glob("configs/*.yaml"), *REPO.glob("slurm/*.sh"), *PAGES]:
        if path.name == "CHANGELOG.md":
            continue
        named |= set(re.findall(r"(/\w+/imagenet\w*)(?![\w-])", path.read_text()))
    assert named == {"/data/imagenet", "/data/imagenet_ffcv"}, named


HISTORY = re.compile(r"\bissues? \d+|\bv0\.1\b|\bthis stop\b", re.I)


def test_reference_pages_describe_the_code_not_its_history() -> None:
    """docs/ and the README say what the code and recipes are now; issue numbers, versions and "this stop" belong in
    CHANGELOG.md."""
    hits = [f"{_rel(page)}:{number}: {line.strip()[:100]}"
            for page in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
            for number, line in enumerate(page.read_text().splitlines(), 1) if HISTORY.search(line)]
    assert not hits, "history in a reference page (it belongs in CHANGELOG.md):\n" + "\n".join(hits)


# What the machine the project was developed on did (its shared agents, device-time leases, the clock of a
# session) tells a user nothing about their own runs.
NARRATION = re.compile(r"device[- ]time|\bleases?\b|\blent\b|(?<!job's )\bagents\b|\b(?:at|to|from) \d{1,2}:\d{2}\b",
                       re.I)


def test_reference_pages_do_not_narrate_the_development_machine() -> None:
    hits = [f"{_rel(page)}:{number}: {line.strip()[:100]}"
            for page in [REPO / "README.md", *sorted(REPO.glob("docs/*.md"))]
            for number, line in enumerate(page.read_text().splitlines(), 1) if NARRATION.search(line)]
    assert not hits, "the development machine's story in a reference page:\n" + "\n".join(hits)


def test_architecture_states_the_member_layout_the_code_has() -> None:
    """docs/architecture.md states one layout: member-major outside the backbone, interleaved (row b·M + m) inside,
    published by the store's PassPlan. Every σ class it cites exists, and the layout is the one the code's own
    docstrings state."""
    import dataclasses

    from sigmanens_dist.methods import sigma as sigma_method
    from sigmanens_dist.sigma import layers
    from sigmanens_dist.sigma.layers import sigma_norm

    text = (REPO / "docs" / "architecture.md").read_text()
    cited = set(re.findall(r"`(Sigma\w+|PassPlan)\b", text))
    assert {"PassPlan", "SigmaStore", "SigmaEnsemble"} <= cited, cited
    missing = sorted(n for n in cited if not hasattr(layers, n) and not hasattr(sigma_method, n))
    assert not missing, f"docs/architecture.md cites names the code does not have: {missing}"
    assert "interleaved" in {field.name for field in dataclasses.fields(layers.PassPlan)}
    assert "PassPlan(interleaved=True)" in text and "b·M + m" in text
    assert "b·M + m" in (sigma_norm.__doc__ or ""), "the σ layers' docstring no longer states the layout the page does"
    wrong = re.findall(r"[^.]*inside the backbone[^.]*member-major[^.]*", text, flags=re.I)
    assert not wrong, f"docs/architecture.md puts member-major rows inside the backbone: {wrong}"


def test_the_excerpt_check_sees_a_stale_excerpt_both_ways() -> None:
    """``readme_demo.py --check``'s comparison on the README's own excerpt: the same lines pass (the timing row by
    its label); an emptied excerpt, a dropped row, a changed number fail, naming the lines."""
    demo = runpy.run_path(str(REPO / "launch" / "readme_demo.py"))
    readme = (REPO / "README.md").read_text()
    start, end, written_on = demo["excerpt"](readme)
    assert written_on and "(" in written_on  # the CPU's name and torch's vector instructions
    table = readme[start:end].splitlines()
    stale = demo["stale_lines"]
    retimed = [re.sub(r"\d", "9", line) if "ms / image" in line else line for line in table]
    assert len(table) > 5 and stale(table, retimed) == []
    assert stale([], table) == [f"demo: {line}" for line in table]
    assert stale(table[:2] + table[3:], table) == [f"demo: {table[2]}"]
    changed = [*table[:3], table[3].replace("0", "1"), *table[4:]]
    assert stale(changed, table) == [f"README: {changed[3]}", f"demo: {table[3]}"]
    # another CPU: a score may differ, a row may not, nor a cost line (the same on every CPU)
    assert stale(changed, table, scores=False) == [] and stale(table[:2] + table[3:], table, scores=False)
    row = next(i for i, line in enumerate(table) if "parameters" in line)
    costs = [*table[:row], re.sub(r"\d", "7", table[row]), *table[row + 1:]]
    assert stale(costs, table, scores=False) == [f"README: {costs[row]}", f"demo: {table[row]}"]


@pytest.mark.slow
def test_readme_demo_excerpt_is_what_the_demo_prints() -> None:
    """The README's demo table is the demo's own output on this build (timing row by label): a stale excerpt makes a
    new user think the install is wrong. `python launch/readme_demo.py --write` refreshes it."""
    import subprocess

    proc = subprocess.run([sys.executable, str(REPO / "launch" / "readme_demo.py"), "--check"], capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
