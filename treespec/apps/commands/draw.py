"""``treespec draw``: render a draft tree as SVG/PNG, DOT or Mermaid.

The tree comes from a JSON record (``--tree``: ``DraftTree.to_dict()`` fields, optionally
``"accepted"`` node indices and ``"labels"``); from a replay trace (``--trace T --prompt I
--position P --methods a,b``: each method's tree built from the same recorded draft, side by side,
nodes no other tree holds outlined, accepted paths filled; ``--html PAGE`` writes a page that
steps through every position of the prompt); or, without either, from a real decoding round:
the target (default: the embedded SmolLM2) decodes the prompt greedily with the method's policy
and drafter (default: the embedded drafter the method needs), and round ``--round`` is drawn, its
nodes labelled with their decoded tokens and the accepted path highlighted.  The figures in
``docs/policies/`` are made this way (``docs/figures/make.sh``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from treespec.apps.commands import CPU_DTYPES, DTYPES, add_threads_argument, exit_status, start_threads
from treespec.apps.drawing import trees
from treespec.interfaces import VerifyResult
from treespec.tree import DraftTree

_DEFAULT_PROMPT = "What is speculative decoding?"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=None, help="output file: .svg, .png, .dot or .mmd")
    parser.add_argument("--title", default=None, help="figure title (SVG/PNG only)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out or --html file")
    parser.add_argument("--tree", type=Path, default=None, help="JSON file with tokens, parents[, scores, accepted, labels]")
    traced = parser.add_argument_group("policies side by side on one recorded draft (instead of --tree)")
    traced.add_argument("--trace", type=Path, default=None, help="replay trace (`treespec replay record`)")
    traced.add_argument("--position", type=int, default=0,
                        help="response tokens committed before the round (0: the first round)")
    traced.add_argument("--methods", default=None, help="methods to draw side by side, e.g. ddtree@16,eagle2@16")
    traced.add_argument("--html", type=Path, default=None,
                        help="also write a self-contained HTML page stepping through every position of --prompt")
    live = parser.add_argument_group("a real round (instead of --tree)")
    live.add_argument("--drafter", type=Path, default=None,
                      help="drafter checkpoint directory (default: the embedded one the method needs)")
    live.add_argument("--model", type=Path, default=None, help="target directory (default: the embedded SmolLM2)")
    live.add_argument("--method", default="ddtree@16", help="policy method, e.g. ddtree@16, dominotree@16")
    live.add_argument("--prompt", default=None,
                      help="user message (chat template applied; default: 'What is speculative decoding?'); "
                           "with --trace, the prompt's index in the trace (default 0)")
    live.add_argument("--round", type=int, default=1, help="which decoding round to draw (1 = the first)")
    live.add_argument("--dtype", choices=CPU_DTYPES, default="auto", help="target dtype (auto: the faster here)")
    add_threads_argument(live)
    live.add_argument("--cost-model", default="profile",
                      help="cost model of cost-aware methods: profile (default: this machine's measured profile, "
                           "so a drawing does not depend on the moment's timings), live, or a JSON file / preset:NAME")


def render(tree: DraftTree, out: Path, labels=None, accepted=None, title: str | None = None) -> Path:
    """Write ``tree`` to ``out`` in the format its suffix names."""
    writers = {".dot": trees.to_dot, ".mmd": trees.to_mermaid}
    if out.suffix in writers:
        out.write_text(writers[out.suffix](tree, labels, accepted))
        return out
    return trees.write_figure(tree, out, labels, accepted, title=title)


class _Enough(Exception):
    """Raised by the round observer once the asked-for round is verified: decoding stops there."""


def live_round(target, drafter, policy, input_ids, round_index: int) -> tuple[DraftTree, VerifyResult]:
    """The tree and verification of round ``round_index`` (1-based) of greedy speculative decoding.

    Every round drafts (`treespec.interfaces.EveryRound`, whatever the policy's own controller would
    decide), and decoding stops right after the asked-for round."""
    import torch
    from tqdm import tqdm

    from treespec.interfaces import EveryRound
    from treespec.decoding import SpeculativeDecoder

    if round_index < 1:
        raise ValueError(f"--round must be >= 1, got {round_index}")
    rounds: list[tuple[DraftTree, VerifyResult]] = []
    bar = tqdm(total=round_index, desc="decoding", unit="round", leave=False)

    def observe(tree: DraftTree, result: VerifyResult) -> None:
        rounds.append((tree, result))
        bar.update(1)
        if len(rounds) == round_index:
            raise _Enough

    decoder = SpeculativeDecoder(target, drafter, policy, on_round=observe, controller=EveryRound())
    room = target.max_positions - int(torch.as_tensor(input_ids).numel())
    try:
        decoder.generate(input_ids, max_new_tokens=min(room, (drafter_depth(drafter) + 1) * round_index),
                         stop_token_ids=[])
    except _Enough:
        pass
    finally:
        bar.close()
    if len(rounds) < round_index:
        raise ValueError(f"decoding ended after {len(rounds)} rounds; ask for an earlier --round")
    return rounds[round_index - 1]


def drafter_depth(drafter) -> int:
    """The most tokens one round can commit minus one (the drafter's block), 64 when unknown."""
    config = getattr(drafter, "config", None)
    return int(getattr(config, "block_size", 64))


def read_tree_record(path: Path) -> tuple[DraftTree, list | None, list | None]:
    """(tree, labels, accepted) of a ``--tree`` JSON file; ValueError naming the file and the problem."""
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"no tree file at {path}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"{path}: expected a JSON object with tokens and parents")
    try:
        tree = DraftTree.from_dict(record)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    accepted = record.get("accepted")
    if accepted is not None:
        if not isinstance(accepted, list) or not all(isinstance(i, int) and 0 <= i < len(tree) for i in accepted):
            raise ValueError(f"{path}: accepted must list node indices in [0, {len(tree)}), got {accepted}")
    labels = record.get("labels")
    if labels is not None and (not isinstance(labels, list) or len(labels) != len(tree)):
        raise ValueError(f"{path}: labels must list one label per node ({len(tree)}), got {labels!r}")
    return tree, labels, accepted


def _from_model(args: argparse.Namespace):
    from treespec.apps.assembly.cost_source import CostSource
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import load_drafter, load_target, load_tokenizer
    from treespec.apps.assembly.methods import parse_method
    from treespec.apps.assembly.session import Chat, Session

    method = parse_method(args.method)
    if method.autoregressive:
        raise ValueError("AR builds no draft tree; name a policy method, e.g. ddtree@16")
    drafter_dir = args.drafter or _embedded_drafter(method.drafter, args.model)  # before any model loads
    model_dir = args.model or embedded_model_dir()
    tokenizer = load_tokenizer(model_dir)  # the labels need one: refuse before the target loads
    threads = start_threads(args)
    target = load_target(model_dir, dtype=DTYPES[args.dtype])
    ids = Chat(tokenizer).encode([args.prompt or _DEFAULT_PROMPT])
    session = Session(target, tokenizer, {method.drafter: load_drafter(drafter_dir)},
                      costs=CostSource.parse(args.cost_model), threads=threads, progress=True)
    drafter, policy = session.parts(method)
    tree, result = live_round(target, drafter, policy, ids, args.round)
    labels = [repr(tokenizer.decode([t]))[1:-1] for t in tree.tokens.tolist()]
    return tree, labels, result.accepted.tolist()


def _embedded_drafter(kind: str, model: Path | None) -> Path:
    from treespec.apps.assembly.loading import embedded_drafter_dir

    if model is not None:
        raise ValueError("--model needs --drafter (the embedded drafters fit the embedded target only)")
    path = embedded_drafter_dir(kind)
    if not path.is_dir():
        raise FileNotFoundError(f"the embedded {kind} drafter is not installed ({path}); pass --drafter DIR")
    return path


def _trace_label(trace, model: Path | None):
    """token -> text with the tokenizer of --model, or of the embedded target when the trace names
    it; token ids when neither is at hand."""
    from treespec.apps.assembly.embedded import embedded_model_dir
    from treespec.apps.assembly.loading import load_tokenizer

    source = model
    if source is None and trace.meta["target"].get("name") == "smollm2-135m-instruct":
        source = embedded_model_dir()
    if source is None or not Path(source).is_dir():
        return str
    tokenizer = load_tokenizer(source)
    return lambda t: repr(tokenizer.decode([t]))[1:-1]


def _prompt_index(text: str | None) -> int:
    if text is None:
        return 0
    if not text.strip().isdigit():
        raise ValueError(f"with --trace, --prompt is the prompt's index in the trace (0, 1, ...), got {text!r}")
    return int(text)


def _from_trace(args: argparse.Namespace) -> str:
    """Draw (and page) the methods' trees at one position of a trace; returns what was written."""
    from treespec.apps.drawing.trace_page import trace_page
    from treespec.apps.replay import Trace
    from treespec.apps.replay.views import views_at

    if not args.methods:
        raise ValueError("--trace needs --methods, e.g. --methods ddtree@16,eagle2@16")
    methods = [m for m in args.methods.split(",") if m]
    trace, prompt = Trace.load(args.trace), _prompt_index(args.prompt)
    if prompt >= trace.num_prompts:
        raise ValueError(f"--prompt {prompt}: the trace holds {trace.num_prompts} prompts (0 to {trace.num_prompts - 1})")
    label = _trace_label(trace, args.model)
    views = views_at(trace, methods, prompt, args.position)
    prompt_id = trace.meta["prompts"][prompt]["id"]
    where = f"prompt {prompt} ({prompt_id}), position {args.position}"
    written = []
    if args.out is not None:
        if args.out.suffix not in (".svg", ".png"):
            raise ValueError(f"side-by-side trees are drawn as .svg or .png, got {args.out.suffix!r}")
        panels = [trees.Panel(f"{v.method}: tau {v.tau}, {len(v.tree) - 1} nodes, {len(v.only)} in this tree only",
                             v.tree, [label(t) for t in v.tree.tokens.tolist()], v.accepted, v.only) for v in views]
        trees.write_side_by_side(panels, args.out, title=args.title or where)
        written.append(str(args.out))
    if args.html is not None:
        args.html.write_text(trace_page(trace, methods, prompt, label, start=args.position, title=args.title))
        written.append(str(args.html))
    print(where + ": " + "; ".join(f"{v.method} tau {v.tau} ({len(v.tree) - 1} nodes, {len(v.only)} only here)"
                                   for v in views))
    return ", ".join(written)


def _usage(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments themselves (None: nothing): one source, an output, and no
    existing output replaced without --overwrite; the round, position, prompt index and methods
    well formed, all before anything loads."""
    from treespec.apps.assembly.methods import parse_method

    sources = [name for name, given in (("--tree", args.tree), ("--trace", args.trace),
                                        ("--drafter", args.drafter)) if given is not None]
    if len(sources) > 1:
        return f"give one source of trees, not {' and '.join(sources)}"
    if args.html is not None and args.trace is None:
        return "--html pages step through a trace; give --trace T"
    if args.out is None and args.html is None:
        return "give --out FILE (or, with --trace, --html PAGE)"
    if args.round < 1:
        return f"--round must be >= 1 (1 = the first round), got {args.round}"
    if args.position < 0:
        return f"--position must be >= 0 (response tokens before the round), got {args.position}"
    try:
        if args.trace is not None:
            _prompt_index(args.prompt)
            for method in (args.methods or "").split(","):
                if method:
                    parse_method(method)
        elif args.tree is None:
            parse_method(args.method)
    except ValueError as exc:
        return str(exc)
    taken = [f"{flag} {path}" for flag, path in (("--out", args.out), ("--html", args.html))
             if path is not None and path.exists()]
    if taken and not args.overwrite:
        return f"{' and '.join(taken)} exists; pass --overwrite to replace it"
    return None


def run(args: argparse.Namespace) -> int:
    wrong = _usage(args)
    if wrong is not None:
        print(f"treespec draw: {wrong}", file=sys.stderr)
        return 2
    try:
        if args.trace is not None:
            print(f"wrote {_from_trace(args)}")
            return 0
        if args.tree is not None:
            tree, labels, accepted = read_tree_record(args.tree)
        else:
            tree, labels, accepted = _from_model(args)
        render(tree, args.out, labels, accepted, args.title)
    except (OSError, ValueError) as exc:
        print(f"treespec draw: {exc}", file=sys.stderr)
        return exit_status(exc)
    print(f"wrote {args.out} ({tree.budget} draft nodes, depth {tree.max_depth})")
    return 0
