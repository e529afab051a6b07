#!/usr/bin/env python3
"""Layout checks for the lockstep workspace (run by `make lint`).

1. No cycle between the files of a crate: for every crate under CRATES_DIR, each .rs file under
   src/ (outside src/bin/) is a node; file A depends on file B when A's code names an item that
   B defines: a path `crate::…`, `super::…`, `self::…` or a child module's name, in a `use`
   declaration or inline. A name re-exported by a module file (`pub use x::Name;` in lib.rs or
   a mod.rs) resolves to the file that defines it, so `crate::Name` counts as a use of the
   defining file. `mod x;` declarations are not uses, and neither is a `pub use` re-export
   itself, unless the re-exported name is also used in the re-exporting file's code.
   `#[cfg(test)]` modules, comments and string literals are ignored. Every strongly connected
   set of two or more files is reported with one cycle through it; the check fails on any.
2. With `--max-lines DIR=N` (repeatable): no .rs file under DIR has more than N lines.

The analysis is textual (no macro expansion, no type inference): it over-approximates only
when a comment-free, string-free path names another file's item, so a reported cycle is a
real `use` of each file by the other.

Usage: check_layout.py CRATES_DIR [--skip-cycles CRATE]... [--max-lines DIR=N]...
Exit status: 0 when every check passes, 1 when one fails, 2 on bad usage.
"""

import argparse
import os
import re
import sys


def strip_code(src):
    """Returns `src` with comments, string and char literals replaced by spaces (lines kept)."""
    out = []
    i, n = 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append("\n" * src.count("\n", i, j))
            i = j
        elif re.match(r'b?r#*"', src[i : i + 40]) and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            m = re.match(r'b?r(#*)"', src[i:])
            end = '"' + m.group(1)
            j = src.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            out.append('""' + "\n" * src.count("\n", i, j))
            i = j + 1
        elif c == "'":
            m = re.match(r"'(?:\\(?:x[0-9a-fA-F]{2}|u\{[0-9a-fA-F]+\}|.)|[^\\'\n])'", src[i:])
            if m:
                out.append("' '")
                i += m.end()
            else:
                out.append(c)
                i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out)


def matching_brace(src, open_at):
    """Index just past the brace that closes the `{` at `open_at`."""
    depth = 0
    for j in range(open_at, len(src)):
        if src[j] == "{":
            depth += 1
        elif src[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(src)


def cut_test_modules(src):
    """Removes `#[cfg(test)] mod name { … }` blocks (test code is not part of the layout)."""
    while True:
        m = re.search(r"#\[cfg\(test\)\]\s*(?:#\[[^\]]*\]\s*)*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{", src)
        if not m:
            return src
        end = matching_brace(src, m.end() - 1)
        src = src[: m.start()] + "\n" * src.count("\n", m.start(), end) + src[end:]


def split_use_tree(tree):
    """Expands a use tree (`a::{b, c::{d as e}, f::*}`) into (path segments, alias) pairs."""
    tree = tree.strip()
    brace = tree.find("{")
    if brace < 0:
        m = re.match(r"^(.*?)\s+as\s+(\w+)$", tree)
        path, alias = (m.group(1), m.group(2)) if m else (tree, None)
        segs = [s for s in path.replace(" ", "").split("::") if s]
        return [(segs, alias)]
    prefix = [s for s in tree[:brace].replace(" ", "").split("::") if s]
    inner = tree[brace + 1 : tree.rfind("}")]
    parts, depth, cur = [], 0, ""
    for ch in inner:
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    result = []
    for part in parts:
        if part.strip():
            for segs, alias in split_use_tree(part):
                result.append((prefix + segs, alias))
    return result


ITEM_RE = r"(?:pub(?:\([^)]*\))?\s+)?(?:unsafe\s+|const\s+|async\s+|extern\s+\"\w*\"\s+)*(?:struct|enum|fn|trait|type|const|static|union|macro_rules!)\s+(\w+)"


class Crate:
    def __init__(self, src_dir):
        self.src_dir = src_dir
        self.files = {}  # module path (tuple) -> file
        for root, dirs, names in os.walk(src_dir):
            dirs[:] = sorted(d for d in dirs if not (root == src_dir and d == "bin"))
            for name in sorted(names):
                if name.endswith(".rs"):
                    path = os.path.join(root, name)
                    rel = os.path.relpath(path, src_dir)[:-3].split(os.sep)
                    if rel[-1] in ("mod", "lib", "main") and (rel[-1] == "mod" or len(rel) == 1):
                        rel = rel[:-1]
                    self.files[tuple(rel)] = path
        self.code = {}
        self.uses = {}  # module -> list of (segments, alias, is_pub)
        self.items = {}  # module -> set of names defined in the file (outside tests)
        self.children = {}  # module -> set of child module names declared with `mod x;`
        for mod, path in self.files.items():
            with open(path, encoding="utf-8") as f:
                code = cut_test_modules(strip_code(f.read()))
            uses = []
            for m in re.finditer(r"(?:^|[;{}\]\s])(pub(?:\([^)]*\))?\s+)?use\s+([^;]*);", code):
                for segs, alias in split_use_tree(m.group(2)):
                    uses.append((segs, alias, bool(m.group(1)), m.start(2), m.end(2)))
            self.uses[mod] = uses
            self.items[mod] = set(re.findall(ITEM_RE, code))
            self.children[mod] = set(re.findall(r"(?:^|\s)mod\s+(\w+)\s*;", code))
            # Code with the `use` declarations blanked out, for inline paths.
            body = list(code)
            for _, _, _, start, end in uses:
                for k in range(start, end):
                    if body[k] != "\n":
                        body[k] = " "
            self.code[mod] = "".join(body)

    def base(self, mod, first):
        """The module a path starting with `first` is relative to, seen from `mod`."""
        if first == "crate":
            return ()
        if first == "self":
            return mod
        if first == "super":
            return mod[:-1]
        return None

    def resolve(self, mod, segs, depth=0):
        """The file module that defines what `segs` (a path written in `mod`) names, or None."""
        if not segs or depth > 20:
            return None
        first = segs[0]
        if first in ("crate", "self", "super"):
            cur = self.base(mod, first)
            rest = segs[1:]
            while rest and rest[0] == "super":
                cur, rest = cur[:-1], rest[1:]
        elif first in self.children.get(mod, ()):
            cur, rest = mod, segs
        else:
            return None
        # Walk down through file modules as far as they go.
        while rest and cur + (rest[0],) in self.files:
            cur, rest = cur + (rest[0],), rest[1:]
        if not rest or rest[0] == "*":
            return cur
        name = rest[0]
        if cur not in self.files:
            return None
        if name in self.items.get(cur, ()):
            return cur
        # A name brought into `cur` by a `use` (a re-export or an inline module): follow it.
        for useg, alias, _, _, _ in self.uses.get(cur, ()):
            last = alias or (useg[-1] if useg else None)
            if last == name and useg and useg[-1] != "*":
                target = self.resolve(cur, useg, depth + 1)
                if target is not None:
                    return target
        for useg, _, _, _, _ in self.uses.get(cur, ()):
            if useg and useg[-1] == "*":
                target = self.resolve(cur, useg[:-1] + [name], depth + 1)
                if target is not None and target != cur:
                    return target
        return cur

    def edges(self):
        graph = {mod: set() for mod in self.files}
        for mod in self.files:
            code = self.code[mod]
            for segs, alias, is_pub, _, _ in self.uses[mod]:
                target = self.resolve(mod, segs)
                if target is None or target == mod:
                    continue
                if is_pub and segs[-1] != "*":
                    # A re-export is not a use unless the file's own code names it too.
                    name = alias or segs[-1]
                    if name == "self" or not re.search(r"\b%s\b" % re.escape(name), code):
                        continue
                graph[mod].add(target)
            for m in re.finditer(r"(?<![\w:])((?:crate|self|super|\w+)(?:\s*::\s*\w+)+)", code):
                segs = re.sub(r"\s", "", m.group(1)).split("::")
                target = self.resolve(mod, segs)
                if target is not None and target != mod:
                    graph[mod].add(target)
        return graph


def strongly_connected(graph):
    """Tarjan's algorithm: the strongly connected components with two or more nodes."""
    index, low, on_stack, stack, result = {}, {}, set(), [], []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                result.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return result


def one_cycle(graph, comp):
    """A shortest cycle through the first node of `comp`, staying inside `comp`."""
    start, members = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w in members and w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("crates_dir", help="the folder holding one folder per crate")
    parser.add_argument("--skip-cycles", action="append", default=[], metavar="CRATE",
                        help="a crate (folder name) whose files are not checked for cycles")
    parser.add_argument("--max-lines", action="append", default=[], metavar="DIR=N",
                        help="fail when a .rs file under DIR has more than N lines")
    args = parser.parse_args()
    if not os.path.isdir(args.crates_dir):
        parser.error(f"{args.crates_dir}: not a folder")
    failures = 0
    crates = sorted(d for d in os.listdir(args.crates_dir)
                    if os.path.isdir(os.path.join(args.crates_dir, d, "src")))
    for name in args.skip_cycles:
        if name not in crates:
            parser.error(f"--skip-cycles {name}: no crate folder {name} under {args.crates_dir}")
    for name in crates:
        if name in args.skip_cycles:
            print(f"check_layout: {name}: cycle check skipped (--skip-cycles)", file=sys.stderr)
            continue
        crate = Crate(os.path.join(args.crates_dir, name, "src"))
        graph = crate.edges()
        for comp in strongly_connected(graph):
            cycle = one_cycle(graph, comp)
            shown = " -> ".join(os.path.relpath(crate.files[m], crate.src_dir) for m in cycle)
            extra = ""
            if len(comp) > len(cycle) - 1:
                extra = " (files in this circle: %s)" % ", ".join(
                    os.path.relpath(crate.files[m], crate.src_dir) for m in comp)
            print(f"check_layout: {name}: files import each other: {shown}{extra}", flush=True)
            failures += 1
    for spec in args.max_lines:
        folder, sep, limit = spec.rpartition("=")
        if not sep or not limit.isdigit() or not os.path.isdir(folder):
            parser.error(f"--max-lines {spec}: expected DIR=N with DIR an existing folder")
        for root, _, names in os.walk(folder):
            for fname in sorted(names):
                if fname.endswith(".rs"):
                    path = os.path.join(root, fname)
                    with open(path, encoding="utf-8") as f:
                        lines = sum(1 for _ in f)
                    if lines > int(limit):
                        print(f"check_layout: {path}: {lines} lines, over the limit of {limit}", flush=True)
                        failures += 1
    if failures:
        print(f"check_layout: {failures} problem(s)", file=sys.stderr)
        return 1
    print("check_layout: ok", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
