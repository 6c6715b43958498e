"""Verification: which drafted tokens the base model agrees with.

Terms (as in vLLM's rejection sampler): *draft* tokens are the proposer's guesses at the tree
nodes; *accepted* tokens are the drafts on the longest root-to-node path the base model agrees
with; the *bonus* token is the base model's own choice after the last accepted node, which is
always emitted, so every verify step yields at least one token. Acceptance length = accepted + 1.

These are pure functions over plain lists so they can be tested with literal tokens.
"""

from __future__ import annotations

from collections.abc import Sequence

from .tree import Tree


def verify_greedy(tree: Tree, draft: Sequence[int], target: Sequence[int]) -> tuple[list[int], int]:
    """Walk the tree along the base model's argmax.

    draft[i]:  token at node i (draft[0] is the root, the last token already emitted)
    target[i]: the base model's argmax *after* node i, from the one verify forward pass
    Returns the accepted node ids (root first) and the bonus token.

    E.g. root=5, children of root: node1=7, node2=9; child of node1: node3=11.
         target = [7, 11, x, 13] -> accepted [0, 1, 3], bonus 13.
    Siblings hold distinct tokens (different ranks of one head), so at most one child matches.
    """
    node, accepted = 0, [0]
    while True:
        want = target[node]
        match = next((c for c in tree.children[node] if draft[c] == want), None)
        if match is None:
            return accepted, want
        accepted.append(match)
        node = match
