"""Suffix automata over token sequences: the index behind the suffix draft (runtime/drafts/suffix.py).

Role in one decode step: step 1 asks where the sequence's current suffix occurred before (its
longest match and the positions where that match ended), step 5 appends the committed tokens.

`SuffixAutomaton` is the online suffix automaton (Blumer et al. 1985): `append` is O(1)
amortised per token, `repeat()` is the longest suffix of the text that also ends earlier (its
state's length, O(1)), and `ends(state)` lists where a state's strings end (a walk of its
suffix-link subtree, capped). `Matcher` follows the longest suffix of ANOTHER stream of tokens
that occurs in an automaton (matching statistics, O(1) amortised per token): how the current
request is matched against earlier requests' outputs. `SuffixMemory` keeps those outputs, bounded
in tokens: two automata (generations); a new output goes into the younger one, and when that
holds half the limit the older one is dropped (FIFO by generation), so memory stays under the
limit and eviction costs O(1) amortised per token.
"""

from __future__ import annotations

VISITS = 96  # suffix-link states an occurrence listing visits at most (the latest-added first)


class SuffixAutomaton:
    """The suffix automaton of a token sequence, built as tokens are appended.

    Per state: `length` (its longest string), `link` (suffix link), `nxt` (token -> state),
    `pos` (for the state created when token i was appended: i; clones: -1) and `kids` (its
    suffix-link children, so that its end positions can be listed). Negative tokens are
    separators: each is unique, so no match crosses one."""

    def __init__(self):
        self.length, self.link, self.pos = [0], [-1], [-1]
        self.nxt: list[dict] = [{}]
        self.kids: list[dict] = [{}]
        self.last = 0
        self.tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def _state(self, length: int, link: int, pos: int, nxt: dict) -> int:
        s = len(self.length)
        self.length.append(length)
        self.link.append(link)
        self.pos.append(pos)
        self.nxt.append(nxt)
        self.kids.append({})
        if link >= 0:
            self.kids[link][s] = None
        return s

    def _relink(self, s: int, to: int) -> None:
        del self.kids[self.link[s]][s]
        self.link[s] = to
        self.kids[to][s] = None

    def append(self, t: int) -> None:
        """Add token t at the end (O(1) amortised)."""
        length, link, nxt = self.length, self.link, self.nxt
        i = len(self.tokens)
        self.tokens.append(t)
        p = self.last
        cur = self._state(length[p] + 1, -1, i, {})
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p == -1:
            to = 0
        else:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                to = q
            else:
                clone = self._state(length[p] + 1, link[q], -1, dict(nxt[q]))
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                self._relink(q, clone)
                to = clone
        link[cur] = to
        self.kids[to][cur] = None
        self.last = cur

    def extend(self, tokens) -> None:
        for t in tokens:
            self.append(int(t))

    def repeat(self) -> tuple[int, int]:
        """(state, length) of the longest suffix of the text that also ends at an earlier
        position ((0, 0): none; the whole text is never its own repeat)."""
        s = self.link[self.last]
        return (s, self.length[s]) if s > 0 else (0, 0)

    def ends(self, state: int, before: int, limit: int = 32, visits: int = VISITS) -> list[int]:
        """Positions < `before` where the strings of `state` end, the most recent first, at most
        `limit` of them (from at most `visits` states of its suffix-link subtree, the latest-added
        first)."""
        found, stack, pos, kids = [], [state], self.pos, self.kids
        while stack and visits > 0:
            s = stack.pop()
            visits -= 1
            if 0 <= pos[s] < before:
                found.append(pos[s])
            stack.extend(kids[s])
        found.sort(reverse=True)
        return found[:limit]


class Matcher:
    """The longest suffix of a token stream that occurs in `sam` (state, length), kept as the
    stream grows (matching statistics: O(1) amortised per token)."""

    def __init__(self, sam: SuffixAutomaton):
        self.sam, self.state, self.length = sam, 0, 0

    def feed(self, t: int) -> None:
        self.state, self.length = walk(self.sam, self.state, self.length, t)


def walk(sam: SuffixAutomaton, state: int, length: int, t: int) -> tuple[int, int]:
    """One matching-statistics step: the longest suffix (state, length) of a stream whose
    longest suffix found in `sam` was (state, length), after token t."""
    nxt, link = sam.nxt, sam.link
    v, n = state, min(length, sam.length[state])
    while v and t not in nxt[v]:
        v = link[v]
        n = sam.length[v]
    if t in nxt[v]:
        return nxt[v][t], n + 1
    return 0, 0


class SuffixMemory:
    """Earlier requests' outputs, at most `max_tokens` tokens in all (separators included): two
    generations of automata; `add` puts an output in the younger, and once that holds half the
    limit it becomes the older one and the older one is dropped. One per draft object (its forks
    share it); nothing else reads it."""

    def __init__(self, max_tokens: int):
        self.max_tokens = int(max_tokens)
        self.gens: list[SuffixAutomaton] = [SuffixAutomaton()]  # oldest first
        self._sep = 0
        self.version = 0  # bumped whenever an output is added or a generation dropped

    @property
    def tokens(self) -> int:
        return sum(len(g) for g in self.gens)

    def add(self, output: list[int]) -> None:
        """Remember one output (its last max_tokens/2 - 1 tokens), evicting by generation."""
        half = self.max_tokens // 2
        if half < 2 or not output:
            return
        young = self.gens[-1]
        if len(young) + len(output) + 1 > half and len(young):
            self.gens = [young, SuffixAutomaton()]  # the older generation is dropped
            young = self.gens[-1]
        young.extend(output[-(half - 1) :])
        self._sep -= 1
        young.append(self._sep)  # a unique separator: no match runs from one output into the next
        self.version += 1

    def clear(self) -> None:
        self.gens = [SuffixAutomaton()]
        self.version += 1
