"""docs/benchmarks.md is one report generated from the JSON committed in the repository: every
figure of its Goals table comes from a run file under docs/benchmarks/runs/ that git tracks, each
goal appears once, and the page is exactly what `bench/report.py --runs docs/benchmarks/runs` makes
of those files now (add a run, regenerate the page)."""

import json
import subprocess
from pathlib import Path

import pytest
from bench_scripts import load_bench

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "benchmarks" / "runs"


@pytest.fixture(scope="module")
def report():
    return load_bench("report")


@pytest.fixture(scope="module")
def scan(report):
    return report.scan_runs(RUNS, ROOT)


def _tracked() -> set[str] | None:
    try:
        out = subprocess.run(["git", "-C", str(ROOT), "ls-files", "docs/benchmarks/runs"],
                             capture_output=True, text=True, timeout=30)
    except OSError:
        return None
    return set(out.stdout.split()) if out.returncode == 0 and out.stdout else None


def test_every_goal_figure_comes_from_a_committed_json(report, scan):
    rows = report.repository_goals(scan)
    assert len(rows) >= 10
    figures = [row[0] for row in rows]
    assert len(figures) == len(set(figures)), "a goal appears twice"
    tracked = _tracked()
    for figure, _goal, measured, verdict, date, _commit, gpu, source in rows:
        assert source.startswith("docs/benchmarks/runs/") and source.endswith(".json"), (figure, source)
        assert gpu in ("H100", "H200"), (figure, gpu)  # every committed run names its card
        assert (ROOT / source).is_file(), source
        if tracked is not None:
            assert source in tracked, f"{source} is not committed"
        assert measured not in ("", "—") and verdict in ("met", "**missed**", "—"), (figure, measured)
        assert date != "—", (figure, source)
    # A figure read straight from its file, not through the report: section 7's goals.
    for figure, _goal, measured, verdict, _date, _commit, _gpu, source in rows:
        data = json.loads((ROOT / source).read_text())
        for g in (data.get("results") or {}).get("goals") or []:
            if isinstance(g, dict) and g.get("metric") == figure:
                assert measured.startswith(f"{g['value']:.2f}×") and (verdict == "met") == g["met"], figure


def test_the_page_is_the_generated_report(report, scan):
    page = (ROOT / "docs" / "benchmarks.md").read_text()
    table = page.split("## Goals\n\n", 1)[1].split("\n\n", 1)[0]
    assert table == report.goals_table(report.repository_goals(scan)), \
        "docs/benchmarks.md's Goals table is stale: python3 bench/report.py --runs docs/benchmarks/runs"
    assert page == report.render_repository(scan, ROOT)


def test_each_goal_is_taken_from_its_latest_run(report, tmp_path):
    """Two folders measuring the same goals: the table holds the later one only."""
    for name, date, value in (("a", "2026-12-01 10:00 UTC", 1.10), ("b", "2026-12-01 11:00 UTC", 0.90)):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        (folder / "fp8_crossover.json").write_text(json.dumps({
            "environment": {"date": date, "commit": f"c0ffee{name}"},
            "goal": {"name": "x", "min_engine_speedup": value, "met": value >= 1.0},
            "step_linears": [{"m": 2048, "us": {"bf16": 2.0, "engine": 2.0 / value},
                              "speedup_vs_bf16": {"bf16": 1.0, "engine": value}}]}))
    rows = report.repository_goals(report.scan_runs(tmp_path / "runs", tmp_path))
    assert len(rows) == 2 and all(row[5] == "c0ffeeb" and row[6] == "—" and row[7] == "runs/b/fp8_crossover.json"
                                  for row in rows)
    assert rows[0][2] == "0.90×" and rows[0][3] == "**missed**"


def test_a_self_describing_script_brings_its_goals_and_section(report, tmp_path):
    """A bench script's JSON that names itself ("script") adds its goals to the table, judged
    by their direction, and its markdown beside it becomes its section."""
    folder = tmp_path / "runs" / "a"
    folder.mkdir(parents=True)
    (folder / "probe.json").write_text(json.dumps({
        "script": "bench/probe.py", "title": "A probe", "command": "python3 bench/probe.py --out OUT",
        "environment": {"date": "2026-12-02 07:00 UTC", "commit": "abc1234", "device": "GPU X"},
        "goals": {"fast": {"figure": "probe speed-up", "goal": 1.3, "measured": 1.25, "unit": "x"},
                  "small": {"figure": "probe latency", "goal": 5.0, "measured": 4.0, "unit": "ms",
                            "better": "lower"}}}))
    (folder / "probe.md").write_text("# title line\n\n| a | b |\n|---|---|\n| 1 | 2 |\n")
    scan = report.scan_runs(tmp_path / "runs", tmp_path)
    rows = {row[0]: row for row in report.repository_goals(scan)}
    assert rows["probe speed-up"][1:4] == ["≥ 1.3×", "1.25×", "**missed**"]
    assert rows["probe latency"][1:4] == ["≤ 5.00 ms", "4.00 ms", "met"]
    assert rows["probe latency"][5:] == ["abc1234", "GPU X", "runs/a/probe.json"]
    text = "\n".join(report.described_sections(scan["scripts"]))
    assert "## A probe" in text and "| 1 | 2 |" in text and "title line" not in text
    assert "`python3 bench/probe.py --out OUT` (2026-12-02 07:00 UTC, commit abc1234" in text
