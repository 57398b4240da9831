"""``treespec install-engine [NAME]``: build and install a target engine's binding here (default llama.cpp).

The engine declares its pip requirement and build environment (``install_recipe``: for llama.cpp,
llama-cpp-python built from source with native CPU kernels and nothing it does not use); the command
runs pip with them and says in one line what it did and how long it took.  An engine already
installed is left alone (``--force`` rebuilds it).  A failed build ends in one line with the tail of
pip's output and exit 1: the torch engine still runs everything.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from treespec import registry

    parser.add_argument("engine", nargs="?", default="llama.cpp", choices=registry.available("engine"),
                        help="the engine whose binding to build (default llama.cpp)")
    parser.add_argument("--force", action="store_true", help="rebuild even when it is installed")


def run(args: argparse.Namespace) -> int:
    from treespec import registry

    engine = registry.resolve("engine", args.engine)
    if engine.installed() and not args.force:
        print(f"treespec install-engine: {args.engine} is installed")
        return 0
    requirement, env = engine.install_recipe()
    cores = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    command = [sys.executable, "-m", "pip", "install", "--no-cache-dir", "--disable-pip-version-check", requirement]
    if args.force:  # the binding itself again; what it depends on stays as installed
        command[4:4] = ["--force-reinstall", "--no-deps"]
    print(f"treespec install-engine: building {requirement} from source for this CPU ({cores} cores; a few minutes)",
          file=sys.stderr)
    start = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": cores, **env},
                          capture_output=True, text=True, check=False)
    minutes = (time.perf_counter() - start) / 60
    if done.returncode != 0 or not _imports(args.engine):
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        print(f"treespec install-engine: building {requirement} failed after {minutes:.1f} min (pip exit "
              f"{done.returncode}): {tail}; the torch engine runs everything without it", file=sys.stderr)
        return 1
    print(f"treespec install-engine: {args.engine} built and installed in {minutes:.1f} min")
    return 0


def _imports(engine: str) -> bool:
    """Whether the freshly installed binding imports, in a new interpreter (this one cached the miss)."""
    code = f"from treespec import registry; raise SystemExit(0 if registry.resolve('engine', {engine!r}).installed() else 1)"
    return subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
