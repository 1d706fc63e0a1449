"""`python -m bench [NAME] [OPTIONS]`: the project's benchmarks as one tool, one subcommand a module.

Without NAME (or with `side-by-side`) the side-by-side benchmark (bench/run.py: orchestrator against llama-server
and llama-cpp-python's server), so `python -m bench --quick` is what it always was. `python -m bench --list`
names every subcommand with its module's first docstring line; `python -m bench NAME --help` gives its options.
Results go to bench/results/<date>/ (bench/results/README.md is the index). A one-off investigation, once it
has answered its question, leaves bench/ and its results folder keeps the command and the commit to run it at.
"""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

# subcommand -> module under bench/ (its main(argv) -> exit status)
COMMANDS = {
    "side-by-side": "run",
    "cold": "cold",
    "w5": "w5",
    "w6": "w6",
    "slots": "slots",
    "memory": "memory",
    "prefix": "prefix",
    "cluster": "cluster",
    "soak": "soak",
    "speculative": "speculative",
    "trace": "trace",
    "trace-live": "trace_live",
    "layouts": "layouts",
    "spec-policy": "spec_policy",
}


def summary(module: str) -> str:
    """The first line of bench/<module>.py's docstring, read without importing it (the imports are heavy)."""
    source = (Path(__file__).resolve().parent / f"{module}.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--list"]:
        for name, module in COMMANDS.items():
            print(f"{name:14} {summary(module)}")
        return 0
    if argv[:1] and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(f"python -m bench: no subcommand {argv[0]!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    name, rest = (argv[0], argv[1:]) if argv[:1] and argv[0] in COMMANDS else ("side-by-side", argv)
    sys.argv = [f"python -m bench {name}", *rest]  # argparse's prog in usage lines
    return importlib.import_module(f"bench.{COMMANDS[name]}").main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
