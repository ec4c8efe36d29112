"""The documentation site: it builds with warnings as errors (broken internal links and anchors included),
every `posttrain <command> --config ...` command shown in the docs and the README loads and validates its
config, and the built front page and a deep page render in headless Chromium with their title and
navigation (skipped, saying why, where no Chromium is installed)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.cli import CONFIG_COMMANDS
from posttrain.cli import main as posttrain_main

REPO = Path(__file__).resolve().parents[2]
DOC_FILES = sorted(p for p in (REPO / "docs").rglob("*.md") if "generated" not in p.parts) + [
    REPO / "README.md"
]
COMMAND = re.compile(
    r"posttrain (sft|grpo|ppo|distill|dpo|rm|eval) --config ([^\s`;]+\.yaml)"  # the config file
    r"((?:[ \t]+(?:\\\n\s*)?[+~]*[\w.\[\]]+=[^\s`;]+)*)"  # overrides, on continued lines too
)


def site_dir(tmp_path_factory) -> Path:
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    out = tmp_path_factory.mktemp("site")
    built = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    return site_dir(tmp_path_factory)


def test_the_site_builds_without_a_warning_and_generates_its_reference_pages(site):
    config_page = (site / "generated" / "config" / "index.html").read_text()
    for key in ("grpo.validation.grader", "policy.train_global_batch_size", "checkpointing.checkpoint_dir"):
        assert key in config_page  # from the schema, never typed by hand
    benchmarks = (site / "generated" / "benchmarks" / "index.html").read_text()
    assert (
        "grpo_step_smollm2_cpu" in benchmarks
        and (site / "generated" / "grpo_step_times.png").stat().st_size > 1000
    )
    assert "posttrain.workers.policy.base" in (site / "generated" / "api" / "index.html").read_text()


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for path in DOC_FILES:
        for match in COMMAND.finditer(path.read_text()):
            overrides = shlex.split(match.group(3).replace("\\\n", " "))
            found.append(
                (
                    f"{path.relative_to(REPO)}: {match.group(0)[:80]}",
                    [match.group(1), "--config", match.group(2), *overrides],
                )
            )
    return found


def test_the_docs_show_commands_of_every_algorithm():
    commands = {argv[0] for _, argv in documented_commands()}
    assert commands == set(CONFIG_COMMANDS)


@pytest.mark.parametrize(
    "where,argv", documented_commands(), ids=lambda value: value if isinstance(value, str) else ""
)
def test_every_documented_command_loads_and_validates_its_config(where, argv, monkeypatch, capsys):
    """The config is valid; the only files it may miss are under results/, written by an earlier
    command of the same page (a fresh clone has none)."""
    monkeypatch.chdir(REPO)
    with pytest.raises(SystemExit) as stopped:
        posttrain_main([*argv, "--check-config"])
    out, err = capsys.readouterr()
    if stopped.value.code == 0:
        assert "a valid" in out
        return
    problems = err.strip().splitlines()
    assert stopped.value.code == 2 and problems, err
    for problem in problems:
        assert "does not exist" in problem and " results/" in problem, problem


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.parametrize("page", ["index.html", "algorithms/grpo/index.html"])
def test_pages_render_in_headless_chromium_with_title_and_navigation(site, page):
    browser = chromium()
    if browser is None:
        pytest.skip("no Chromium installed (Debian: apt-get install chromium; make install-chromium)")
    rendered = subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--dump-dom", (site / page).as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    dom = rendered.stdout
    assert "<title>" in dom and "posttrain" in dom.split("<title>")[1].split("</title>")[0], rendered.stderr[
        -500:
    ]
    assert 'class="md-nav' in dom and "Troubleshooting" in dom and "Configuration" in dom
