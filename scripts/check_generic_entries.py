#!/usr/bin/env python3
"""The programs reach burn's backends through non-generic entries only (run by `make lint`).

Release builds do not share generic instantiations between crates: a generic function is
compiled again, with all it calls, in every crate that instantiates it. lockstep-npe compiles
its network on every backend once (`DeviceModel`, `Trained`, `sampling::draw`,
`DeviceModel::step_phases`); a program that names a backend type itself (`NpeModel<...>`,
`NpeModel::<...>`, a `TrainBackend` bound, `CpuAutodiff`, `WgpuAutodiff`, `Params::<...>`)
compiles burn's and CubeCL's generics again: lockstep-cli and the Python extension took 4-5
minutes each of `make test` that way. This check fails naming the file and line.

Usage: check_generic_entries.py DIR... (the programs' source folders)
Exit status: 0 when no file names a backend type, 1 when one does, 2 on bad usage.
"""

import os
import re
import sys

# Names whose use in a program instantiates lockstep-npe's generics on a backend.
BACKEND_NAMES = re.compile(
    r"\bNpeModel\s*(::)?\s*<|\bTrainBackend\b|\bCpuAutodiff\b|\bWgpuAutodiff\b|\bCudaAutodiff\b|\bParams\s*::\s*<"
)


def code_lines(path):
    """(line number, text) of `path`'s lines, without `//` comments (doc comments included)."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            yield number, line.split("//", 1)[0]


def main():
    if len(sys.argv) < 2 or any(a.startswith("-") for a in sys.argv[1:]):
        print("usage: check_generic_entries.py DIR... (the programs' source folders)", file=sys.stderr)
        return 2
    found = []
    for top in sys.argv[1:]:
        if not os.path.isdir(top):
            print(f"check_generic_entries: {top}: no such folder", file=sys.stderr)
            return 2
        for root, _, files in os.walk(top):
            for name in sorted(files):
                if not name.endswith(".rs"):
                    continue
                path = os.path.join(root, name)
                for number, code in code_lines(path):
                    m = BACKEND_NAMES.search(code)
                    if m:
                        found.append(f"{path}:{number}: names `{m.group(0).strip()}`")
    if found:
        print("check_generic_entries: these lines instantiate lockstep-npe's generics on a burn backend in a program, which then compiles them again; call DeviceModel / Trained / lockstep_npe's non-generic functions instead:", file=sys.stderr)
        for line in found:
            print("  " + line, file=sys.stderr)
        return 1
    print(f"check_generic_entries: ok, {', '.join(sys.argv[1:])} name no backend type")
    return 0


if __name__ == "__main__":
    sys.exit(main())
