#!/usr/bin/env python3
"""Which small changes to a module do its tests miss? A test that cannot fail is a defect; this finds the places.

One mutation at a time (a comparison flipped, + for -, `and` for `or`, an integer constant plus one, a `not`
dropped), inside the module's functions, a seeded sample of them: the module is rewritten with the mutation, the
given tests run (`pytest -x`), and a mutation under which they all still pass is listed as a survivor. The module is
restored afterwards, also on Ctrl-C. A survivor is a place to look, not a verdict: some mutations change nothing
(e.g. `reshape(..., -2)` is `-1` to numpy). `kill` (SIGTERM) restores the module too: a probe started in the
background with `&` ignores SIGINT. Run it in a clone when other work uses the tree:

    python scripts/mutation_probe.py python/sglang_h20/eplb/migration_plan.py --mutants 40 \\
        -- test/cpu/test_eplb_migration_plan.py
"""
from __future__ import annotations

import argparse
import ast
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

COMPARE_SWAPS = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                 ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
BINOP_SWAPS = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult, ast.Div: ast.Mult}


def mutation_sites(tree: ast.Module) -> list[tuple[str, ast.AST, int]]:
    """(kind, node, operator index) of every mutable place inside a function, in ast.walk order (stable for one
    source, so an index names the same place in a fresh parse)."""
    in_functions = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for n in ast.walk(f)}
    sites = []
    for node in ast.walk(tree):
        if id(node) not in in_functions:
            continue
        if isinstance(node, ast.Compare):
            sites += [("compare", node, i) for i, op in enumerate(node.ops) if type(op) in COMPARE_SWAPS]
        elif isinstance(node, ast.BinOp) and type(node.op) in BINOP_SWAPS:
            sites.append(("binop", node, 0))
        elif isinstance(node, ast.BoolOp):
            sites.append(("boolop", node, 0))
        elif isinstance(node, ast.Constant) and type(node.value) is int:
            sites.append(("int", node, 0))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            sites.append(("not", node, 0))
    return sites


def mutate(source: str, index: int) -> tuple[str, int]:
    """The source with mutation site `index` applied, and the site's line in the original."""
    tree = ast.parse(source)
    kind, node, i = mutation_sites(tree)[index]
    line = node.lineno
    if kind == "compare":
        node.ops[i] = COMPARE_SWAPS[type(node.ops[i])]()
    elif kind == "binop":
        node.op = BINOP_SWAPS[type(node.op)]()
    elif kind == "boolop":
        node.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
    elif kind == "int":
        node.value += 1
    else:  # drop the `not`: its parent takes the operand
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if value is node:
                    setattr(parent, field, node.operand)
                elif isinstance(value, list):
                    value[:] = [node.operand if v is node else v for v in value]
    return ast.unparse(tree), line


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("module", type=Path, help="the Python file to mutate (restored afterwards)")
    ap.add_argument("tests", nargs="+", help="pytest arguments after --: the tests that should catch the mutations")
    ap.add_argument("--mutants", type=int, default=30, help="how many sites to try, sampled (default 30)")
    ap.add_argument("--seed", type=int, default=1, help="sampling seed (default 1)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per test run (default 600)")
    a = ap.parse_args(argv)
    if not a.module.is_file() or a.module.suffix != ".py":
        ap.error(f"{a.module}: not a Python file")
    source = a.module.read_text()
    sites = mutation_sites(ast.parse(source))
    chosen = sorted(random.Random(a.seed).sample(range(len(sites)), min(a.mutants, len(sites))))
    lines = source.splitlines()
    survivors = 0
    print(f"{a.module}: {len(sites)} sites, trying {len(chosen)}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwinds through the restore below
    try:
        for n, index in enumerate(chosen, 1):
            mutated, line = mutate(source, index)
            a.module.write_text(mutated)
            t0 = time.time()
            try:
                r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *a.tests],
                                   capture_output=True, text=True, timeout=a.timeout)
                caught = r.returncode != 0
            except subprocess.TimeoutExpired:
                caught = True  # a mutation that hangs the tests is noticed
            survivors += not caught
            print(f"[{n}/{len(chosen)}] {'caught  ' if caught else 'SURVIVED'} {sites[index][0]:7} line {line} "
                  f"({time.time() - t0:.0f} s): {lines[line - 1].strip()[:100]}", flush=True)
    finally:
        a.module.write_text(source)
    print(f"{survivors} of {len(chosen)} mutations survived")
    return 1 if survivors else 0


if __name__ == "__main__":
    sys.exit(main())
