"""Hypothesis strategies for a rollout's calls as agents make them: each call continues an earlier one (its
prompt + response + new ids), re-renders it (drift) or starts afresh; small ids, so that prefixes also match by
chance."""

from __future__ import annotations

from hypothesis import strategies as st

small_ids = st.lists(st.integers(0, 2), max_size=3)


@st.composite
def conversation(draw: st.DrawFn, max_calls: int = 5) -> list[tuple[list[int], list[int]]]:
    """Up to ``max_calls`` (prompt ids, response ids) calls, in the order they were made."""
    turns: list[tuple[list[int], list[int]]] = []
    for _ in range(draw(st.integers(0, max_calls))):
        how = draw(st.sampled_from(["fresh", "extend", "extend", "drift"])) if turns else "fresh"
        if how == "fresh":
            prompt = draw(st.lists(st.integers(0, 2), max_size=4))
        else:
            prompt_ids, response_ids = draw(st.sampled_from(turns))
            answer = response_ids if how == "extend" else draw(small_ids)
            prompt = prompt_ids + answer + draw(small_ids)
        turns.append((prompt, draw(small_ids)))
    return turns
