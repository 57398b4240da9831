"""The three swappable parts of speculative decoding and the messages they exchange.

Contract
--------
One decoding round is ``draft -> build -> verify -> commit``:

1. ``Drafter.draft(DraftContext) -> DraftOutput``: one block forward of the drafter: base log-probs for
   drafted depths 1..L (row ``d - 1`` is depth d) and, for path-dependent drafters, a
   `ConditionalScorer`.
2. ``TreePolicy.build(DraftOutput) -> DraftTree``: pure (no model calls but the draft's scorer, no
   timing, no globals), built with the policy's backend ("torch" or "networkx", `TreePolicy.with_backend`).
3. ``Verifier.verify(tree, target_logits, ...) -> VerifyResult``: accepted node indices (root first) and
   the bonus token, the next round's root.
4. The decoder commits the accepted path and tells the drafter (``Drafter.observe_accepted``).

Around each round the decoder runs the round protocol (`treespec.steering`) with the policy's
`DraftController` (``TreePolicy.draft_controller``): whether a generation may draft, each round's
`Decision`, and the `RoundReport` after it, which the policy hears too (``observe_round``; hooks
``begin_generation`` and ``begin_round`` before).  `EveryRound` drafts every round at the policy's own
price; the priced rule is treespec/pricing/control.py's.  Every tree is verified losslessly, so no
decision changes a committed token.

A policy declaring ``samples_from_draft`` also draws trees at T > 0 (``TreePolicy.sample``, a seed from
the caller's generator each round) and passes the `Proposals` to the verifier.  A scorer that trace
replay can store implements `RecordableScorer`.  Optional hooks default to no-ops.  A batch gives every
sequence its own drafter state (``Drafter.fork``) and asks for all drafts and trees at once
(``Drafter.draft_batch``, ``TreePolicy.build_batch``, whose defaults loop).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs
import torch

from treespec.tree import DraftTree

if TYPE_CHECKING:
    from treespec.target import Target

__all__ = [
    "ConditionalScorer", "DraftContext", "DraftOutput", "Drafter", "Expansion", "Proposals", "RecordableScorer",
    "CalibrationMap", "Decision", "DraftController", "EveryRound", "PricedCurve", "RoundReport", "SamplingParams",
    "TreePolicy", "Verifier", "VerifyResult", "backend_field", "check_backend", "check_single_batch", "BACKENDS",
]

BACKENDS = ("torch", "networkx")


def check_backend(backend: str) -> None:
    """Refuse a tree backend other than those of `BACKENDS`."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def backend_field():
    """The attrs field of a policy with both backends: ``backend``, keyword-only, "torch" by default."""
    return attrs.field(default="torch", kw_only=True, validator=lambda _, __, value: check_backend(value))


def check_single_batch(input_ids: torch.Tensor) -> torch.Tensor:
    """Return ``input_ids`` as a 1-D tensor: a single-sequence call takes one sequence (batched
    decoding, treespec/batch_decoding.py, takes a list of them)."""
    if input_ids.is_floating_point() or input_ids.is_complex() or input_ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.dim() == 2:
        if input_ids.shape[0] != 1:
            raise ValueError(f"treespec decodes a batch of one sequence; got batch size {input_ids.shape[0]}")
        input_ids = input_ids[0]
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise ValueError(f"input_ids must be a non-empty [T] or [1, T] tensor, got shape {tuple(input_ids.shape)}")
    return input_ids


# ---------------------------------------------------------------------------- drafting
@attrs.frozen(eq=False)
class DraftContext:
    """What a drafter sees at the start of a round."""

    sequence: torch.Tensor  # [P + 1] int64: every committed token, the anchor (root) last
    features: torch.Tensor | None  # [n_new, F] target hidden taps of the tokens committed since the last draft
    feature_start: int = 0  # absolute position of features[0]

    @property
    def anchor(self) -> int:
        """The last committed (bonus) token: the tree's root."""
        return int(self.sequence[-1])

    @property
    def position(self) -> int:
        """Absolute position of the anchor (= number of tokens before it)."""
        return self.sequence.numel() - 1


@attrs.frozen(eq=False)
class Expansion:
    """Children of a batch of n parent nodes (k per parent): what a `ConditionalScorer` proposes, and
    what every candidate source of the tree builders hands on (policies/engine/candidates.py)."""

    tokens: torch.Tensor  # [n, k] int64, per row sorted by logprob descending, ties token ascending
    logprobs: torch.Tensor  # [n, k] float32 log-probs of each child given its parent's path
    states: torch.Tensor | None  # [n, k, S] scorer state of each child's own root-to-child path (None: factorized)


class ConditionalScorer(ABC):
    """Path-dependent child distributions (Domino's GRU correction), batched over tree nodes."""

    @abstractmethod
    def root_state(self) -> torch.Tensor:
        """[S] the state of the root's path (for Domino: the GRU after the anchor's embedding)."""

    @abstractmethod
    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        """Children of n parents at ``depth`` (their children sit at ``depth + 1``).

        ``states`` is ``[n, S]``.  Candidates are the top-``top_m`` base tokens of row ``depth``;
        the correction is normalised over those candidates and the best ``k`` are returned.
        Depths below the scorer's pure-draft prefix use the base log-probs unchanged.
        """

    def expand_deferred(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        """Optional: the children `expand` gives, with their states left pending (a scorer whose child
        state costs a step of work, such as Domino's GRU, can skip it for children never expanded);
        the tree builders call `advance` on a row of pending states before expanding it, and only
        then.  The default defers nothing: `expand`'s children, their states complete."""
        return self.expand(states, depth, top_m=top_m, k=k)

    def advance(self, pending: torch.Tensor) -> torch.Tensor:
        """Optional: [n, S] the complete states of pending children ``pending`` [n, ...] (see
        `expand_deferred`); the default: they are complete already."""
        return pending

    def round_inputs(self) -> dict[str, torch.Tensor] | None:
        """Optional: the tensors this round's scorer is made of (everything else, such as weights,
        is shared by every round), so that a captured build (policies/engine/cuda_graph.py) can copy a new
        round into fixed buffers; None (the default): the scorer cannot be captured."""
        return None

    def with_round_inputs(self, inputs: Mapping[str, torch.Tensor]) -> ConditionalScorer:
        """A fresh scorer like this one over ``inputs`` (the names and shapes of `round_inputs`)."""
        raise NotImplementedError(f"{type(self).__name__} offers no round_inputs")

    @classmethod
    def stack(cls, scorers: Sequence[ConditionalScorer]) -> object | None:
        """Optional: S scorers of this class as one stacked scorer -- these methods with a leading
        [S] dimension on every tensor, each sequence's rows as its own scorer computes them -- so
        that S trees grow in one batched build; None (the default) has the builder call them in turn."""
        return None


class RecordableScorer(ConditionalScorer):
    """A `ConditionalScorer` that trace replay can store as tensors and rebuild without its drafter.

    Recording calls `record_round` once per round and `record_shared` once per drafter (on the
    last round's scorer, with every round's tensors stacked); traces recorded in parts are joined
    with `merge_shared`.  Replay resolves the class by `record_kind` in the registry (kind
    ``"scorer"``) and rebuilds round r with ``replayer(shared, meta, vocab_size)(rounds[r], anchor)``:
    that scorer must return the recorded round's children bit for bit for every ``top_m`` up to
    the recorded one (tokens it never recorded may read as NaN or -inf).
    """

    record_kind: ClassVar[str] = ""  # the registry name (kind "scorer") its records load under

    @abstractmethod
    def record_round(self, top_m: int) -> dict[str, torch.Tensor]:
        """This round's inputs, up to ``top_m`` candidates per depth: the same names and shapes every round."""

    @abstractmethod
    def record_shared(self, rounds: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON-able meta) every round shares, given all rounds' tensors stacked [R, ...]."""

    @classmethod
    @abstractmethod
    def merge_shared(cls, parts: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One shared record for the rounds of ``parts`` (records of the same drafter), in order."""

    @classmethod
    @abstractmethod
    def replayer(cls, shared: Mapping[str, torch.Tensor], meta: Mapping,
                 vocab_size: int) -> Callable[[Mapping[str, torch.Tensor], int], ConditionalScorer]:
        """A function (one round's tensors, the anchor token) -> the scorer of that round."""

    @classmethod
    def check_record(cls, rounds: Mapping[str, torch.Tensor], shared: Mapping[str, torch.Tensor], meta: Mapping,
                     vocab_size: int) -> str | None:
        """What is wrong with a loaded record (a token id outside the vocabulary, shapes that disagree),
        or None; trace loading asks before any round is rebuilt.  Default: nothing to check."""
        return None


@attrs.frozen(eq=False)
class DraftOutput:
    """One drafter forward: per-depth base log-probs and, optionally, a conditional scorer."""

    logprobs: torch.Tensor  # [L, V] float32 base log-probs; row d-1 is the token at depth d
    root_token: int  # the anchor: the tree's root token
    position: int = 0  # absolute position of the anchor (the context length seen by cost models)
    scorer: ConditionalScorer | None = None  # path-dependent correction (None: factorized drafter)

    def __attrs_post_init__(self) -> None:
        lp = self.logprobs
        if lp.dim() != 2 or lp.shape[0] < 1:
            raise ValueError(f"DraftOutput.logprobs must be [L, V] with L >= 1, got {tuple(lp.shape)}")
        if lp.dtype != torch.float32:
            raise ValueError(f"DraftOutput.logprobs must be float32, got {lp.dtype}")

    @property
    def depth(self) -> int:
        """L, the number of drafted positions (the deepest a tree may go)."""
        return self.logprobs.shape[0]

    @property
    def vocab_size(self) -> int:
        return self.logprobs.shape[1]


class Drafter(ABC):
    """A block drafter.  Subclasses implement `draft`; the hooks are optional.

    ``role`` says what its drafts give a policy: ``"marginal"`` (per-depth marginals only: DFlash)
    or ``"conditional"`` (marginals and a `ConditionalScorer`: Domino), so the apps pick a drafter for
    a policy by what the policy declares it needs (``uses_scorer``), not by a product name."""

    tap_layers: tuple[int, ...] = ()  # target hidden_states indices the drafter reads (0 = embeddings)
    role: ClassVar[str] = "marginal"  # "marginal" or "conditional" (its drafts carry a ConditionalScorer)

    @property
    def reach(self) -> int | None:
        """The depth its drafts reach (L: no tree of its drafts accepts more than L + 1 tokens a round); None:
        not known before a draft.  A priced controller weighs trees by it (`DraftController.bind`)."""
        return None

    @classmethod
    def from_pretrained(cls, path: str | Path, **kwargs: Any) -> Drafter:
        """Optional: the drafter saved in the local directory ``path`` (its loader: how the apps load
        a drafter named on the command line).  The default: this drafter cannot be loaded from files."""
        raise NotImplementedError(f"{cls.__name__} cannot be loaded from a directory (it defines no from_pretrained)")

    def bind(self, target: Target) -> None:
        """Attach to a target (share its embeddings / head, check vocab and hidden sizes)."""

    def reset(self) -> None:
        """Forget any per-sequence cache before a new generation."""

    @abstractmethod
    def draft(self, ctx: DraftContext) -> DraftOutput:
        """One block forward from the committed context."""

    def observe_accepted(self, accepted: torch.Tensor) -> None:
        """Feedback: the accepted node tokens of the last round (root first)."""

    def fork(self) -> Drafter:
        """A drafter for one more sequence of a batch: the same weights and binding, fresh
        per-sequence state.  Default: a shallow copy, reset; a drafter that keeps its per-sequence
        state in a mutable object (a context cache) overrides this to give the copy its own."""
        clone = copy.copy(self)
        clone.reset()
        return clone

    def draft_batch(self, forks: Sequence[Drafter], contexts: Sequence[DraftContext]) -> list[DraftOutput]:
        """One draft per sequence, ``forks[s]`` (from `fork`) holding sequence s's state.  Default:
        each fork drafts alone; block drafters override this with one batched forward."""
        return [fork.draft(ctx) for fork, ctx in zip(forks, contexts, strict=True)]

    def identity(self) -> str:
        """What the drafter's forward cost depends on (its class and configuration, not its
        weights); cost profiles are keyed by it."""
        config = getattr(self, "config", None)
        described = attrs.asdict(config) if attrs.has(type(config)) else repr(config)
        return f"{type(self).__name__}:{json.dumps(described, sort_keys=True, default=str)}"

    def weights_digest(self) -> str:
        """sha256 over the drafter's tensors (names, shapes, dtypes and bytes) when it keeps them in a
        ``model`` module, else its class name: what its promises depend on beyond `identity`
        (calibrations and recorded traces are keyed by it)."""
        model = getattr(self, "model", None)
        if not isinstance(model, torch.nn.Module):
            return type(self).__name__
        digest = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            t = tensor.detach().cpu().contiguous()
            digest.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return digest.hexdigest()


# ---------------------------------------------------------------------------- policies
class TreePolicy(ABC):
    """Turns a `DraftOutput` into a `DraftTree`.

    What is pure and what is state: ``build`` (and ``sample``, ``build_batch``) is a pure function
    of the draft and of the policy's fields; most policies have no other state.  A policy that
    learns declares ``learns`` and keeps what it learned in its fields, changed only through the
    round hooks: ``begin_generation`` (a new request), ``begin_round`` (a round starts),
    ``observe_round`` (a verified round), ``restore_learned`` (what an earlier run learned).  Given
    the same hooks in the same order it builds the same trees.  ``for_request`` says what is learned
    per request rather than per drafter.  Whether a round drafts, and at what price a priced policy
    builds, is its draft controller's (``draft_controller``, ``priced``), not the policy's.
    """

    name: ClassVar[str] = "policy"
    # what the policy needs, read by the harnesses instead of lists of names:
    uses_scorer: ClassVar[str] = "never"  # the draft's ConditionalScorer: "never", "optional" or "required"
    uses_cost_model: ClassVar[bool] = False  # takes cost_model=; harnesses pass the machine's profile
    samples_from_draft: ClassVar[bool] = False  # tree tokens are drawn from the draft's rows (not chosen)
    budget: int | None = None  # most non-root nodes its trees hold (a field of most policies; None: no fixed cap)
    learns: ClassVar[bool] = False  # its trees depend on the rounds it observed (`observe_round`), so a harness's
    # records depend on the order of its prompts
    backend: str = "torch"  # which implementation builds its trees (`BACKENDS`); a policy with both declares
    # it as a field (`backend_field`), one whose single implementation serves both keeps this

    @abstractmethod
    def build(self, draft: DraftOutput) -> DraftTree:
        """Build the round's tree with this policy's backend."""

    def with_backend(self, backend: str) -> TreePolicy:
        """This policy with its trees built by ``backend`` ("torch" or "networkx"): a copy with that field
        (learned state shared), or the policy itself when one implementation serves both backends."""
        check_backend(backend)
        if backend == self.backend or not (attrs.has(type(self)) and "backend" in attrs.fields_dict(type(self))):
            return self
        return attrs.evolve(self, backend=backend)

    def sample(self, draft: DraftOutput, *, sampling: SamplingParams, seed: int) -> tuple[DraftTree, Proposals]:
        """A policy declaring ``samples_from_draft``: the tree with every node's children drawn
        from the draft at ``sampling``'s temperature, and what they were drawn from; a pure
        function of (draft, sampling, seed), so a recorded seed rebuilds the same tree."""
        raise NotImplementedError(f"{type(self).__name__} declares samples_from_draft but has no sample()")

    def build_batch(self, drafts: Sequence[DraftOutput]) -> list[DraftTree]:
        """One tree per draft, each the tree `build` returns for it, bit for bit.  Default: one
        build each; a policy may share work across the drafts (policies/engine/best_first.py does)."""
        return [self.build(draft) for draft in drafts]

    def draft_controller(self) -> DraftController:
        """A fresh controller of whether and at what price this policy's rounds draft (`DraftController`);
        a decoder asks once and keeps it across its generations.  Default: draft every round at the
        policy's own price; a policy that prices its trees returns one that learns the machine."""
        return EveryRound()

    def priced(self, price: PricedCurve | None, calibration: CalibrationMap | None) -> TreePolicy:
        """This policy building at ``price`` and ``calibration`` (a controller's `Decision`;
        None keeps the policy's own).  Default: the policy itself (it prices nothing)."""
        return self

    def begin_generation(self) -> None:
        """Optional: a new generation (a new request) starts: the decoders call it before the first
        round (a batch once per `for_request` policy), replay before each prompt.  Default: nothing."""

    def for_request(self) -> TreePolicy:
        """The policy one request's rounds go to in a batch, where several requests decode at once.
        Default: this policy itself, whose state (if any) is learned per drafter and shared by every
        row; a policy whose state belongs to one request (a choice made from its first rounds)
        returns a copy that keeps that state apart and shares the rest."""
        return self

    def learned_state(self) -> dict | None:
        """Optional: what this policy learned (JSON-ready), for the apps to keep per drafter and give
        back to a later run's policy (`restore_learned`); None (the default): nothing to keep."""
        return None

    def restore_learned(self, state: Mapping[str, Any]) -> None:
        """Optional: take up what `learned_state` gave (a ValueError naming what is wrong with it).
        Default: nothing."""

    def begin_round(self) -> None:
        """Optional: a round of this policy starts (a policy choosing among others chooses here).
        Default: nothing."""

    def observe_round(self, report: RoundReport) -> None:
        """Optional: after each verified round, what it measured (`RoundReport`), for a policy that learns
        from it (acceptance).  Default: learns nothing.  The tree a later ``build`` returns may depend
        on what was observed; given the same observations it is the same tree."""


class PricedCurve(Protocol):
    """A frozen cost curve a round was priced with (`treespec.pricing.cost`'s models): the core only
    keeps it in the round's stats, and the records write it out."""

    def to_dict(self) -> dict: ...


class CalibrationMap(Protocol):
    """A frozen map from the drafter's probabilities to acceptance (`treespec.pricing.calibration`),
    kept and written out likewise."""

    def to_record(self) -> dict: ...


@attrs.frozen(eq=False)
class RoundReport:
    """One verified round as the decoder measured it (`DraftController.observe`,
    `TreePolicy.observe_round`)."""

    tree: DraftTree  # the tree the target verified (root-only for an AR step)
    result: VerifyResult  # its accepted path (root first) and bonus token
    context: int  # tokens in the target's cache under the tree (the anchor's position)
    times: Mapping[str, float]  # seconds per stage: draft, build, verify, commit
    drafted: bool  # the drafter was asked this round (False: an AR step)
    explored: bool = False  # the round explored (`Decision.explore`)
    batch_rows: int = 1  # sequences whose trees one forward verified together: > 1, the times are the batch's
    tapped: bool = False  # the forward computed the drafter's taps (a generation that may draft)

    @property
    def seconds(self) -> float:
        """The round's seconds, every stage counted (what the round cost the user)."""
        return float(sum(self.times.values()))

    @property
    def drafting_seconds(self) -> float | None:
        """Draft + build seconds of a drafted round (what a tree round pays and an AR step does not)."""
        return self.times["draft"] + self.times["build"] if self.drafted else None


# ---------------------------------------------------------------------------- the draft controller
@attrs.frozen(eq=False)
class Decision:
    """What the next round does (module docstring)."""

    draft: bool = True  # ask the drafter this round (False: an AR step)
    taps: bool = True  # keep reading the drafter's taps (False: this generation drafts no more)
    price: PricedCurve | None = None  # the cost curve a priced policy builds this round's tree at (None: its own)
    calibration: CalibrationMap | None = None  # the calibration it builds at (None: its own)
    explore: bool = False  # the round measures what the controller does not favour (its reports count them)

    def __attrs_post_init__(self) -> None:
        if self.draft and not self.taps:
            raise ValueError("a round that drafts keeps the drafter's taps")


class DraftController(ABC):
    """Decides before each round whether and how much to draft, and learns from each round."""

    def bind(self, reach: int | None) -> None:
        """The decoder's drafter: the depth its drafts reach (`Drafter.reach`; None: unknown).  Default: unused."""

    def start_generation(self) -> bool:
        """A new generation starts: whether it may draft (read the drafter's taps).  Default: True."""
        return True

    @abstractmethod
    def decide(self) -> Decision:
        """The next round's `Decision`."""

    def observe_round(self, report: RoundReport) -> None:
        """The round just verified, as measured.  Default: learns nothing."""


class EveryRound(DraftController):
    """Draft every round at the policy's own price (the published loops' rule)."""

    _always = Decision()

    def decide(self) -> Decision:
        return self._always


# ---------------------------------------------------------------------------- verification
@attrs.frozen
class SamplingParams:
    """How the target's token is chosen at each tree node."""

    temperature: float = 0.0  # 0: argmax (greedy); > 0: sample softmax(logits / T)
    top_k: int = 0  # keep the k most likely target tokens before sampling (0: off)
    top_p: float = 1.0  # nucleus: keep the smallest set with mass >= top_p (1.0: off)
    position_keyed: bool = True  # draw a position's sample from noise keyed by (key, position)
    key: int | None = None  # the position-keyed noise key; the decoder draws it once per generation

    def __attrs_post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def of(cls, sampling: SamplingParams | None = None, temperature: float | None = None, top_k: int | None = None,
           top_p: float | None = None, position_keyed: bool | None = None, *,
           do_sample: bool | None = None) -> SamplingParams:
        """The one sampling rule: ``sampling`` as given, or one built from the loose keywords, never both
        (a loose keyword given beside ``sampling`` is refused).  Loose keywords left as None take their
        defaults (greedy, no filters, position-keyed).  ``do_sample`` is Hugging Face's switch: None lets
        ``temperature`` decide (the decoders' form); False decodes greedily whatever ``temperature`` says
        (a bad one is still refused); True samples, at temperature 1.0 unless another is given (> 0).
        Settings that contradict each other are refused, never silently dropped: a temperature > 0 with
        ``do_sample=False``, and a top-k or top-p filter on greedy decoding (it filters nothing there)."""
        loose = {"temperature": temperature, "top_k": top_k, "top_p": top_p, "position_keyed": position_keyed,
                 "do_sample": do_sample}
        if sampling is not None:
            given = [k for k, v in loose.items() if v is not None]
            if given:
                raise ValueError(f"give either sampling=SamplingParams(...) or {'/'.join(loose)}, not both "
                                 f"(got sampling and {', '.join(given)})")
            return sampling
        params = cls(0.0 if temperature is None else temperature, 0 if top_k is None else top_k,
                     1.0 if top_p is None else top_p, True if position_keyed is None else position_keyed)
        if do_sample is False and not params.greedy:
            raise ValueError(f"temperature={temperature} samples, but do_sample=False decodes greedily: pass "
                             "do_sample=True to sample, or leave temperature out")
        if do_sample is True and temperature is None:
            params = attrs.evolve(params, temperature=1.0)
        if do_sample is True and params.greedy:
            raise ValueError(f"do_sample=True needs temperature > 0, got {temperature}")
        filters = [f"{name}={value}" for name, value, off in (("top_k", params.top_k, 0), ("top_p", params.top_p, 1.0))
                   if value != off]
        if params.greedy and filters:
            raise ValueError(f"{' and '.join(filters)} filter sampling, and this decodes greedily (temperature 0): "
                             "give a temperature > 0 to sample, or leave the filter out")
        return params


@attrs.frozen(eq=False)
class Proposals:
    """What each node's children in a sampled tree were drawn from (without replacement, in child order).

    Row i is node i's proposal q_i: ``logq[i, j]`` is log q_i(``tokens[i, j]``), normalised over the
    row; a node that was never expanded has an all-padding row (tokens -1, logq -inf).
    """

    tokens: torch.Tensor  # [N, M] int64 candidate tokens of each node's children (-1: padding)
    logq: torch.Tensor  # [N, M] float64 log q over those candidates (-inf: padding)
    seed: int  # the round's noise seed: the same draft, sampling and seed rebuild the same tree

    def __attrs_post_init__(self) -> None:
        if self.tokens.dim() != 2 or self.logq.shape != self.tokens.shape:
            raise ValueError(f"Proposals needs tokens and logq of one shape [N, M], got "
                             f"{tuple(self.tokens.shape)} and {tuple(self.logq.shape)}")

    def probs(self, node: int, vocab: int) -> torch.Tensor:
        """[V] float64 q of node ``node``'s children over the whole vocabulary."""
        keep = self.tokens[node] >= 0
        out = torch.zeros(vocab, dtype=torch.float64, device=self.tokens.device)
        out[self.tokens[node][keep]] = self.logq[node][keep].exp()
        return out

    def select(self, keep: torch.Tensor) -> Proposals:
        """The rows of the kept nodes (a [N] bool mask, the tree cut the same way)."""
        return Proposals(self.tokens[keep], self.logq[keep], self.seed)


@attrs.frozen(eq=False)
class VerifyResult:
    """Outcome of verifying one tree."""

    accepted: torch.Tensor  # [a] int64 node indices from the root (accepted[0] == 0) down the accepted path
    bonus_token: int  # the target's token after the accepted path: the next round's root

    @property
    def tau(self) -> int:
        """Acceptance length of the round: accepted draft tokens + 1 (the bonus)."""
        return self.accepted.numel()


class Verifier(ABC):
    """Chooses the accepted path of a tree from the target's logits at every node."""

    name: ClassVar[str] = "verifier"
    # lossless only over trees sampled from the draft (a policy declaring ``samples_from_draft``)
    requires_sampled_tree: ClassVar[bool] = False
    # at T > 0 with position-keyed sampling, commits exactly AR's own draws (so outputs equal AR's token
    # for token, as with match verification); False: only their distribution is the target's
    reproduces_ar_samples: ClassVar[bool] = False

    @abstractmethod
    def verify(self, tree: DraftTree, target_logits: torch.Tensor, *, sampling: SamplingParams,
               generator: torch.Generator | None, position: int,
               draft: DraftOutput | None = None, proposals: Proposals | None = None) -> VerifyResult:
        """``target_logits`` is ``[N, V]`` (row i: the target's next-token logits after node i).

        ``position`` is the absolute position of the token that follows the root, so node i's
        target token sits at ``position + depths[i]``.  ``draft`` is passed for verifiers that
        need the draft probabilities (rejection sampling on chains); ``proposals`` is what a
        sampled tree's children were drawn from (None for a tree built deterministically).
        """
