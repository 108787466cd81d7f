"""The docs site builds with --strict, the API reference covers the library, and the checks that
make --strict fail on a missing docstring or an unreferenced module really fail."""
import html
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    return out


def _text(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", " ", page.read_text()))


def test_site_builds_strict_with_guides_results_and_api(site):
    for page in ("index.html", "getting-started/index.html", "guide/algorithms/index.html",
                 "guide/multi-node/index.html", "results/time-to-accuracy/index.html",
                 "status/index.html"):
        assert (site / page).is_file(), page
    api = _text(site / "api" / "grace" / "index.html")
    assert "grace_from_params" in api and "Build the communicator described by GRACE-style" in api
    optimizer = _text(site / "api" / "integration" / "index.html")
    assert "DistributedOptimizer" in optimizer and "comm_hook" in optimizer
    assert (site / "assets" / "experiments" / "results" / "main_job" / "accuracy_vs_time.png").is_file()


def test_the_parameter_and_algorithm_tables_are_generated_from_the_registry(site):
    from spardl_grace.registry import ALGORITHMS, PARAMS
    page = _text(site / "guide" / "parameters" / "index.html")
    assert "generated:" not in page
    for param in PARAMS:
        assert f" {param.key} " in page and param.accepts() in page, param.key
    for algorithm in ALGORITHMS.values():
        assert algorithm.doc in page, algorithm.name


def test_the_generated_tables_in_the_pages_as_committed_are_current():
    """A page read as a file (on GitHub, in an editor) shows the tables the site builds;
    `python docs/hooks.py` writes them after the registry changes."""
    hooks = _hooks()
    pages = [p for p in (ROOT / "docs").rglob("*.md") if hooks.GENERATED_BLOCK.search(p.read_text())]
    assert pages
    for page in pages:
        assert hooks.fill_generated(page.read_text()) == page.read_text(), (
            f"{page.relative_to(ROOT)}: run python docs/hooks.py")


def test_the_library_has_no_public_object_without_a_docstring():
    hooks = _hooks()
    assert hooks.missing_docstrings(hooks.load()) == []


def test_every_public_module_is_in_the_api_reference():
    hooks = _hooks()
    modules = hooks.public_modules(hooks.load())
    assert "spardl_grace.communicators.spardl" in modules and "deepreduce_compat.codec" in modules
    assert not any(part.startswith("_") for m in modules for part in m.split("."))
    assert hooks.modules_missing_from_reference(ROOT / "docs" / "api", modules) == []


def test_a_missing_docstring_and_an_unreferenced_module_are_reported(tmp_path):
    """What makes `mkdocs build --strict` fail: an undocumented public function, class or
    method is named; one that inherits its base's docstring, or is private, is not."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text('"""A package."""\n')
    (package / "mod.py").write_text(
        '"""A module."""\n'
        'def documented():\n    """Yes."""\n'
        'def undocumented():\n    pass\n'
        'def _private():\n    pass\n'
        'class Base:\n    """A base."""\n    def run(self):\n        """Runs."""\n'
        'class Child(Base):\n    """A child."""\n    def run(self):\n        return 1\n'
        '    def extra(self):\n        return 2\n'
        'class Bare:\n    pass\n')
    hooks = _hooks()
    loaded = hooks.load(("pkg",), [tmp_path])
    missing = hooks.missing_docstrings(loaded)
    assert sorted(missing) == ["pkg.mod.Bare", "pkg.mod.Child.extra", "pkg.mod.undocumented"]
    api = tmp_path / "api"
    api.mkdir()
    (api / "page.md").write_text("# API\n\n::: pkg\n")
    assert hooks.modules_missing_from_reference(api, hooks.public_modules(loaded)) == ["pkg.mod"]


def test_a_results_table_without_its_provenance_line_is_reported(tmp_path):
    """What makes `mkdocs build --strict` fail on a results page (every page there passes, or
    the site test fails): a table not followed by 'Recorded DATE, MACHINE: `COMMAND` ->
    `RESULT`', or whose line lacks the machine, the command or an existing result file."""
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    for name in ("a_100mbit.json", "a_1gbit.json"):
        (tmp_path / "benchmarks" / "results" / name).write_text("{}")
    table = "| x | y |\n|---|---|\n| 1 | 2 |\n"
    good = ("Recorded 2026-11-25, 2 CPU cores: `python -m benchmarks.comm --bandwidth 1gbit` -> "
            "`benchmarks/results/a_{100mbit,1gbit}.json`.\n")
    check = _hooks().tables_without_provenance
    assert check(f"# Page\n\n{table}\n{good}", tmp_path) == []
    assert check(f"```\n{table}```\n", tmp_path) == []  # a table in a code block is text
    cases = {
        "no line 'Recorded": f"{table}\nSome prose.\n",
        "names no machine": f"{table}\n{good.replace('2 CPU cores', 'a machine')}",
        "gives no command": f"{table}\n{good.replace('`python -m benchmarks.comm --bandwidth 1gbit`', 'the benchmark')}",
        "names no result file that exists": f"{table}\n{good.replace('1gbit}', '10gbit}')}",
    }
    for why, page in cases.items():
        problems = check(f"# Page\n\n{table}\n{good}\n{page}", tmp_path)
        assert len(problems) == 1 and why in problems[0] and "table at line 9" in problems[0], why


def test_the_readmes_relative_links_resolve():
    """GitHub renders README.md and examples/README.md outside the site: their links to files
    of the repository must point at files that exist."""
    for readme in (ROOT / "README.md", ROOT / "examples" / "README.md"):
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme.read_text())
        local = [link for link in links if not re.match(r"[a-z]+://", link)]
        if readme == ROOT / "README.md":
            assert local, "the README links into the docs"
        for link in local:
            assert (readme.parent / link).exists(), f"{readme.relative_to(ROOT)} links to missing {link}"
