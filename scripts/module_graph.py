#!/usr/bin/env python3
"""The house plan of a ttrace source tree (docs/architecture.md): rooms (top-level modules of
src/) and the arrows between them, their floors, a transitively reduced picture (mermaid), and
at file level the import cycles and the arrows from the checker/reader side to the simulator
side.

    python3 scripts/module_graph.py [SRC]        # SRC defaults to ./src

An arrow is a `crate::` path in library code (comments, `#[cfg(test)]` modules and test files
left out; a face's re-exports of its own children are not arrows). `tests/lint.rs` checks the
two rules inside `cargo test`; this script draws the plan and counts.
"""
import collections
import glob
import os
import re
import sys

JUDGE = ('trace/', 'io/', 'check/', 'bounds/', 'verdict/')
LAB = ('engine/model.rs', 'shard/', 'bugs.rs', 'validate/')


def clean(s):
    i = s.find('#[cfg(test)]\nmod ')
    if i >= 0:
        s = s[:i]
    return '\n'.join(l for l in s.split('\n') if not l.lstrip().startswith('//'))


def sources(root):
    out = {}
    for p in glob.glob(root + '/**/*.rs', recursive=True):
        # The binary, test files and the crate's face (lib.rs: declarations and re-exports).
        if '/bin/' in p or p.endswith('/tests.rs') or os.path.relpath(p, root) == 'lib.rs':
            continue
        s = open(p).read()
        if s.lstrip().startswith('#![cfg(test)]'):
            continue
        out[p] = clean(s)
    return out


def room(root, path):
    parts = os.path.relpath(path, root).split('/')
    return parts[0][:-3] if len(parts) == 1 else parts[0]


def exists(root, name):
    return os.path.exists(f'{root}/{name}.rs') or os.path.isdir(f'{root}/{name}')


def room_arrows(root, texts):
    edges = collections.defaultdict(set)
    for p, s in texts.items():
        r = room(root, p)
        names = re.findall(r'crate::(\w+)', s)
        for m in re.finditer(r'crate::\{([^;]*?)\};', s, re.S):
            names += re.findall(r'(?:^|[,{\s])(\w+)(?:::|\s*[,}]|\s*$)', m.group(1))
        for t in names:
            t = 'error' if t in ('Result', 'Error', 'IoError') else t
            if exists(root, t) and t != r:
                edges[r].add(t)
        edges[r]
    return edges


def modfile(root, parts):
    base = os.path.join(root, *parts)
    for c in (base + '.rs', os.path.join(base, 'mod.rs')):
        if os.path.exists(c):
            return c
    return os.path.join(root, 'lib.rs') if not parts else None


def modparts(root, path):
    rel = os.path.relpath(path, root)[:-3].split('/')
    return rel[:-1] if rel[-1] in ('mod', 'lib') else rel


def file_arrows(root, texts):
    def resolve(parts):
        best, at = None, 0
        for i in range(len(parts) + 1):
            f = modfile(root, parts[:i])
            if not f:
                break
            best, at = f, i
        rest = parts[at:]
        if best and rest:
            for m in re.finditer(r'pub use (\w+)::\{?([^;]*)\}?;', texts.get(best, '')):
                if re.search(r'\b' + re.escape(rest[0]) + r'\b', m.group(2)):
                    f = modfile(root, modparts(root, best) + [m.group(1)])
                    if f:
                        return f
        return best

    edges = {}
    for p, s in texts.items():
        me = modparts(root, p)
        children = set(re.findall(r'^\s*(?:pub(?:\([^)]*\))?\s+)?mod (\w+);', s, re.M)) or {'#'}
        body = '\n'.join(l for l in s.split('\n')
                         if not re.match(r'\s*pub(\([^)]*\))? use (' + '|'.join(children) + r')::', l))
        for m in re.finditer(r'(crate|super)::((?:\w+::)*)\{([^;]*?)\}', body, re.S):
            head = [m.group(1)] + [x for x in m.group(2).split('::') if x]
            for item in re.split(r',(?![^{]*\})', m.group(3)):
                segs = [x for x in item.strip().split('{')[0].split('::') if x and x != '*']
                if segs:
                    body += '\n' + '::'.join(head + segs) + ';'
        out = set()
        for m in re.finditer(r'\b(crate|super)((?:::\w+)+)', body):
            segs = [x for x in m.group(2).split('::') if x]
            parts = segs if m.group(1) == 'crate' else me[:-1] + segs
            f = resolve(parts)
            if f and f != p:
                out.add(f)
        edges[p] = out
    return edges


def sccs(g):
    idx, low, st, on, out, c = {}, {}, [], set(), [], [0]
    sys.setrecursionlimit(10000)

    def sc(v):
        idx[v] = low[v] = c[0]
        c[0] += 1
        st.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in idx:
                sc(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], idx[w])
        if low[v] == idx[v]:
            comp = []
            while True:
                w = st.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            out.append(sorted(comp))

    for v in list(g):
        if v not in idx:
            sc(v)
    return out


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else 'src'
    texts = sources(root)
    rooms = room_arrows(root, texts)
    print(f'rooms {len(rooms)}, arrows between rooms {sum(len(v) for v in rooms.values())}')
    for r in sorted(rooms):
        print(f'  {r:9} -> {", ".join(sorted(rooms[r]))}')
    files = file_arrows(root, texts)
    print(f'files {len(files)}, arrows between files {sum(len(v) for v in files.values())}')
    cyc = [c for c in sccs(files) if len(c) > 1]
    print(f'file cycles: {len(cyc)}')
    for c in cyc:
        print('  ', ' <-> '.join(os.path.relpath(f, root) for f in c))
    rel = lambda f: os.path.relpath(f, root)
    bad = sorted((rel(a), rel(b)) for a, bs in files.items() for b in bs
                 if rel(a).startswith(JUDGE) and rel(b).startswith(LAB))
    print(f'checker/reader side -> simulator side (file arrows): {len(bad)}')
    for a, b in bad:
        print(f'   {a} -> {b}')
    # Floors: rooms in one cycle are one node; error and format share a floor (the format
    # names sit below error.rs, the arithmetic above it).
    name = {}
    for comp in sccs(rooms):
        for r in comp:
            name[r] = '+'.join(comp)
    g = collections.defaultdict(set)
    for a, bs in rooms.items():
        g[name[a]]
        for b in bs:
            if name[a] != name[b]:
                g[name[a]].add(name[b])
    floor = {}

    def fl(r):
        if r not in floor:
            floor[r] = 1 + max((fl(b) for b in g[r]), default=0)
        return floor[r]

    for r in list(g):
        fl(r)
    print(f'floors {max(floor.values())} (top first)')
    for f in sorted(set(floor.values()), reverse=True):
        print(f'  {f}: {" ".join(sorted(r for r in floor if floor[r] == f))}')

    def reach(a, b, skip):
        st, seen = [x for x in g[a] if (a, x) != skip], set()
        while st:
            x = st.pop()
            if x == b:
                return True
            if x not in seen:
                seen.add(x)
                st.extend(g[x])
        return False

    print('flowchart BT')
    for a in sorted(g):
        for b in sorted(g[a]):
            if not reach(a, b, (a, b)):
                print(f'  {a.replace("+", "_")} --> {b.replace("+", "_")}')


if __name__ == '__main__':
    main()
