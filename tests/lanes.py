#!/usr/bin/env python3
"""`make test`: the suite in lanes side by side, then the suites that need the machine alone.

The suite mostly waits (health checks, apt in Molecule hosts, timeouts), so independent suites run
at once, each lane its own pytest process with its own Compose projects, block of host ports
(harness.free_port), temp and state directories; they share only the release images (built once,
under a lock) and the Molecule hosts' images bundle. Lanes never see an operator's deployment:
their images carry a tag of their own (harness.SESSION_REVISION). The chaos suite restarts dockerd,
so it runs after the lanes, alone.

Each lane's output goes to test-results/lanes/<lane>.log (and a JUnit file); this prints a line per
lane as it ends, a failing lane's failures in full, the slowest tests, and writes
test-results/run.json. Figures go to test-results/docs/; `make docs-figures` copies them into
docs/ from a green run of every lane. What the run built is removed at the end.

Usage: python3 tests/lanes.py [run] [--lanes a,b] [-- pytest args]   run the lanes
       python3 tests/lanes.py publish                              figures of a green run -> docs/
       python3 tests/lanes.py list                                 the lanes and their suites
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
sys.path.insert(0, str(ROOT))

import harness  # noqa: E402  (the tests' revision, fixed as the run starts)

from ternary_serve import config  # noqa: E402

RESULTS = ROOT / "test-results"
# Side by side. A lane is a command, or pytest arguments: test modules (run in one pytest process,
# in this order), a test's node id, or --deselect=<node id>. Balanced by the durations of warm runs
# (docs/testing.md); the longest lane sets the run's time, so a lane that grows past the others is
# split.
DOCKERD_RESTART = "test_chaos.py::test_dockerd_restart_the_stack_comes_back_on_its_own"
LANES: dict[str, list[str]] = {
    "lint": ["make", "--no-print-directory", "lint"],
    "molecule": ["test_ansible.py"],
    "fleet": ["test_fleet.py", "test_bench.py"],
    "release": ["test_release.py"],
    "serving": ["test_serving.py"],
    "stack": ["test_stack.py", "test_endpoint.py", "test_convert.py", "test_constraints.py",
              "test_liveness.py", "test_ubuntu_standin.py", "test_cuda_image.py"],
    "chaos": ["test_chaos.py", f"--deselect={DOCKERD_RESTART}"],
    "unit": ["test_config.py", "test_fetch.py", "test_plan.py", "test_synthetic.py",
             "test_smoke.py", "test_versions.py", "test_weights.py", "test_role_answers.py",
             "test_lanes.py", "test_docker_down.py"],
}  # fmt: skip
# After the lanes, one at a time: restarting dockerd would cut every other lane.
ALONE: dict[str, list[str]] = {"dockerd-restart": [DOCKERD_RESTART]}
PROGRESS_EVERY_S = 120
SLOWEST = 15


def say(msg: str) -> None:
    print(f"[lanes] {msg}", flush=True)


def cpu_seconds() -> tuple[float, float]:
    """The machine's CPU time so far, busy and in all (/proc/stat, every core): what a run used
    of what it had, which bounds how much more a lane or a cold build can take."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    ticks = os.sysconf("SC_CLK_TCK")
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields) - idle) / ticks, sum(fields) / ticks


def minutes(seconds: float) -> str:
    return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"


def module_of(entry: str) -> str:
    return entry.removeprefix("--deselect=").split("::")[0]


def unassigned(lanes: dict[str, list[str]], tests: Path) -> list[str]:
    """Test modules in no lane (they would silently never run), or whole in two (they would run
    twice); a module split by node ids and --deselect may appear in several."""
    entries = [e for lane in lanes.values() if is_pytest(lane) for e in lane]
    whole = [e for e in entries if e.endswith(".py")]
    split = {module_of(e) for e in entries if "::" in e}
    found = sorted(p.name for p in tests.glob("test_*.py"))
    twice = sorted({m for m in whole if whole.count(m) > 1})
    return (
        [m for m in found if m not in whole and m not in split]
        + [f"{m} (twice)" for m in twice]
        + [f"{m} (no such file)" for m in sorted({*whole, *split}) if m not in found]
    )


def is_pytest(lane: list[str]) -> bool:
    return module_of(lane[0]).startswith("test_")


def pytest_arg(entry: str, tests: Path) -> str:
    """A module or node id as a path; a --deselect as a node id relative to the rootdir (the lane
    sets it to the tests' parent), which is all pytest matches it against: an absolute path
    deselects nothing."""
    if entry.startswith("--deselect="):
        return f"--deselect={tests.name}/{entry.removeprefix('--deselect=')}"
    return str(tests / entry)


@dataclass
class Dirs:
    tests: Path  # the test modules
    results: Path  # logs, JUnit files, figures, run.json (emptied at the start)
    run: Path  # what the lanes share for the run (removed at the end)


class Lane:
    def __init__(self, name: str, suites: list[str], index: int, dirs: Dirs, extra: list[str]):
        self.name, self.suites, self.index = name, suites, index
        self.log = dirs.results / "lanes" / f"{name}.log"
        self.junit = dirs.results / "lanes" / f"{name}.xml"
        self.is_pytest = is_pytest(suites)
        run_dir = dirs.run
        if self.is_pytest:
            self.cmd = [
                sys.executable, "-m", "pytest", *(pytest_arg(s, dirs.tests) for s in suites), "-ra",
                f"--rootdir={dirs.tests.parent}", "-p", "no:cacheprovider",
                f"--junitxml={self.junit}", f"--basetemp={run_dir / name}", *extra,
            ]  # fmt: skip
        else:
            self.cmd = suites
        self.env = {
            **os.environ,
            "TS_TEST_LANE": name,
            "TS_TEST_LANE_INDEX": str(index),
            "TS_TEST_RUN_DIR": str(run_dir),
            "TS_TEST_RESULTS_DIR": str(dirs.results),
        }
        self.proc: subprocess.Popen | None = None
        self.started = self.seconds = 0.0
        # CPU of the lane's processes and everything they waited for (pytest, ansible, compose,
        # the docker CLI); not its containers', which run under dockerd.
        self.cpu_s = 0.0

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.started = time.monotonic()
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                self.cmd, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )  # fmt: skip

    def poll(self) -> int | None:
        if self.proc.returncode is None:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.proc.returncode = os.waitstatus_to_exitcode(status)
                self.seconds = time.monotonic() - self.started
                self.cpu_s = usage.ru_utime + usage.ru_stime
        return self.proc.returncode

    def cases(self) -> list[dict]:
        """Every test the lane ran, from its JUnit file: name, seconds, outcome."""
        if not self.junit.is_file():
            return []
        found = []
        for case in ET.parse(self.junit).iter("testcase"):
            outcome = "passed"
            for child in case:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed"}.get(child.tag, child.tag)
                    break
            found.append(
                {
                    "lane": self.name,
                    "test": f"{case.get('classname')}::{case.get('name')}",
                    "seconds": float(case.get("time") or 0),
                    "outcome": outcome,
                }
            )
        return found

    def summary(self) -> str:
        state = "passed" if self.proc.returncode == 0 else f"FAILED (exit {self.proc.returncode})"
        counts = {}
        for case in self.cases():
            counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
        tally = ", ".join(f"{n} {what}" for what, n in sorted(counts.items())) or "no tests"
        if not self.is_pytest:
            tally = " ".join(self.cmd)
        cpu = f"cpu {minutes(self.cpu_s)}"
        return f"lane {self.name:<9} {state:<16} {minutes(self.seconds):>7} {cpu:>11}  {tally}"

    def failures(self) -> str:
        """The failing part of the lane's output, in full (pytest's FAILURES and ERRORS sections
        and its summary; the whole log of a lane that is not pytest or never got that far)."""
        text = self.log.read_text(errors="replace")
        start = re.search(r"^=+ (FAILURES|ERRORS) =+$", text, re.MULTILINE)
        return text[start.start() :] if start else text[-20000:]


def run_lanes(lanes: list[Lane]) -> None:
    for lane in lanes:
        lane.start()
    logs = lanes[0].log.parent
    say(f"running side by side: {', '.join(lane.name for lane in lanes)} (logs: {logs})")
    running, last_progress = list(lanes), time.monotonic()
    while running:
        time.sleep(2)
        for lane in list(running):
            if lane.poll() is not None:
                running.remove(lane)
                report(lane)
        if running and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
            now = last_progress = time.monotonic()
            ages = [f"{x.name} ({minutes(now - x.started)})" for x in running]
            say(f"still running: {', '.join(ages)}")


def report(lane: Lane) -> None:
    print(lane.summary(), flush=True)
    if lane.proc.returncode != 0:
        print(f"----- lane {lane.name}: what failed ({lane.log}) -----", flush=True)
        print(lane.failures().rstrip(), flush=True)
        print(f"----- end of lane {lane.name} -----", flush=True)


def remove_what_the_run_built() -> None:
    """The run's images: every tag under the tests' own revision and every tag of the projects the
    suite builds under, but the kept CUDA build; their untagged layers. Nothing of an operator's.
    A rerun finds the layer cache, not gigabytes of images."""
    import docker
    import docker.errors

    engine = docker.from_env()
    marker = f"-{harness.SESSION_REVISION}-"
    removed = 0
    for image in engine.images.list():
        project = (image.labels or {}).get("com.docker.compose.project", "")
        for name in image.tags:
            ours = marker in name or project in harness.IMAGE_PROJECTS
            if ours and not name.startswith(f"{harness.CUDA_KEPT_REPO}:"):
                with contextlib.suppress(docker.errors.APIError):
                    engine.images.remove(name)
                    removed += 1
    for project in harness.IMAGE_PROJECTS:
        with contextlib.suppress(docker.errors.APIError):
            engine.images.prune(
                filters={"dangling": True, "label": f"com.docker.compose.project={project}"}
            )
    df = engine.df()
    images = sum(i.get("Size", 0) for i in df.get("Images", [])) / 2**30
    cache = sum(c.get("Size", 0) for c in df.get("BuildCache") or []) / 2**30
    say(f"removed {removed} test image tags; Docker now holds {images:.1f} GiB of images and "
        f"{cache:.1f} GiB of build cache")  # fmt: skip


def run(
    args: argparse.Namespace,
    side_by_side: dict[str, list[str]] = LANES,
    alone: dict[str, list[str]] = ALONE,
    tests: Path = TESTS,
    results: Path = RESULTS,
) -> int:
    every = {**side_by_side, **alone}
    problems = unassigned(every, tests)
    if problems:
        say(f"every test module goes in exactly one lane (tests/lanes.py): {', '.join(problems)}")
        return 2
    chosen = args.lanes.split(",") if args.lanes else list(every)
    unknown = [name for name in chosen if name not in every]
    if unknown:
        say(f"unknown lane {', '.join(unknown)}: the lanes are {', '.join(every)}")
        return 2
    shutil.rmtree(results, ignore_errors=True)
    results.mkdir(parents=True)
    dirs = Dirs(tests, results, Path(tempfile.mkdtemp(prefix="ternary-serve-tests-")))
    started, cpu_before = time.monotonic(), cpu_seconds()
    lanes = {
        name: Lane(name, suites, index, dirs, args.pytest_args)
        for index, (name, suites) in enumerate(every.items())
        if name in chosen
    }
    try:
        run_lanes([lane for name, lane in lanes.items() if name in side_by_side])
        for name in alone:
            if name in lanes:
                say(f"alone: {name}")
                run_lanes([lanes[name]])
    finally:
        for lane in lanes.values():
            if lane.proc and lane.proc.poll() is None:
                lane.proc.kill()
                lane.proc.wait()
        if tests == TESTS:
            with contextlib.suppress(Exception):  # Docker down is the lanes' failure, told there
                remove_what_the_run_built()
        shutil.rmtree(dirs.run, ignore_errors=True)
    wall = time.monotonic() - started
    busy, total = (now - then for now, then in zip(cpu_seconds(), cpu_before, strict=True))
    cases = [case for lane in lanes.values() for case in lane.cases()]
    failed = [lane.name for lane in lanes.values() if lane.proc.returncode != 0]
    for lane in lanes.values():  # which CUDA build was tested (conftest's end-of-session lines)
        for line in lane.log.read_text(errors="replace").splitlines():
            if line.startswith("CUDA server image"):
                say(line)
    print(f"\nslowest {SLOWEST} tests:")
    for case in sorted(cases, key=lambda c: -c["seconds"])[:SLOWEST]:
        print(f"  {minutes(case['seconds']):>7}  [{case['lane']}] {case['test']}")
    print()
    for lane in lanes.values():
        print(lane.summary())
    outcome = f"FAILED in lanes {', '.join(failed)}" if failed else "passed"
    say(f"CPU: {busy:.0f} of {total:.0f} core-seconds busy ({100 * busy / max(total, 1):.0f}%)")
    say(f"{len(cases)} tests in {len(lanes)} lanes, {minutes(wall)}: {outcome}")
    record = {
        "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "revision": config.project_revision(),
        "passed": not failed,
        "complete": set(lanes) == set(every) and not args.pytest_args,
        "wall_s": round(wall),
        "cpu_busy_s": round(busy),
        "cpu_total_s": round(total),
        "machine": f"{os.cpu_count()} CPUs",
        "lanes": {
            lane.name: {
                "exit": lane.proc.returncode,
                "seconds": round(lane.seconds),
                "host_cpu_s": round(lane.cpu_s, 1),
            }
            for lane in lanes.values()
        },
        "tests": cases,
    }
    (results / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    return 1 if failed else 0


def publish(_: argparse.Namespace) -> int:
    """test-results/docs/ -> docs/, only from a complete green run of this very checkout."""
    try:
        record = json.loads((RESULTS / "run.json").read_text())
    except (OSError, ValueError):
        say("no finished run in test-results/: run `make test` first")
        return 2
    revision = config.project_revision()
    if not (record["passed"] and record["complete"]):
        say("the last run was not a green run of every lane: its figures stay in test-results/")
        return 2
    if record["revision"] != revision or revision.endswith("-dirty"):
        say(f"the last run tested {record['revision']}, this checkout is {revision}: run "
            "`make test` on a committed checkout first")  # fmt: skip
        return 2
    figures = RESULTS / "docs"
    for source in sorted(figures.rglob("*")):
        if source.is_file():
            dest = ROOT / "docs" / source.relative_to(figures)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
            say(f"{dest.relative_to(ROOT)} (run of {record['revision']}, {record['when']})")
    return 0


def show(_: argparse.Namespace) -> int:
    for name, suites in [*LANES.items(), *ALONE.items()]:
        print(f"{name:<9} {'alone, after the lanes: ' if name in ALONE else ''}{' '.join(suites)}")
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", nargs="?", default="run", choices=["run", "publish", "list"])
    parser.add_argument("--lanes", help="only these lanes (comma-separated)")
    own, pytest_args = (
        (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    )
    args = parser.parse_args(own)
    args.pytest_args = pytest_args
    return {"run": run, "publish": publish, "list": show}[args.action](args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
