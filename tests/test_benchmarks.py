"""Every script in benchmarks/ runs: its ``--help``, and its smallest real invocation.

The ``--help`` of every script runs in the default tier (one process imports them all in turn).  The
smallest real invocations (`SMALLEST`: the least sizes that still run every arm of the script on a real
model or the committed data) run in the slow tier, each in a process of its own; the ones that read the
embedded model need it converted (`treespec fetch-model`, which .ci/run does; skipped elsewhere).  A
script whose real run needs what no test machine has is named in `ELSEWHERE` with what it needs, and its
argument checks run instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.name for p in (ROOT / "benchmarks").glob("*.py"))
TRACE = "{tmp}/trace.safetensors"  # recorded once by bench_replay's tiny run, read by the trace scripts

# script -> the arguments of its smallest real invocation ({tmp}: the test's folder)
SMALLEST: dict[str, list[str]] = {
    "bench_batch.py": ["--sizes", "1", "2", "--methods", "ar", "ddtree@4", "--prompts", "2", "--max-new-tokens", "4",
                       "--dtype", "float32", "--threads", "1"],
    "bench_build.py": ["--vocabs", "49152", "--budgets", "16", "--rounds", "1", "--scorer-rounds", "1", "--nx-rounds",
                       "1", "--nx-seconds", "0.1", "--threads", "1"],
    "bench_build_batch.py": ["--sizes", "2", "--budgets", "16", "--rounds", "1", "--threads", "1"],
    "bench_controller.py": ["--seeds", "1"],
    "bench_distill.py": ["--prompts", "2", "--batch-size", "2", "--max-new-tokens", "4", "--threads", "1",
                         "--dtype", "float32"],
    "bench_expand.py": ["--sizes", "smollm2", "--top-m", "16", "--batch", "1", "--min-time", "0.01"],
    "bench_live_cost.py": ["--profiles", "1", "--prompts", "1", "--max-new-tokens", "4", "--threads", "1",
                           "--dtype", "float32"],
    "bench_order.py": ["--arms", "2", "--turns", "2", "--max-new-tokens", "2", "--threads", "1", "--on", "0.05",
                       "--off", "0.05", "--resamples", "20"],
    "bench_replay.py": ["--tiny", "--prompts", "2", "--max-new-tokens", "8", "--trace", TRACE],
    "bench_modelled_rules.py": [TRACE, "--methods", "ddtree@4", "--resamples", "20"],
    "compare_policies.py": ["--trace", TRACE, "--budgets", "4", "--out", "{tmp}/compared", "--doc",
                            "{tmp}/compared.md", "--resamples", "20"],
    "bench_tree_rules.py": ["table", str(ROOT / "docs" / "figures" / "rules" / "records.json")],
    "device_check.py": ["--cpu-dry-run", "--budgets", "16", "--rounds", "1", "--train-steps", "2",
                        "--decode-tokens", "4"],
    "engine_curve.py": ["--repeats", "1", "--no-torch"],
    "exact_cost.py": ["--repeats", "1", "--steps", "1", "--tokens", "4", "--threads", "1"],
    "exactness_table.py": ["--samples", "200"],
    "first_token_tv.py": ["--prompts", "1", "--samples", "4", "--repeats", "4", "--temperatures", "1.0",
                          "--datasets", "gsm8k", "--dtype", "float32"],
    "sampling_ab.py": ["--prompts", "1", "--tokens", "4", "--temperatures", "1.0", "--datasets", "gsm8k"],
}
# script -> what its real run needs that no test machine has (its argument checks run instead)
ELSEWHERE: dict[str, tuple[str, list[str]]] = {
    "check_published_dominotree.py": ("a clone of slin-zhq/Domino-Tree (no network but the package registries)",
                                      ["--published", "{tmp}/no-clone"]),
    "llama_cpp_peer.py": ("llama.cpp's llama-speculative-simple built from the vendored source (minutes of a "
                          "C++ build) and sentencepiece", ["--tokens", "0"]),
    "bench_training.py": ("distill-data and a teacher cache of the embedded target (an hour of one core)",
                          ["--data", "{tmp}/no-data", "--cache", "{tmp}/no-cache"]),
    "sweep_drafters.py": ("teacher caches of the embedded target and CPU-minutes per arm",
                          ["--teacher", "{tmp}/no-cache", "--heldout", "{tmp}/no-cache"]),
}


def test_every_script_is_named_in_one_list():
    assert sorted([*SMALLEST, *ELSEWHERE]) == SCRIPTS


def test_every_scripts_help_runs():
    """One process: each script's ``--help`` through its own argument parser (exit 0, usage printed)."""
    code = ("import runpy, sys\n"
            "failed = []\n"
            "for path in sys.argv[1:]:\n"
            "    sys.argv, sys.path[0] = [path, '--help'], path.rsplit('/', 1)[0]  # as `python SCRIPT` sets them\n"
            "    try:\n"
            "        runpy.run_path(path, run_name='__main__')\n"
            "        failed.append((path, 'no exit'))\n"
            "    except SystemExit as done:\n"
            "        if done.code not in (0, None):\n"
            "            failed.append((path, done.code))\n"
            "print('FAILED', failed)\n")
    done = subprocess.run([sys.executable, "-c", code, *(str(ROOT / "benchmarks" / s) for s in SCRIPTS)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert "FAILED []" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("usage:") == len(SCRIPTS)


def _embedded() -> bool:
    from treespec.apps.assembly.embedded import SMOLLM2_135M_INSTRUCT, cache_root, is_converted

    return is_converted(cache_root() / SMOLLM2_135M_INSTRUCT.dirname, SMOLLM2_135M_INSTRUCT)


def _run(script: str, args: list[str], tmp: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    filled = [a.replace("{tmp}", str(tmp)) for a in args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TREESPEC_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *filled], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp, env=env)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """The folder the trace scripts share, the trace recorded once by bench_replay's tiny run."""
    import shutil

    tmp = tmp_path_factory.mktemp("benchmarks")
    shutil.copy(ROOT / "docs" / "policies-compared.md", tmp / "compared.md")  # the page compare_policies rewrites
    done = _run("bench_replay.py", SMALLEST["bench_replay.py"], tmp)
    assert done.returncode == 0, done.stderr[-3000:]
    return tmp


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_every_scripts_smallest_real_invocation_runs(script, shared):
    tiny = script in ("bench_replay.py", "bench_modelled_rules.py", "compare_policies.py", "bench_tree_rules.py",
                      "bench_controller.py", "exactness_table.py", "bench_build.py", "bench_build_batch.py",
                      "bench_expand.py", "device_check.py")
    if not tiny and not _embedded() and not os.environ.get("CI"):
        pytest.skip("the embedded model is not converted here (`treespec fetch-model`)")
    done = _run(script, SMALLEST[script], shared)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    assert done.stdout.strip(), "printed nothing"


@pytest.mark.parametrize("script", sorted(ELSEWHERE))
def test_scripts_that_need_more_than_a_test_machine_check_their_arguments_in_one_line(script, tmp_path):
    needs, args = ELSEWHERE[script]
    done = _run(script, args, tmp_path, timeout=300)
    assert done.returncode != 0 and "Traceback" not in done.stderr, (needs, done.stderr[-2000:])
