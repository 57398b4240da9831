"""A synthetic drafter for tests: it knows the target's greedy continuation and corrupts it, seeded.

Contract
--------
After ``bind(target)`` the oracle computes, with the target itself (chain forwards on its
`treespec.target.Target.sibling`: the same weights, a cache of its own, never the decoder's), the
greedy continuation g_1..g_L of the committed sequence.  Its draft for depth d is a random [V] logit row (scale ``sharpness``) in which g_d is
moved to a chosen rank: rank 0 with probability ``top1 * decay^(d-1)``, one of ranks
1..``near_ranks`` with probability ``near * decay^(d-1)``, otherwise a uniformly random lower rank.
The top-ranked token's logit then gets ``confidence`` more, so rows look as sure as a trained
drafter's.  The randomness is keyed by (seed, committed sequence): a context always gets the same
draft.  `GreedyContinuations` can be shared by several oracles over one target.

With ``conditional=True`` the draft also carries `OracleScorer`, a path-dependent
`ConditionalScorer`: a node's state says whether its path is still the greedy continuation.  On
such paths the true next token gets a logit bonus ``boost`` (among the top-M base candidates);
off the path the candidates are reshuffled by a deterministic function of the last token.  So
conditional policies see corrected, path-dependent children, as with Domino.

``check_features=True`` asserts the decoder's feature contract each round: the features cover
exactly the positions from the previous anchor up to this one, and, when tap 0 is requested,
their first H columns equal the target's embeddings of those tokens.
"""

from __future__ import annotations

import attrs
import torch

from treespec.interfaces import ConditionalScorer, DraftContext, Drafter, DraftOutput, Expansion
from treespec.sampling import mix_seed
from treespec.target import Target
from treespec.topk import exact_topk, top_set
from treespec.tree import DraftTree

__all__ = ["ORACLE_PRESETS", "GreedyContinuations", "OracleConfig", "OracleDrafter", "OracleScorer"]


@attrs.frozen
class OracleConfig:
    """How good the oracle's drafts are."""

    depth: int = 8  # L, drafted positions per round
    top1: float = 0.75  # probability that the true token is the top-1 draft token at depth 1
    near: float = 0.2  # probability that it is at ranks 1..near_ranks instead, at depth 1
    near_ranks: int = 3  # deepest rank a near miss falls to
    decay: float = 0.97  # top1 and near are multiplied by decay^(d-1) at depth d
    sharpness: float = 1.0  # scale of the random draft logits
    confidence: float = 3.5  # extra logit of each row's top-ranked token (how sure the draft looks)
    conditional: bool = False  # carry a path-dependent OracleScorer
    boost: float = 5.0  # scorer: logit bonus of the true next token on on-path nodes
    pure_draft_prefix_len: int = 1  # scorer: parents shallower than this use the base rows unchanged
    tap_layers: tuple[int, ...] = ()  # target hidden_states the oracle asks for (plumbing checks)
    check_features: bool = False  # assert the feature contract every round
    seed: int = 0  # keys the corruption

    def __attrs_post_init__(self) -> None:
        if self.depth < 1:
            raise ValueError(f"depth must be >= 1, got {self.depth}")
        if not (0.0 <= self.top1 and 0.0 <= self.near and self.top1 + self.near <= 1.0):
            raise ValueError(f"need top1, near >= 0 and top1 + near <= 1, got {self.top1}, {self.near}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {self.decay}")


ORACLE_PRESETS: dict[str, OracleConfig] = {
    "perfect": OracleConfig(top1=1.0, near=0.0, decay=1.0),  # the chain is always the greedy continuation
    "typical": OracleConfig(),  # long acceptances, misses that trees can catch
    "noisy": OracleConfig(top1=0.45, near=0.35, decay=0.9),  # short chains; branching pays off
}


class _Line:
    """A committed sequence followed by its greedy continuation, and a target caching a prefix of it."""

    def __init__(self) -> None:
        self.known: list[int] = []  # tokens; those past the first ``given`` are greedy
        self.given = 0  # length of the last sequence this line was asked about
        self.target: Target | None = None  # a sibling of the bound target, known[:cached] committed
        self.cached = 0

    def continues(self, sequence: list[int]) -> bool:
        return len(sequence) >= self.given and self.known[:len(sequence)] == sequence

    def common_prefix(self, sequence: list[int]) -> int:
        return next((i for i, (a, b) in enumerate(zip(self.known, sequence)) if a != b),
                    min(len(self.known), len(sequence)))


class GreedyContinuations:
    """The target's greedy continuations, computed with the target itself (chain forwards, own caches).

    Up to ``lines`` sequences are followed at once (least recently used first out), so alternating
    between prompts recomputes nothing; a context that branches off a line's previous context reuses
    that line's cached prefix.  Results are also memoised per (context, n) for sampled runs, which
    revisit the same short contexts.
    """

    def __init__(self, target, *, lines: int = 32, memo: int = 4096) -> None:
        self.target = target
        self.max_lines, self.max_memo = lines, memo
        self.lines: list[_Line] = []  # most recently used last
        self.memo: dict[tuple, list[int]] = {}

    @torch.inference_mode()
    def __call__(self, sequence: list[int], n: int) -> list[int]:
        key = (tuple(sequence), n)
        if key not in self.memo:
            if len(self.memo) >= self.max_memo:
                self.memo.clear()
            self.memo[key] = self._extend(self._line_for(sequence), sequence, n)
        return list(self.memo[key])

    def _line_for(self, sequence: list[int]) -> _Line:
        line = next((ln for ln in reversed(self.lines) if ln.continues(sequence)), None)
        if line is None:
            best = max(self.lines, key=lambda ln: ln.common_prefix(sequence), default=None)
            if best is not None and best.common_prefix(sequence) >= best.given:  # same text, new branch
                line = best
            elif len(self.lines) < self.max_lines:
                line = _Line()
            else:
                line = self.lines[0]
            self._restart(line, sequence)
        if line in self.lines:
            self.lines.remove(line)
        self.lines.append(line)
        return line

    @staticmethod
    def _restart(line: _Line, sequence: list[int]) -> None:
        """Keep the line's cached rows of its common prefix with ``sequence``; drop the rest."""
        line.cached = min(line.cached, line.common_prefix(sequence), len(sequence) - 1)  # >= 1 token to feed
        if line.target is not None:
            line.target.truncate(line.cached)
        line.known, line.given = list(sequence), len(sequence)

    def _extend(self, line: _Line, sequence: list[int], n: int) -> list[int]:
        k = len(sequence)
        line.given = k
        while len(line.known) < k + n:
            self._step(line)
        return line.known[k:k + n]

    def _step(self, line: _Line) -> None:
        """Run the tokens not yet cached as one chain on the line's target; append the greedy next token
        (past the context window, where nothing can be verified, the last token again)."""
        if len(line.known) >= self.target.max_positions:
            line.known.append(line.known[-1])
            return
        if line.target is None:
            line.target, line.cached = self.target.sibling(), 0
        if line.cached == 0:
            line.target.prefill(torch.empty(0, dtype=torch.int64))  # a fresh sequence: the chain's root starts it
        fresh = line.known[line.cached:]  # tokens not yet cached, the first as the chain's root
        logits = line.target.forward_tree(DraftTree.chain(fresh[0], fresh[1:])).logits  # [n, V]
        line.target.commit(torch.arange(len(fresh)))
        line.cached = len(line.known)
        line.known.append(int(logits[-1].argmax()))


class OracleDrafter(Drafter):
    """Drafts the target's greedy continuation with controlled, seeded corruption."""

    def __init__(self, config: OracleConfig | str | None = None, *, continuations: GreedyContinuations | None = None,
                 **overrides) -> None:
        if isinstance(config, str):
            if config not in ORACLE_PRESETS:
                raise ValueError(f"unknown oracle preset {config!r}; available: {', '.join(ORACLE_PRESETS)}")
            config = ORACLE_PRESETS[config]
        self.config = attrs.evolve(config or OracleConfig(), **overrides)
        self.tap_layers = tuple(self.config.tap_layers)
        self.target = None
        self.continuations = continuations  # shared between drafters of one target, or made at bind
        self._next_feature = 0

    @property
    def role(self) -> str:
        """Conditional when configured to carry its scorer, else marginal (so known per instance only)."""
        return "conditional" if self.config.conditional else "marginal"

    @property
    def reach(self) -> int:
        return self.config.depth

    def bind(self, target) -> None:
        self.target = target
        if self.continuations is None or self.continuations.target is not target:
            self.continuations = GreedyContinuations(target)

    def greedy_continuation(self, sequence: list[int], n: int) -> list[int]:
        """The target's next ``n`` greedy tokens after ``sequence``."""
        return self.continuations(sequence, n)

    def reset(self) -> None:
        self._next_feature = 0  # the greedy cache is a pure function of the tokens: kept

    def draft(self, ctx: DraftContext) -> DraftOutput:
        if self.target is None:
            raise RuntimeError("OracleDrafter.draft before bind(target)")
        if self.config.check_features:
            self._check_features(ctx)
        sequence = ctx.sequence.tolist()
        truth = self.greedy_continuation(sequence, self.config.depth)  # [L] g_1..g_L
        key = hash(tuple(sequence)) & ((1 << 62) - 1)  # ints and tuples hash the same in every run
        gen = torch.Generator().manual_seed(mix_seed(self.config.seed, key))
        logprobs = self._corrupted_rows(truth, gen).to(self.target.device)
        scorer = None
        if self.config.conditional:
            scorer = OracleScorer(logprobs, torch.tensor(truth, device=logprobs.device), ctx.anchor,
                                  boost=self.config.boost, pure_draft_prefix_len=self.config.pure_draft_prefix_len)
        return DraftOutput(logprobs, root_token=ctx.anchor, position=ctx.position, scorer=scorer)

    # ------------------------------------------------------------------ corruption
    def _corrupted_rows(self, truth: list[int], gen: torch.Generator) -> torch.Tensor:
        cfg, vocab = self.config, self.target.vocab_size
        logits = torch.randn(len(truth), vocab, generator=gen) * cfg.sharpness  # [L, V]
        for d, token in enumerate(truth):
            rank = self._rank(d, vocab, gen)
            order = logits[d].argsort(descending=True)
            other = int(order[rank])  # swap the true token into that rank
            logits[d, token], logits[d, other] = logits[d, other].clone(), logits[d, token].clone()
            logits[d, logits[d].argmax()] += cfg.confidence  # whoever ranks first now stands out
        return logits.log_softmax(-1)

    def _rank(self, d: int, vocab: int, gen: torch.Generator) -> int:
        cfg = self.config
        scale = cfg.decay ** d
        u = float(torch.rand((), generator=gen))
        if u < cfg.top1 * scale:
            return 0
        if u < (cfg.top1 + cfg.near) * scale:
            return 1 + int(torch.randint(min(cfg.near_ranks, vocab - 1), (), generator=gen))
        low = min(cfg.near_ranks + 1, vocab - 1)
        return low + int(torch.randint(vocab - low, (), generator=gen))

    # ------------------------------------------------------------------ contract checks
    def _check_features(self, ctx: DraftContext) -> None:
        n = 0 if ctx.features is None else ctx.features.shape[0]
        if ctx.feature_start != self._next_feature or ctx.feature_start + n != ctx.position:
            raise AssertionError(f"features cover [{ctx.feature_start}, {ctx.feature_start + n}) but the previous "
                                 f"anchor was at {self._next_feature} and this one is at {ctx.position}")
        if n and 0 in self.tap_layers:
            col = self.tap_layers.index(0) * self.target.hidden_size
            want = self.target.embed_tokens(ctx.sequence[ctx.feature_start:ctx.position])
            if not torch.allclose(ctx.features[:, col:col + self.target.hidden_size], want):
                raise AssertionError("tap-0 features are not the embeddings of the committed tokens")
        self._next_feature = ctx.position


class OracleScorer(ConditionalScorer):
    """Path-dependent children: a boost for the true token on the greedy path, reshuffles off it.

    State ``[2]`` float32: (1.0 while the root-to-node path is the greedy continuation else 0.0,
    the node's own token id).
    """

    def __init__(self, base: torch.Tensor, truth: torch.Tensor, anchor: int, *, boost: float,
                 pure_draft_prefix_len: int) -> None:
        self.base = base  # [L, V] float32 base log-probs
        self.truth = truth  # [L] int64 greedy tokens at depths 1..L
        self.anchor = anchor
        self.boost = boost
        self.pure_draft_prefix_len = pure_draft_prefix_len

    def root_state(self) -> torch.Tensor:
        return torch.tensor([1.0, float(self.anchor)], dtype=torch.float32, device=self.base.device)

    def expand(self, states: torch.Tensor, depth: int, *, top_m: int, k: int) -> Expansion:
        if not 0 <= depth < self.base.shape[0]:
            raise IndexError(f"cannot expand parents at depth {depth}: the draft has {self.base.shape[0]} rows")
        row = self.base[depth]  # [V] children sit at depth + 1
        if depth < self.pure_draft_prefix_len:
            logprobs, tokens = exact_topk(row.expand(states.shape[0], -1), k)
        else:
            tokens, logprobs = self._corrected(states, row, depth, top_m, k)
        on_path = (states[:, :1] > 0.5) & (tokens == self.truth[depth])  # [n, k]
        child_states = torch.stack([on_path.to(torch.float32), tokens.to(torch.float32)], dim=-1)  # [n, k, 2]
        return Expansion(tokens, logprobs, child_states)

    def _corrected(self, states: torch.Tensor, row: torch.Tensor, depth: int, top_m: int, k: int):
        cand = top_set(row[None], top_m)[0]  # [M] token ascending
        on = states[:, :1]  # [n, 1]
        last = states[:, 1:2]  # [n, 1]
        bonus = self.boost * (cand == self.truth[depth]).to(torch.float32)  # [M]
        shuffle = 1.5 * torch.sin(last * 0.7071 + cand.to(torch.float32) * 1.3 + 0.37 * depth)  # [n, M]
        logits = row[cand] + on * bonus + (1.0 - on) * shuffle  # [n, M]
        chosen, order = exact_topk(logits.log_softmax(-1), k)  # columns: tokens ascending
        return cand[order], chosen
