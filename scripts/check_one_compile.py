#!/usr/bin/env python3
"""Fails when `cargo test` would compile a library a second time (run by `make lint`).

`make test` builds the workspace once (`cargo build --release --workspace`) and then runs
`cargo test --release --workspace`. Cargo compiles a library again for the tests whenever the
test build switches on a feature the plain build did not (a dev-dependency that names
`features = [...]` of a workspace crate or of a registry crate): every crate above it is then
rebuilt with the other features, which cost 10 minutes of every CI run before this check.

This script asks Cargo for both builds' artifacts (`--message-format=json`; fresh units are
reported too, so after the first run it only links what changed) and compares the hashed file
names of the compiled libraries (the hash covers features, dependencies and profile). A library
of a package the release build has, compiled under another hash for the tests, is named with the
features of each build. Libraries the test build
adds (dev-dependencies such as tempfile or lockstep-testkit) are fine.

With `--package PKG` (repeatable) it also compares the build of that package alone
(`cargo build -p PKG`, as maturin builds the Python package's crate lockstep-py) with the
workspace build: cargo unifies features over the packages it builds, so a crate the other
members give more features would be compiled a second time, with everything above it.

Usage: python3 scripts/check_one_compile.py [--profile release] [--package PKG]   (from the repository root)
Side effect: the test binaries are compiled (`cargo test --no-run`), as `make test` needs anyway.
Exit 0: one compile; 1: a library would be compiled twice (listed); 2: cargo failed.
"""

import argparse
import json
import subprocess
import sys

LIB_KINDS = {"lib", "rlib", "dylib", "cdylib", "staticlib", "proc-macro"}


def library_artifacts(command):
    """Runs a cargo command with JSON messages; returns {hashed file name: (package, features)}.

    One library can be compiled twice in one build (for build scripts and proc-macros on the
    host, for the targets), so units are keyed by the hashed file name Cargo gives each
    compiled library (`deps/libNAME-HASH.rmeta`), not by the package.
    """
    proc = subprocess.run(
        command + ["--message-format=json-render-diagnostics"],
        stdout=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        print(f"check_one_compile: `{' '.join(command)}` failed (exit {proc.returncode})", file=sys.stderr)
        sys.exit(2)
    libraries = {}
    for line in proc.stdout.splitlines():
        if not line.startswith("{"):
            continue
        msg = json.loads(line)
        if msg.get("reason") != "compiler-artifact":
            continue
        target = msg["target"]
        if msg["profile"].get("test") or not LIB_KINDS.intersection(target["kind"]):
            continue
        hashed = [f for f in msg["filenames"] if "/deps/" in f and not f.endswith(".d")]
        for name in {f.rsplit("/", 1)[-1].rsplit(".", 1)[0] for f in hashed}:
            libraries[name] = (msg["package_id"], tuple(sorted(msg.get("features", []))))
    return libraries


def package_name(package_id):
    """`registry+https://...#serde@1.0.229` or `path+file:///x/crates/lockstep-core#0.1.0`."""
    tail = package_id.rsplit("#", 1)[-1]
    if "@" in tail:
        return tail.replace("@", " ")
    return package_id.rsplit("#", 1)[0].rsplit("/", 1)[-1] + " " + tail


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="release")
    parser.add_argument("--package", action="append", default=[])
    args = parser.parse_args()
    profile = ["--profile", args.profile]
    build = library_artifacts(["cargo", "build", "--workspace"] + profile)
    failed = False
    for pkg in args.package:
        alone = library_artifacts(["cargo", "build", "-p", pkg] + profile)
        built_packages = {package for package, _ in build.values()}
        twice = []
        for name, (package, features) in sorted(alone.items()):
            if name not in build and package in built_packages:
                others = sorted({f for n, (p, f) in build.items() if p == package})
                twice.append((package, name, others, features))
        if twice:
            failed = True
            print(
                f"check_one_compile: `cargo build -p {pkg}` compiles these libraries again with other "
                "features than the workspace build (give the package the features the other members "
                "switch on, as python/Cargo.toml does):",
                file=sys.stderr,
            )
            for package, name, built, tested in twice:
                print(
                    f"  {package_name(package)} ({name}): {pkg} build features {list(tested)}; "
                    f"workspace build features {[list(f) for f in built]}",
                    file=sys.stderr,
                )
        else:
            print(f"check_one_compile: ok, `cargo build -p {pkg}` reuses all its libraries of the workspace build")
    test = library_artifacts(["cargo", "test", "--workspace", "--no-run"] + profile)
    built_packages = {package for package, _ in build.values()}
    twice = []
    for name, (package, features) in sorted(test.items()):
        if name not in build and package in built_packages:
            others = sorted({f for n, (p, f) in build.items() if p == package})
            twice.append((package, name, others, features))
    if twice:
        print(
            "check_one_compile: `cargo test` compiles these libraries again with other features than "
            "`cargo build` (a dev-dependency switches a feature on; give test helpers a crate of their "
            "own, lockstep-testkit, instead of a feature):",
            file=sys.stderr,
        )
        for package, name, built, tested in twice:
            print(
                f"  {package_name(package)} ({name}): test build features {list(tested)}; "
                f"release build features {[list(f) for f in built]}",
                file=sys.stderr,
            )
        return 1
    if failed:
        return 1
    print(f"check_one_compile: ok, `cargo test` reuses all {len(build)} libraries of `cargo build`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
