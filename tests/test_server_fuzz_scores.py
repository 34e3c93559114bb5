"""The embedding and scoring routes' JSON bodies, fuzzed (issue 30: no 5xx anywhere).

Hypothesis writes bodies for embeddings, rerank and score: valid ones, then mutations of
them and bodies that are no JSON object at all, each held to tests/server_fuzzing.py's
property. The app runs in this process over a random Qwen3 whose vocabulary has "yes" and
"no".
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from checkpoints import build_checkpoint, build_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from server_fuzzing import (
    FUZZ,
    MODEL,
    InProcess,
    batches,
    check,
    optional,
    serve,
    small_ints,
    texts,
)

#: `make test-fast` leaves this module out: it takes more than ~10 s on 2 cores (real
#: models, servers as processes or many generations).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def scoring_app(tmp_path_factory) -> Iterator[InProcess]:
    """A random Qwen3 whose vocabulary has "yes" and "no": it embeds and scores."""
    folder = tmp_path_factory.mktemp("fuzz-scores")
    build_checkpoint(folder, "qwen3", vocab_size=264)
    build_tokenizer(folder, words=("yes", "no"))
    yield from serve(folder)


# -- embeddings and scores

token_lists = st.lists(st.integers(0, 263), min_size=1, max_size=4)
embedding_bodies = st.builds(
    lambda input_, fields: {"model": MODEL, "input": input_, **fields},
    st.one_of(texts, st.lists(texts, max_size=3), token_lists, st.lists(token_lists, max_size=2)),
    optional(encoding_format=st.sampled_from(["float", "base64"]), dimensions=st.integers(1, 80)),
)
rerank_bodies = st.builds(
    lambda query, documents, fields: {
        "model": MODEL,
        "query": query,
        "documents": documents,
        **fields,
    },
    texts,
    st.lists(texts, max_size=3),
    optional(top_n=small_ints, return_documents=st.booleans(), instruction=texts),
)
score_bodies = st.builds(
    lambda text_1, text_2, fields: {"model": MODEL, "text_1": text_1, "text_2": text_2, **fields},
    texts | st.lists(texts, max_size=2),
    texts | st.lists(texts, max_size=3),
    optional(instruction=texts),
)


@FUZZ
@given(requests=batches(embedding_bodies))
def test_embeddings_never_fail_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/embeddings", requests, ("input",))


@FUZZ
@given(requests=batches(rerank_bodies))
def test_rerank_never_fails_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/rerank", requests, ("query", "documents"))


@FUZZ
@given(requests=batches(score_bodies))
def test_score_never_fails_with_a_5xx(scoring_app, requests):
    check(scoring_app, "/v1/score", requests, ("text_1", "text_2"))
