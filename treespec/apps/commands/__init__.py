"""Subcommands of the ``treespec`` CLI (one module each, imported lazily)."""

from treespec.target import DTYPE_NAMES

# --dtype names shared by the subcommands: the kernel's dtype names, and "auto" (the faster of bf16
# and fp32 for the target on this CPU, measured once (treespec.pricing.hardware), bf16 on CUDA) and
# "checkpoint" (the stored dtype).  Each command offers the subset that makes sense for it.
DTYPES = {"auto": "auto", "checkpoint": "checkpoint", **DTYPE_NAMES}
CPU_DTYPES = ("auto", "bfloat16", "float32")  # the dtypes worth running a target in on a CPU


THREADS_ENV = "TREESPEC_THREADS"  # the default of --threads where it is set (the test suite sets 1)


def add_threads_argument(parser) -> None:
    """``--threads N``: torch's intra-op threads; by default $TREESPEC_THREADS, else the cores free at
    start (`start_threads`)."""
    parser.add_argument("--threads", type=_thread_count, default=None,
                        help=f"torch CPU threads (default: ${THREADS_ENV} if set, else the cores not busy with "
                             "other work at start, chosen again when another process takes one or leaves one)")


def _thread_count(text: str) -> int:
    """argparse type of --threads: a whole number >= 1 (argparse names the flag and exits 2 otherwise)."""
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of threads, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def start_threads(args, *, announce: bool = True, ranks: int = 1):
    """The run's `treespec.pricing.conditions.ThreadControl`: ``--threads`` as given (or
    $TREESPEC_THREADS), else the cores free now, shared by ``ranks`` processes; says the choice and
    why on stderr (unless ``announce`` is False: the caller prints it), and every later change.  A bad
    $TREESPEC_THREADS is a ValueError."""
    import os
    import sys

    from treespec.pricing.conditions import ThreadControl

    report = lambda line: print(line, file=sys.stderr)  # noqa: E731
    threads, reason = args.threads, "as asked (--threads)"
    if threads is None and os.environ.get(THREADS_ENV):
        text, reason = os.environ[THREADS_ENV], f"as ${THREADS_ENV} asks"
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"${THREADS_ENV} must be a whole number of threads >= 1, got {text!r}")
        threads = int(text)
    control = ThreadControl.start(threads, reason=reason, report=report, ranks=ranks)
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
