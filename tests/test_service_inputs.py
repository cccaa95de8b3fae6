"""The input rules HTTP and gRPC share (`service/inputs.py`), checked directly: what may be empty, TEI's
/predict shapes, token ids, truncation and ranking. test_service_api and test_grpc check the same rules
through a real server."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from service import inputs
from service.errors import InvalidInput
from service.schemas import ClassifyRequest, DecodeRequest, EmbedRequest, OpenAIEmbeddingRequest


def refusal(rule, *args, **kwargs) -> str:
    with pytest.raises(InvalidInput) as refused:
        rule(*args, **kwargs)
    return refused.value.message


@pytest.mark.parametrize(("value", "message"), [
    ("", "cannot be empty"),
    ([], "cannot be empty"),
    (["fine", ""], "cannot contain an empty string"),
    ([[101, 102], []], "cannot contain an empty list of token ids"),
])
def test_an_empty_input_is_refused_and_named_where_the_caller_names_it(value, message):
    assert refusal(inputs.no_empty_input, value) == message
    assert refusal(inputs.no_empty_input, value, field="inputs") == f"`inputs` {message}"


def test_inputs_that_are_not_empty_pass_as_given():
    for value in ("text", ["a", "b"], [101, 102], [[101], "text"]):
        assert inputs.no_empty_input(value) is value
    assert inputs.non_empty(["", ""]) == ["", ""]  # the list is not empty: its items are another rule's


def test_a_pair_may_have_one_empty_side_but_not_two():
    inputs.no_empty_pair([("query", ""), ("", "text"), "single", [101]])
    assert refusal(inputs.no_empty_pair, [("q", "t"), ("", "")]) == \
        "input 1 is a pair of two empty texts: a pair needs a text"


def test_rerank_pairs_the_query_with_each_text_and_needs_a_text():
    assert inputs.rerank_pairs("q", ["a", ""]) == [("q", "a"), ("q", "")]
    assert refusal(inputs.rerank_pairs, "q", []) == "`texts` cannot be empty"


def test_a_sequence_is_one_text_or_a_pair():
    assert inputs.sequence(["a"]) == "a"
    assert inputs.sequence(["a", "b"]) == ("a", "b")
    assert inputs.sequence(["", ""]) == ("", "")  # refused as it runs: `no_empty_pair`
    assert refusal(inputs.sequence, [""]) == "`inputs` cannot be empty"
    for texts in ([], ["a", "b", "c"]):
        assert "a flat list is one text or one (text, text) pair, as in TEI" in refusal(inputs.sequence, texts)


@pytest.mark.parametrize(("given", "sequences", "batched"), [
    ("a", ["a"], False),
    (["a"], ["a"], False),
    (["a", "b"], [("a", "b")], False),  # TEI reads a flat list of two as a pair
    ([["a"], ["a", "b"]], ["a", ("a", "b")], True),
    ([["a"]], ["a"], True),
])
def test_predict_takes_teis_shapes(given, sequences, batched):
    assert inputs.predict_sequences(given) == (sequences, batched)


def test_predict_refuses_three_flat_texts_and_malformed_batches():
    assert "a flat list is one text or one (text, text) pair" in refusal(inputs.predict_sequences, ["a", "b", "c"])
    for batch in ([["a", "b", "c"]], [[]], [["a", 1]]):
        assert refusal(inputs.predict_inputs, batch) == \
            "a batch of sequences holds lists of one text or of a pair of texts"
    assert refusal(inputs.predict_inputs, [101, 2023]).startswith("token ids are not accepted here")
    assert refusal(inputs.predict_inputs, 42) == "expected a string or a list of strings"


def test_predict_emptiness_leaves_a_pairs_sides_to_the_pair_rule():
    for value in ([["", ""]], [["a", ""]], ["", ""], ["a", ""]):  # pairs (a flat two: zero-shot's texts)
        assert inputs.no_empty_sequence(value) == value
    for value in ("", [""], [["a"], [""]]):
        assert refusal(inputs.no_empty_sequence, value) in ("cannot be empty", "cannot contain an empty string")


def test_zero_shot_scores_single_texts_none_empty():
    assert inputs.zero_shot_texts("a") == (["a"], False)
    assert inputs.zero_shot_texts(["a", "b", "c"]) == (["a", "b", "c"], True)  # a flat list is texts here
    assert inputs.zero_shot_texts([["a"], ["b"]]) == (["a", "b"], True)
    assert refusal(inputs.zero_shot_texts, [["a", "b"]]) == "zero-shot `labels` score single texts, not pairs"
    assert refusal(inputs.zero_shot_texts, ["a", ""]) == "`inputs` cannot contain an empty string"


def test_token_ids_are_one_input_and_texts_stand_apart():
    assert inputs.one_per_item("a") == ["a"]
    assert inputs.one_per_item([101, 102]) == [[101, 102]]
    assert inputs.one_per_item([[101, 102], "a"]) == [[101, 102], "a"]
    assert inputs.one_per_item(["a", "b"]) == ["a", "b"]
    assert [inputs.is_token_id(value) for value in (3, True, 1.0, "3")] == [True, False, False, False]
    for value in ("a", [101], ["a", [101]], [[101], [102, 103]]):
        assert inputs.texts_or_ids(value) is value
    for value in (42, None, [True], [[101, 1.5]], ["a", 42]):
        assert refusal(inputs.texts_or_ids, value).startswith("expected a string, a list of token ids")


def test_token_ids_lie_in_the_vocabulary():
    inputs.in_vocabulary([0, 29], 30, "token ids")
    assert refusal(inputs.in_vocabulary, [0, 30], 30, "token ids") == "token ids must lie in [0, 30)"
    assert refusal(inputs.in_vocabulary, [-1], 30, "`ids`") == "`ids` must lie in [0, 30)"


@pytest.mark.parametrize(("truncate", "direction", "auto_truncate", "expected"), [
    (None, "Right", True, "right"),  # not said: the server's --auto-truncate
    (None, "Left", True, "left"),
    (None, "Right", False, None),  # --no-auto-truncate: refused (413)
    (False, "Right", True, None),  # said: the request's, whatever the server's
    (True, "left", False, "left"),
    (True, "Right", False, "right"),
])
def test_truncation_is_the_requests_else_the_servers(truncate, direction, auto_truncate, expected):
    assert inputs.truncation(truncate, direction, auto_truncate=auto_truncate) == expected


def test_grpc_truncates_only_where_asked():
    """proto3's `truncate` is false when unset: never None, so --auto-truncate does not apply."""
    assert inputs.truncation(False, "right", auto_truncate=True) is None
    assert inputs.truncation(True) == "right"


def test_dimensions_lie_between_one_and_the_models_width():
    for dimensions in (None, 1, 32):
        inputs.valid_dimensions(dimensions, 32)
    for dimensions in (0, 33):
        assert refusal(inputs.valid_dimensions, dimensions, 32) == \
            f"`dimensions` must be at least 1 and at most the model's 32, got {dimensions}"


def test_ranking_is_best_first_with_ties_in_input_order():
    scores = np.asarray([0.2, 0.9, 0.2, 0.5], dtype=np.float32)
    assert inputs.best_first(scores).tolist() == [1, 3, 0, 2]
    ranks = inputs.ranked_texts(scores, ["a", "b", "c", "d"], return_text=False)
    assert [rank["index"] for rank in ranks] == [1, 3, 0, 2] and set(ranks[0]) == {"index", "score"}
    assert all(isinstance(rank["index"], int) and isinstance(rank["score"], float) for rank in ranks)
    with_text = inputs.ranked_texts(scores, ["a", "b", "c", "d"], return_text=True)
    assert [rank["text"] for rank in with_text] == ["b", "d", "a", "c"]
    assert inputs.ranked_labels(["x", "y"], np.asarray([0.1, 0.7])) == [{"label": "y", "score": 0.7},
                                                                       {"label": "x", "score": 0.1}]


@pytest.mark.parametrize(("schema", "body", "where", "message"), [
    (EmbedRequest, {"inputs": ["fine", ""]}, ("inputs",), "cannot contain an empty string"),
    (OpenAIEmbeddingRequest, {"input": []}, ("input",), "cannot be empty"),
    (ClassifyRequest, {"inputs": [[]]}, ("inputs",), "a batch of sequences holds lists of one text"),
    (ClassifyRequest, {"inputs": "a", "labels": ["x", ""]}, ("labels",), "cannot contain an empty string"),
    (DecodeRequest, {"ids": []}, ("ids",), "cannot be empty"),
])
def test_the_http_schemas_refuse_by_the_same_rules_at_the_field(schema, body, where, message):
    """InvalidInput is a ValueError: raised in a pydantic validator, pydantic reports it at its field."""
    with pytest.raises(ValidationError) as refused:
        schema.model_validate(body)
    error = refused.value.errors()[0]
    assert error["loc"] == where and error["msg"].removeprefix("Value error, ").startswith(message)
