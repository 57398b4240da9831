"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""

from treespec.registry import DEFAULT_ENGINE
from treespec.target import DTYPE_NAMES

# name -> (module, one-line help).  Modules are imported lazily so ``treespec --help`` stays fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("treespec.apps.commands.demo", "every published method on the embedded SmolLM2 default, checked against AR"),
    "example": ("treespec.apps.commands.example", "a small end-to-end example on a tiny random model"),
    "draw": ("treespec.apps.commands.draw", "render a draft tree as SVG/PNG, DOT or Mermaid"),
    "list": ("treespec.apps.commands.listing", "list the registry's names: policies, drafters, verifiers, scorers, recipes, commands"),
    "generate": ("treespec.apps.commands.generate", "generate text from a local model, optionally speculatively"),
    "fetch-model": ("treespec.apps.commands.fetch_model", "fetch and convert the embedded SmolLM2 default (once)"),
    "install-engine": ("treespec.apps.commands.install_engine", "build the llama.cpp engine's binding for this CPU (once)"),
    "fetch-data": ("treespec.apps.commands.fetch_data", "put a benchmark's prompts into the data folder once (hub or local file)"),
    "distill-data": ("treespec.apps.commands.distill_data", "generate self-distillation data with the target"),
    "data-store": ("treespec.apps.commands.data_store", "keep a data pass's shards in the repository, or restore them"),
    "profile-cost": ("treespec.apps.commands.profile_cost", "measure verify/draft latency and fit a cost model (CaDDTree)"),
    "replay": ("treespec.apps.commands.replay", "record drafter traces once, then replay policies' tau without the target"),
    "bench": ("treespec.apps.commands.bench", "A/B comparison of methods: paired runs, tables with CIs, plots"),
    "teacher-cache": ("treespec.apps.commands.teacher_cache", "run the frozen target once over distill-data shards and store what training needs"),
    "train-drafter": ("treespec.apps.commands.train_drafter", "train a drafter on self-distillation data through its recipe"),
}

# --dtype names shared by the subcommands: the kernel's dtype names, and "auto" (the faster of bf16
# and fp32 for the target on this CPU, measured once (treespec.pricing.hardware), bf16 on CUDA) and
# "checkpoint" (the stored dtype).  Each command offers the subset that makes sense for it.
DTYPES = {"auto": "auto", "checkpoint": "checkpoint", **DTYPE_NAMES}
CPU_DTYPES = ("auto", "bfloat16", "float32")  # the dtypes worth running a target in on a CPU


def add_exact_argument(parser, default: bool | None) -> None:
    """``--exact`` / ``--no-exact``: the engine's numeric path where a tree's rows equal one-token steps bit for
    bit, so every output equals AR's token for token (docs/decoding.md, "Exactness"); ``default`` None: the
    engine's own (llama.cpp: exact, it costs nothing there; torch: not, it costs AR steps on some CPUs)."""
    import argparse

    said = {True: "on", False: "off", None: "the engine's default: llama.cpp on, torch off"}[default]
    parser.add_argument("--exact", action=argparse.BooleanOptionalAction, default=default,
                        help=f"batch-invariant kernels: every output equal to AR's token for token, no near-tie "
                             f"tolerance (default {said}; its cost per engine: docs/decoding.md)")


def add_engine_argument(parser) -> None:
    """``--engine NAME``: what runs the target (torch, or a registered engine: llama.cpp)."""
    from treespec.apps.assembly.loading import engines

    parser.add_argument("--engine", default=DEFAULT_ENGINE, choices=engines(),
                        help="what runs the target: torch (its transformers modules) or llama.cpp (its GGUF file, "
                             "through llama-cpp-python; the drafters stay torch modules)")
    parser.add_argument("--sha256", default=None, metavar="HEX",
                        help="the digest the model's weights must have (the GGUF file an engine runs, or a folder's "
                             "safetensors in name order, as bench.json records it): checked before anything loads "
                             "(a GGUF file carries no checksum of its own)")


def check_model_digest(args) -> None:
    """``--sha256``: the weights the command's ``--engine`` runs for its model (the embedded default when none
    is named) against the digest given; a ValueError naming both when they differ."""
    from treespec.apps.assembly.loading import check_sha256

    if args.sha256 is not None:
        check_sha256(args.model, args.engine, args.sha256)


def add_threads_argument(parser) -> None:
    """``--threads N``: torch's intra-op threads; by default $TREESPEC_THREADS, else the cores free at
    start (`start_threads`).  Both are checked by `treespec.pricing.conditions.check_threads` while the
    arguments are parsed (the CLI's `treespec.apps.cli.main` reads the variable)."""
    parser.add_argument("--threads", type=_thread_count, default=None,
                        help="torch CPU threads, at most the cores this process may use (default: "
                             "$TREESPEC_THREADS if set, else the cores not busy with other work at start, chosen "
                             "again when another process takes one or leaves one)")


def _thread_count(text: str) -> int:
    """argparse type of --threads (argparse names the flag and exits 2 on a bad value)."""
    import argparse

    from treespec.pricing.conditions import check_threads

    try:
        return check_threads(text, "--threads")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threads ")) from None


def threads_from_env(args, parser) -> None:
    """``args.threads`` from $TREESPEC_THREADS where the command takes --threads and none was given;
    a bad value ends the command with one line (argparse's usage error, exit 2)."""
    import os

    from treespec.pricing.conditions import THREADS_ENV, check_threads

    if getattr(args, "threads", "absent") is not None or not os.environ.get(THREADS_ENV):
        return
    try:
        args.threads = check_threads(os.environ[THREADS_ENV], f"${THREADS_ENV}")
    except ValueError as exc:
        parser.error(str(exc))
    args.threads_reason = f"as ${THREADS_ENV} asks"


def start_threads(args, *, announce: bool = True, ranks: int = 1):
    """The run's `treespec.pricing.conditions.ThreadControl`: ``--threads`` as given (or
    $TREESPEC_THREADS), else the cores free now, shared by ``ranks`` processes; says the choice and
    why on stderr (unless ``announce`` is False: the caller prints it), and every later change."""
    import sys

    from treespec.pricing.conditions import ThreadControl

    report = lambda line: print(line, file=sys.stderr)  # noqa: E731
    reason = getattr(args, "threads_reason", "as asked (--threads)")
    control = ThreadControl.start(args.threads, reason=reason, report=report, ranks=ranks)
    if announce:
        report(f"treespec: {control.choice.describe()}")
    return control


def exit_status(exc: BaseException) -> int:
    """A command's exit status for the error ``exc``: 2 for a bad argument or input (a ValueError: a
    method, option, budget or file that cannot serve; a path that does not exist), as argparse exits
    for bad arguments; 1 for a failure while running (a policy's error in a round, an unreadable file)."""
    from treespec.decoding import PolicyError

    if isinstance(exc, PolicyError):
        return 1
    return 2 if isinstance(exc, ValueError | FileNotFoundError) else 1
