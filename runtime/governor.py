"""Whether a step speculates: the decoder's own measure of what speculation pays, as it runs.

Role in one decode step: before step 1. A tree tuned in one hour can lose in the next (the
machine's speed moves, the text turns less predictable than the tuning prompts), and a step
that drafts and verifies a tree must then cost less than it carries. The governor keeps, for
two arms, "tree" (the decoder's policy) and "vanilla" (an empty tree: one token, one row), a
decayed sum of the tokens their steps committed and of the seconds those steps took. The tree
leads until its tokens a second fall MARGIN below vanilla's, and leads again once they reach
vanilla's: a tree step carries 1 or 2+ tokens by chance, so an estimate of a few steps swings
by +-15 %, and without the margin (and with a short memory, decay 0.8) it held a third of the
steps of trees that paid 1.15-1.25x (benchmarks/RESULTS.md). The other arm is probed now and
then (a burst of PROBE_STEPS steps after every PROBE_EVERY) so its estimate follows the machine
and the text.

It reads only what earlier steps measured, never the current step's draws: whatever it picks,
greedy output is the target's own and sampling stays lossless (each step's tree is fixed before
its draws, as with any tree). A tree step whose draft first catches up (a request's first tree
step, where the head reads the prompt, and the first after held steps, where it reads their
roots) is not charged to the tree: that cost is the switch's, not the tree's, and charging it
made the tree look slower than vanilla where it paid 1.3x (benchmarks/RESULTS.md). Opt-in
(`DecoderConfig(adaptive=True)`, ARBORSPEC_ADAPTIVE=1); off, every step drafts the tree.
"""

from __future__ import annotations

from dataclasses import dataclass

TREE, VANILLA = "tree", "vanilla"


@dataclass
class ArmRate:
    """Decayed tokens and seconds of one arm's steps (each observation decays the older ones)."""

    tokens: float = 0.0
    seconds: float = 0.0
    seen: int = 0  # steps observed

    def observe(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.seen += 1

    @property
    def rate(self) -> float | None:
        """Tokens a second, or None before any step."""
        return self.tokens / self.seconds if self.seen and self.seconds > 0 else None


class SpeculationGovernor:
    """Picks each step's arm from the measured tokens a second of both (see the module doc).

    warmup: tree steps before the first vanilla probe (the first steps carry one-off costs);
    decay: the weight an observation keeps per newer observation of its arm."""

    PROBE_EVERY = 24  # steps of the leading arm between two probes of the other
    PROBE_STEPS = {TREE: 3, VANILLA: 1}  # a probe's length: a tree's acceptance varies step to step
    WARMUP = 4
    DECAY = 0.95  # ~20 steps of memory per arm
    MARGIN = 0.05  # the tree is held once its rate is 5 % below vanilla's

    def __init__(self, warmup: int = WARMUP, decay: float = DECAY):
        self.arms = {TREE: ArmRate(), VANILLA: ArmRate()}
        self.warmup, self.decay = warmup, decay
        self.leader = TREE
        self._since_probe = 0  # leader steps since the last probe
        self._probing = 0  # probe steps left
        self.held = 0  # steps it ran vanilla in place of the tree (stats)

    def choose(self) -> str:
        """The arm of the next step."""
        if self.arms[TREE].seen < self.warmup:
            return TREE
        if not self.arms[VANILLA].seen:
            return VANILLA
        if self._probing:
            return self._other()
        return self.leader

    def observe(self, arm: str, tokens: int, seconds: float, charged: bool = True) -> None:
        """A step of `arm` committed `tokens` in `seconds` (the whole step: draft to commit).
        charged=False: the step counts toward probes but not toward the arm's rate (a draft's
        catch-up step: see the module doc)."""
        if charged:
            self.arms[arm].observe(tokens, seconds, self.decay)
        if arm == VANILLA and self.arms[TREE].seen >= self.warmup:
            self.held += 1
        if self._probing and arm != self.leader:
            self._probing -= 1
            if self._probing == 0:
                self._elect()
            return
        self._elect()
        if arm == self.leader:
            self._since_probe += 1
            if self._since_probe >= self.PROBE_EVERY:
                self._since_probe = 0
                self._probing = self.PROBE_STEPS[self._other()]

    def _other(self) -> str:
        return VANILLA if self.leader == TREE else TREE

    def _elect(self) -> None:
        tree, plain = self.arms[TREE].rate, self.arms[VANILLA].rate
        if tree is None or plain is None:
            return
        if self.leader == TREE:
            leader = VANILLA if tree < (1 - self.MARGIN) * plain else TREE
        else:
            leader = TREE if tree >= plain else VANILLA
        if leader != self.leader:
            self.leader, self._since_probe = leader, 0
