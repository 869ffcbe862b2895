"""tests/lanes.py, the runner of `make test`, on lanes of throwaway test modules: a failing test in
one lane fails the run and its output is shown in full while the other lane passes; lanes run side
by side, each with its own number (its block of ports) and one shared run directory; a module in
no lane stops the run before anything runs."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections import Counter

import harness
import lanes

# Each side-by-side module waits for the other to have started: they pass only if the two lanes
# really run at once (a serial runner would make the first wait out its bound and fail).
MEETS = """
import os, time
from pathlib import Path

def test_{me}_meets_{other}():
    run = Path(os.environ["TS_TEST_RUN_DIR"])
    (run / "{me}").write_text(os.environ["TS_TEST_LANE_INDEX"])
    deadline = time.monotonic() + 60
    while not (run / "{other}").exists():
        assert time.monotonic() < deadline, "the other lane never started"
        time.sleep(0.1)
    assert (run / "{other}").read_text() != os.environ["TS_TEST_LANE_INDEX"]
"""
FAILS = """
def test_the_deliberate_failure():
    assert 6 * 7 == 41, "deliberately failing: the runner must show this line"
"""


def run(tmp_path, modules: dict[str, str], side_by_side, alone, capsys) -> tuple[int, str, dict]:
    tests = tmp_path / "tests"
    tests.mkdir()
    for name, text in modules.items():
        (tests / name).write_text(text)
    args = argparse.Namespace(lanes=None, pytest_args=[])
    code = lanes.run(args, side_by_side, alone, tests, tmp_path / "results")
    record_file = tmp_path / "results" / "run.json"
    record = json.loads(record_file.read_text()) if record_file.exists() else {}
    return code, capsys.readouterr().out, record


def test_a_failing_test_fails_the_run_with_its_output_and_the_other_lanes_still_report(
    tmp_path, capsys
):
    modules = {
        "test_a.py": MEETS.format(me="a", other="b") + FAILS,
        "test_b.py": MEETS.format(me="b", other="a"),
        "test_c.py": "def test_alone():\n    pass\n",
    }
    code, out, record = run(
        tmp_path, modules, {"one": ["test_a.py"], "two": ["test_b.py"]}, {"last": ["test_c.py"]},
        capsys,
    )  # fmt: skip
    assert code == 1, out
    # The failing lane's failure, in full: the assertion's message and the source line.
    assert "deliberately failing: the runner must show this line" in out
    assert "assert 6 * 7 == 41" in out
    assert "FAILED in lanes one" in out
    summaries = [line for line in out.splitlines() if line.startswith("lane ")]
    assert any(line.startswith("lane one") and "FAILED" in line for line in summaries), out
    assert any(line.startswith("lane two") and "passed" in line for line in summaries), out
    assert any(line.startswith("lane last") and "passed" in line for line in summaries), out
    assert record["passed"] is False and record["lanes"]["one"]["exit"] == 1
    outcomes = {t["test"].rsplit("::", 1)[1]: t["outcome"] for t in record["tests"]}
    assert outcomes == {
        "test_a_meets_b": "passed",
        "test_the_deliberate_failure": "failed",
        "test_b_meets_a": "passed",
        "test_alone": "passed",
    }


def test_each_lane_reports_the_cpu_of_its_own_processes(tmp_path, capsys):
    """A lane whose test spins for two seconds of CPU, beside one whose test sleeps as long: only
    the first is charged for it, in its line and in run.json."""
    spins = "import time\n\ndef test_spins():\n    end = time.process_time() + 2.0\n"
    spins += "    while time.process_time() < end:\n        pass\n"
    sleeps = "import time\n\ndef test_sleeps():\n    time.sleep(2.0)\n"
    modules = {"test_spins.py": spins, "test_sleeps.py": sleeps}
    lanes_of = {"busy": ["test_spins.py"], "idle": ["test_sleeps.py"]}
    code, out, record = run(tmp_path, modules, lanes_of, {}, capsys)
    assert code == 0, out
    busy, idle = (record["lanes"][name]["host_cpu_s"] for name in ("busy", "idle"))
    # pytest's own start-up is charged to both; the spin only to its lane.
    assert busy >= idle + 1.5, record["lanes"]
    assert any(line.startswith("lane busy") and " cpu " in line for line in out.splitlines()), out


def test_a_module_in_no_lane_stops_the_run_before_it_starts(tmp_path, capsys):
    modules = {"test_a.py": "def test_a():\n    pass\n", "test_forgotten.py": FAILS}
    code, out, record = run(tmp_path, modules, {"one": ["test_a.py"]}, {}, capsys)
    assert code == 2
    assert "test_forgotten.py" in out
    assert record == {} and not (tmp_path / "results" / "lanes").exists()


def test_a_deselected_test_of_a_lane_does_not_run(tmp_path, capsys):
    modules = {"test_a.py": "def test_kept():\n    pass\n\n" + FAILS}
    lanes_of = {"one": ["test_a.py", "--deselect=test_a.py::test_the_deliberate_failure"]}
    code, out, record = run(tmp_path, modules, lanes_of, {}, capsys)
    assert code == 0, out
    assert [t["test"].rsplit("::", 1)[1] for t in record["tests"]] == ["test_kept"]


def collected(cmd: list[str], env: dict | None = None) -> list[str]:
    done = subprocess.run(
        [*cmd, "--collect-only", "-q"], cwd=lanes.ROOT, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_lanes_collect_every_test_of_the_suite_once_and_the_dockerd_restart_only_alone(
    tmp_path,
):
    """What each lane's own pytest command collects, against the whole suite's: a test in two
    lanes would run twice (the dockerd restart beside the other lanes cuts them all)."""
    suite = collected([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(lanes.TESTS)])
    dirs = lanes.Dirs(tests=lanes.TESTS, results=tmp_path, run=tmp_path)
    of_lane = {
        name: collected(lane.cmd, lane.env)
        for index, (name, suites) in enumerate({**lanes.LANES, **lanes.ALONE}.items())
        if (lane := lanes.Lane(name, suites, index, dirs, [])).is_pytest
    }
    everywhere = Counter(test for tests in of_lane.values() for test in tests)
    assert {t: n for t, n in everywhere.items() if n > 1} == {}
    assert set(everywhere) == set(suite)
    restart = f"{lanes.TESTS.name}/{lanes.DOCKERD_RESTART}"
    assert of_lane["dockerd-restart"] == [restart]


def test_every_test_module_of_the_suite_is_in_one_lane():
    assert lanes.unassigned({**lanes.LANES, **lanes.ALONE}, lanes.TESTS) == []


def test_the_cuda_images_key_covers_the_stages_it_is_built_from_and_no_other():
    """The kept CUDA build is reused only while its key holds: the key must take in every stage
    the server image is built from or copies from (a change there rebuilds it), and no stage it
    does not use (a change to the smoke image must not cost a cold CUDA build)."""
    _, stages = harness.dockerfile_stages(harness.DOCKERFILE.read_text())
    used = set(harness.stages_of("server", stages, {"ENGINE_SOURCE": "local"}))
    assert {"engine-build", "engine-src-local", "toolchain", "runtime", "server"} <= used
    assert not used & {"python", "smoke", "model-init", "gateway", "engine-src-git"}
