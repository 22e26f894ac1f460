"""A depth-bounded suffix tree with counts: which tokens followed a pattern, and how often.

Suffix decoding needs, for the last few tokens of a request, every earlier place they occurred
and what came next, weighted by frequency. A trie of every substring up to `max_depth` tokens
holds exactly that: the node reached by a pattern counts its occurrences, and its children
count each continuation. Text is only ever appended, so the tree is grown incrementally: it
keeps the nodes of the text's current suffixes (lengths 1 .. max_depth - 1), and appending a
token moves each of them one step down (creating or counting the child) — O(max_depth) per
token, never a pass over the whole text. A whole sequence can also be taken out again (the
bounded cache of earlier requests' outputs evicts its oldest this way).

A node remembers when it was last counted, so equally frequent continuations go to the most
recent one: in code being rewritten, the latest occurrence is the best guess.

A node also keeps its most frequent (then most recent) child's token, updated as counts grow,
so a proposal follows the likeliest path without scanning children: a short pattern after a
common token can have hundreds of them.

Nodes are small lists rather than objects ([children dict, count, last-seen stamp, best
child's token]): a tree of a few thousand tokens has tens of thousands of them, and list
indexing is the cheapest Python offers. The `Matcher` follows a live request's text through a tree that does not contain it
(the shared cache), with the same O(max_depth) step per token.
"""

from __future__ import annotations

from collections.abc import Iterable

CHILDREN, COUNT, LAST, BEST = 0, 1, 2, 3

Node = list  # [dict[int, Node], int, int, int]


def _new_node() -> Node:
    return [{}, 0, 0, -1]


class SuffixTree:
    """Every substring of the text appended so far, up to `max_depth` tokens, with counts."""

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root: Node = _new_node()
        self.num_tokens = 0  # tokens appended through `extend` (the live text's length)
        self._clock = 0
        # _active[i]: the node of the live text's last i + 1 tokens (i + 1 < max_depth).
        self._active: list[Node] = []

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the live text, counting every new substring ending at each."""
        # The body of `_count_child`, inlined: this loop is the tree's whole per-token cost.
        active = self._active
        keep = self.max_depth - 1
        stamp = self._clock
        root = self.root
        for token in tokens:
            stamp += 1
            moved = []
            for node in (root, *active):
                children = node[0]
                child = children.get(token)
                if child is None:
                    child = children[token] = [{}, 0, 0, -1]
                child[1] += 1
                child[2] = stamp
                best = node[3]
                if best != token and (best < 0 or child[1] >= children[best][1]):
                    node[3] = token
                moved.append(child)
            active = moved[:keep]
            self.num_tokens += 1
        self._clock = stamp
        self._active = active

    def add_sequence(self, tokens: list[int]) -> None:
        """Count every substring of a finished sequence (not the live text)."""
        self._walk_windows(tokens, +1)

    def remove_sequence(self, tokens: list[int]) -> None:
        """Take back what `add_sequence(tokens)` counted, dropping nodes that reach zero."""
        self._walk_windows(tokens, -1)

    def suffix_nodes(self) -> list[Node]:
        """The nodes of the live text's last 1, 2, ... tokens (shortest first)."""
        return self._active

    def _count_child(self, node: Node, token: int, stamp: int) -> Node:
        children = node[CHILDREN]
        child = children.get(token)
        if child is None:
            child = children[token] = _new_node()
        child[COUNT] += 1
        child[LAST] = stamp
        best = node[BEST]
        if best != token and (best < 0 or child[COUNT] >= children[best][COUNT]):
            node[BEST] = token  # as frequent and more recent, or more frequent
        return child

    def _walk_windows(self, tokens: list[int], delta: int) -> None:
        """Add `delta` to every substring of `tokens` of up to `max_depth` tokens (each start
        position's path down from the root)."""
        self._clock += 1
        stamp = self._clock
        depth = self.max_depth
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + depth]:
                if delta > 0:
                    node = self._count_child(node, token, stamp)
                    continue
                children = node[CHILDREN]
                child = children.get(token)
                if child is None:
                    break  # never counted (cannot happen for a sequence that was added)
                child[COUNT] -= 1
                if child[COUNT] <= 0:
                    del children[token]
                if node[BEST] == token:  # it may no longer be the most frequent
                    node[BEST] = max(
                        children, key=lambda t: (children[t][COUNT], children[t][LAST]), default=-1
                    )
                if child[COUNT] <= 0:
                    break
                node = child


class Matcher:
    """The nodes of a tree reached by the last 1 .. max_depth - 1 tokens of a text that is not
    in it, kept up to date one appended token at a time."""

    def __init__(self, tree: SuffixTree) -> None:
        self.tree = tree
        self.num_tokens = 0
        self._nodes: list[Node] = []

    def extend(self, tokens: Iterable[int]) -> None:
        keep = self.tree.max_depth - 1
        root = self.tree.root
        nodes = self._nodes
        for token in tokens:
            moved = []
            child = root[CHILDREN].get(token)
            if child is not None:
                moved.append(child)
                for node in nodes:
                    child = node[CHILDREN].get(token)
                    if child is None:
                        break  # a longer suffix is absent if a shorter one is
                    moved.append(child)
            nodes = moved[:keep]
            self.num_tokens += 1
        self._nodes = nodes

    def suffix_nodes(self) -> list[Node]:
        """Nodes for the text's last 1, 2, ... tokens, as far as the tree has them."""
        return self._nodes


__all__ = ["BEST", "CHILDREN", "COUNT", "LAST", "Matcher", "SuffixTree"]
