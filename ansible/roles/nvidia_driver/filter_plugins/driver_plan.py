"""Filters of the nvidia_driver role: what apt's simulated install would put on the host."""

from __future__ import annotations

import re

# apt-get --simulate: "Inst NAME [OLD] (VERSION ORIGINS [ARCH])".
INST = re.compile(r"^Inst (\S+) (?:\[\S+\] )?\((\S+) (.*?)\)", re.MULTILINE)
# Ubuntu names the branch in the package: nvidia-headless-580-server, libnvidia-gl-580, ...
BRANCH = re.compile(r"-(\d{3})(?:-server|-open)?(?:-|$)")


def package_regex(patterns: list[str]) -> str:
    """apt's package-name patterns (exact names, or globs with `*`) as one Python regex for the
    same names, with or without an architecture (`libcuda1:i386`)."""
    names = "|".join(re.escape(pattern).replace(r"\*", ".*") for pattern in patterns)
    return rf"^(?:{names})(?::\w+)?$"


def driver_plan_conflicts(
    simulation: str,
    requested: list[str],
    driver_regex: str,
    not_driver_regex: str,
    branch: str,
    version: str,
) -> list[str]:
    """The driver packages apt would install off the pinned branch or version, as "NAME VERSION
    (ORIGIN)": a transitional package pulling another branch, or a requested or branch package
    at another version. The simulation asks for the requested names without a version, so apt
    picks its candidates as it would on this host, through the apt preferences."""
    off = []
    for name, candidate, origin in INST.findall(simulation):
        if not re.search(driver_regex, name) or re.search(not_driver_regex, name):
            continue
        named = BRANCH.search(name)
        at_version = candidate.split(":", 1)[-1].startswith(f"{version}-")
        other_branch = named is not None and named.group(1) != str(branch)
        pinned_here = named is not None or name.split(":")[0] in requested
        if other_branch or (pinned_here and not at_version):
            off.append(f"{name} {candidate} ({origin})")
    return off


class FilterModule:
    def filters(self):
        return {
            "nvidia_driver_plan_conflicts": driver_plan_conflicts,
            "nvidia_driver_package_regex": package_regex,
        }
