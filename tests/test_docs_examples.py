"""Every fenced Python example in docs/*.md runs as written, unless the line before its fence marks
it as a fragment (``<!-- fragment: what it needs -->``). README.md's examples are run by
tests/test_readme.py, which runs all of them: the README has no fragments."""
import re

import pytest

from conftest import ROOT, clean_env, run_python

FENCE = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)
MARK = "<!-- fragment"


def python_blocks(text: str) -> list[tuple[int, str, bool]]:
    """``(line of the fence, code, is_fragment)`` for every fenced Python block of a Markdown text.

    A block is a fragment when the last non-blank line before its fence starts with ``<!-- fragment``.
    """
    out = []
    for m in FENCE.finditer(text):
        before = [line for line in text[:m.start()].splitlines() if line.strip()]
        line = text[:m.start()].count("\n") + 1
        out.append((line, m.group(1), bool(before) and before[-1].lstrip().startswith(MARK)))
    return out


DOCS = sorted((ROOT / "docs").glob("*.md"))
BLOCKS = [(f"{p.relative_to(ROOT)}:{line}", code) for p in DOCS
          for line, code, fragment in python_blocks(p.read_text(encoding="utf-8")) if not fragment]


def test_block_extraction_honours_the_fragment_mark():
    text = ("Intro\n\n```python\nprint(1)\n```\n\n<!-- fragment: needs `model` -->\n```python\nmodel.train()\n```\n"
            "```bash\nls\n```\n<!-- fragment -->\n\n```python\nx\n```\n")
    assert [(code, frag) for _, code, frag in python_blocks(text)] == [("print(1)\n", False), ("model.train()\n", True),
                                                                       ("x\n", True)]


def test_the_docs_have_runnable_examples_and_marked_fragments():
    fragments = [(p.name, line) for p in DOCS for line, _, frag in python_blocks(p.read_text(encoding="utf-8")) if frag]
    assert len(BLOCKS) >= 6 and fragments  # most examples run; the rest say what they need
    readme = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
    assert readme and not any(frag for _, _, frag in readme)  # tests/test_readme.py runs every one


@pytest.mark.parametrize("where,code", BLOCKS, ids=[w for w, _ in BLOCKS])
def test_docs_example_runs_as_written(where, code, tmp_path):
    proc = run_python(code, env=clean_env(), cwd=tmp_path)  # outside the checkout: nothing written into it
    assert proc.returncode == 0, f"{where}:\n{proc.stderr[-3000:]}"
