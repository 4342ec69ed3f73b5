"""The README and docs/ as a user meets them: short, links that resolve, a set-up command that
is what CI runs, a template that is a working scenario, and a scenario reference that names
every key the schema accepts."""

from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest
from pydantic import BaseModel

from kvfrag.cli import main

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_readme_is_short_and_answers_how_many_fit_and_what_rate():
    text = README.read_text()
    assert len(text.splitlines()) <= 300
    assert "<!--" not in text  # (no placeholder left for a feature to come)
    assert "`capacity`" in text and "mem cap" in text
    assert "kvfrag plan scenarios/your-question.yaml --ttft-p99 2s --tpot-p99 50ms" in text


def _setup_commands() -> list[str]:
    """The commands of the README's set-up block, one a line (comments left out)."""
    text = README.read_text()
    block = text[text.index("## Set-up"):]
    block = block[block.index("```bash\n") + 8:]
    block = block[:block.index("```")]
    return [line for line in block.splitlines() if line and not line.startswith("#")]


def test_ci_runs_exactly_the_readmes_second_setup_command():
    """CI (.ci/run) must install and test what a user's command 2 does, no more and no less."""
    commands = _setup_commands()
    assert len(commands) == 2
    second = commands[1]
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.startswith("#")]
    assert ci[-1] == second
    # What the tests need, named explicitly: torch's CPU build, vLLM's scheduler, Chromium.
    assert "pip install 'torch==2.13.0+cpu'" in second
    assert second.index("torch==2.13.0+cpu") < second.index("[test,validate,ray]")
    for step in ("bash .ci/install-oracle.sh", "bash .ci/install-chromium.sh",
                 "ruff check .", "python -m pytest -q"):
        assert step in second, step
        if step.startswith("bash "):
            assert (ROOT / step.split()[1]).is_file(), step
    assert second.endswith("python -m pytest -q")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {_slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    links = [m.group(1) for m in LINK.finditer(text)]
    assert links or page.name not in ("README.md", "index.md")
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # an absolute address
        target, _, anchor = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        assert path.exists(), f"{page.name}: {link}"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.name}: {link}"


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {m.group(1).partition("#")[0] for m in LINK.finditer(index)}
    assert {p.name for p in DOCS} - {"index.md"} <= linked


def test_the_readme_template_is_the_shipped_scenario():
    """The block a user copies is scenarios/your-question.yaml, byte for byte (less the file's
    leading comment)."""
    text = README.read_text()
    start = text.index("```yaml\nname: your-question") + len("```yaml\n")
    block = text[start:text.index("```", start)]
    shipped = (ROOT / "scenarios" / "your-question.yaml").read_text()
    body = "".join(line for line in shipped.splitlines(keepends=True)
                   if not (line.startswith("#") and shipped.index(line) < shipped.index("name:")))
    assert body == block


def test_the_template_answers_its_question(tmp_path):
    """Cut down to 150 requests at 20 req/s and the block-size half of the sweep, where memory
    binds the worst-case slabs: they run exactly as many at once as whole slabs fit in the
    derived budget (the README's arithmetic), and paged blocks run more at every point."""
    out = tmp_path / "yq"
    rc = main(["run", "your-question", "-o", str(out), "-q", "--no-plots", "--no-report",
               "-j", "1", "--set", "workload.synthetic.count=150",
               "--set", "workload.synthetic.arrival.rate=20",
               "--set", 'sweep={"allocators.paged.block_size": [16, 32]}'])
    assert rc == 0
    rows = pd.read_csv(out / "summary.csv")
    assert len(rows) == 4 and set(rows["label"]) == {"slab-max", "paged"}
    slab = rows[rows["label"] == "slab-max"]
    fit = slab["kv_budget_bytes"] // (slab["max_model_len"] * slab["bytes_per_token"])
    assert (slab["max_running"] == fit).all()
    for point, group in rows.groupby("point"):
        by = group.set_index("label")
        assert by.loc["paged", "max_running"] > by.loc["slab-max", "max_running"], point
        assert by.loc["slab-max", "internal_frac"] > by.loc["paged", "internal_frac"], point


def _fields(model: type[BaseModel], seen: set[type]) -> set[str]:
    """Every field name of a pydantic model and of the models its fields hold."""
    if model in seen:
        return set()
    seen.add(model)
    names = set(model.model_fields)
    for field in model.model_fields.values():
        stack = [field.annotation]
        while stack:
            tp = stack.pop()
            if isinstance(tp, type) and issubclass(tp, BaseModel):
                names |= _fields(tp, seen)
            stack.extend(getattr(tp, "__args__", ()) or ())
            stack.extend(getattr(tp, "__metadata__", ()) or ())
            origin = getattr(tp, "__origin__", None)
            if origin is not None:
                stack.append(origin)
    return names


def test_the_scenario_reference_names_every_key():
    from kvfrag.sim.scenario import Scenario

    text = (ROOT / "docs" / "scenarios.md").read_text()
    missing = sorted(name for name in _fields(Scenario, set())
                     if not re.search(rf"(?<![\w.]){re.escape(name)}(?!\w)", text))
    assert not missing
