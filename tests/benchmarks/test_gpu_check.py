"""benchmarks/gpu_check.py: its whole plan runs on CPU (`--dry-run`), and the plan runner keeps
going past a part that raises or hangs, printing one parseable JSON line per outcome."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from benchmarks.gpu_check_parts import PLAN  # noqa: E402
from benchmarks.gpu_check_parts.plan import Context, Part, Skip, run_plan  # noqa: E402

DRY_RUN_BOUND_S = 240  # ~60-100 s on an idle 2-core machine; the bound only stops a hang


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def test_dry_run_prints_a_json_line_for_every_part_and_exits_0(tmp_path) -> None:
    env = {**os.environ, "PYTHONPATH": REPO}
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--dry-run",
         "--output", str(tmp_path / "RESULTS.md")],
        capture_output=True, text=True, timeout=DRY_RUN_BOUND_S, env=env, check=False,
    )  # fmt: skip
    spent = time.monotonic() - start
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    records = _records(done.stdout)  # every stdout line is JSON
    by_part: dict[str, list[dict]] = {}
    for r in records:
        by_part.setdefault(r["part"], []).append(r)
    assert list(by_part) == [p.name for p in PLAN]  # all parts, in plan order
    for part in PLAN:
        lines = by_part[part.name]
        assert not [r for r in lines if "error" in r], lines
        figures = [r for r in lines if "figure" in r and r["figure"] != "seconds"]
        skipped = [r for r in lines if r.get("skipped")]
        assert figures or (skipped and skipped[0]["reason"]), (part.name, lines)
        for r in figures:
            assert {"value", "unit", "ok"} <= set(r) and r["ok"] is True, r
    assert {p for p, ls in by_part.items() if any(r.get("skipped") for r in ls)} == {"dbo"}
    assert not (tmp_path / "RESULTS.md").exists()  # a dry run writes no results
    print(f"dry run: {spent:.0f} s")


def _ctx() -> tuple[Context, io.StringIO]:
    out = io.StringIO()
    return Context("cpu", True, "/nonexistent", out=out), out


def _figure(name: str):
    return lambda ctx: ctx.figure(name, 1, "n")


def test_a_failing_part_is_an_error_line_and_later_parts_still_run() -> None:
    def boom(ctx: Context) -> None:
        ctx.figure("before", 1, "n")
        raise RuntimeError("kernel exploded")

    def hang(ctx: Context) -> None:
        while True:
            time.sleep(0.01)

    def cannot(ctx: Context) -> None:
        raise Skip("needs two GPUs")

    parts = [Part("first", 5, _figure("a")), Part("boom", 5, boom), Part("hang", 0.3, hang),
             Part("cannot", 5, cannot), Part("silent", 5, lambda ctx: None),
             Part("last", 5, _figure("z"))]  # fmt: skip
    ctx, out = _ctx()
    start = time.monotonic()
    assert run_plan(parts, ctx, deadline_s=60) is False
    assert time.monotonic() - start < 5  # the hang cost its bound only
    records = [r for r in _records(out.getvalue()) if r.get("figure") != "seconds"]
    assert records == [
        {"part": "first", "figure": "a", "value": 1, "unit": "n", "ok": True},
        {"part": "boom", "figure": "before", "value": 1, "unit": "n", "ok": True},
        {"part": "boom", "error": "RuntimeError: kernel exploded"},
        {"part": "hang", "error": "PartTimeout: ran past its bound of 0 s"},
        {"part": "cannot", "skipped": True, "reason": "needs two GPUs"},
        {"part": "silent", "error": "the part printed no figure"},
        {"part": "last", "figure": "z", "value": 1, "unit": "n", "ok": True},
    ]


def test_the_global_deadline_skips_the_remaining_parts_with_a_line() -> None:
    parts = [Part("slow", 5, lambda ctx: time.sleep(0.4) or ctx.figure("s", 1, "n")),
             Part("next", 5, _figure("n"))]  # fmt: skip
    ctx, out = _ctx()
    assert run_plan(parts, ctx, deadline_s=1.2) is True
    records = _records(out.getvalue())
    assert records[-1]["part"] == "next" and records[-1]["skipped"] is True
    assert "global deadline of 1 s" in records[-1]["reason"]


def test_a_figure_not_ok_fails_the_plan_and_bad_arguments_name_the_flag() -> None:
    ctx, _ = _ctx()
    assert run_plan([Part("p", 5, lambda c: c.figure("f", 0, "n", ok=False))], ctx, 60) is False
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "gpu_check.py"), "--parts", "nope"],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO},
        check=False,
    )  # fmt: skip
    assert done.returncode == 2 and "--parts takes a comma-separated subset of" in done.stderr


def test_every_part_has_a_name_a_purpose_and_a_bound_within_the_lease() -> None:
    assert len({p.name for p in PLAN}) == len(PLAN)
    assert all(0 < p.seconds <= 180 and p.doc for p in PLAN)


def test_results_replace_only_their_own_section(tmp_path) -> None:
    from benchmarks.gpu_check import write_section

    path = tmp_path / "RESULTS.md"
    path.write_text("# Results\n\n<!-- gpu_check:status:begin -->\nold H100 run\n"
                    "<!-- gpu_check:status:end -->\n")  # fmt: skip
    write_section(str(path), ["first"])
    write_section(str(path), ["second", "run"])
    text = path.read_text()
    assert text.count("<!-- gpu_check:begin -->") == 1 and "first" not in text
    assert "<!-- gpu_check:begin -->\nsecond\nrun\n<!-- gpu_check:end -->" in text
    assert text.startswith("# Results\n\n<!-- gpu_check:status:begin -->\nold H100 run\n")
