"""SamplingParams and StructuredOutputsParams refuse a bad value with a message that names the
field and its range, and accept every value at the edge of that range (the server turns the
message into a 400, so its text is what a client reads)."""

import math
import re

import pytest

from ostinato.sampling_params import SamplingParams, StructuredOutputsParams


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0, got -0.1"),
        ({"temperature": math.nan}, "temperature must be a finite number >= 0, got nan"),
        ({"temperature": math.inf}, "temperature must be a finite number >= 0, got inf"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"top_p": 1.01}, "top_p must be in (0, 1], got 1.01"),
        ({"top_k": 0}, "top_k must be -1 (all) or >= 1, got 0"),
        ({"top_k": -2}, "top_k must be -1 (all) or >= 1, got -2"),
        ({"min_p": -0.1}, "min_p must be in [0, 1], got -0.1"),
        ({"max_tokens": 0}, "max_tokens must be at least 1, got 0"),
        ({"min_tokens": -1}, "min_tokens must be in [0, max_tokens=64], got -1"),
        ({"presence_penalty": -2.01}, "presence_penalty must be in [-2, 2], got -2.01"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be > 0, got inf"),
        ({"seed": -(2**63) - 1}, f"seed must fit in 64 bits, got {-(2**63) - 1}"),
        ({"seed": 2**64}, f"seed must fit in 64 bits, got {2**64}"),
        ({"logprobs": -1}, "logprobs must be >= 0, got -1"),
        ({"logit_bias": {3: -100.5}}, "logit_bias values must be in [-100, 100], got -100.5 "
                                      "for token 3"),
        ({"structured_outputs": {"json": {}}}, "structured_outputs must be a "
                                               "StructuredOutputsParams"),
        ({"stop": ["end", ""]}, "stop strings must not be empty"),
        ({"stop": ""}, "stop strings must not be empty"),
    ],
)  # fmt: skip
def test_a_bad_value_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"top_p": 1.0},
        {"top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"max_tokens": 1},
        {"min_tokens": 64, "max_tokens": 64},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": -2.0},
        {"seed": -(2**63)},
        {"seed": 2**64 - 1},
        {"logprobs": 0, "prompt_logprobs": 0},
        {"stop_token_ids": [0]},
        {"logit_bias": {0: -100.0, 1: 100.0}},
        {"structured_outputs": StructuredOutputsParams(regex="a+")},
    ],
)
def test_every_value_at_the_edge_of_its_range_is_taken(kwargs):
    params = SamplingParams(**kwargs)
    assert all(getattr(params, name) == value for name, value in kwargs.items())


def test_one_stop_string_becomes_a_list_and_bias_keys_become_ids():
    params = SamplingParams(stop="###", logit_bias={"7": 2})
    assert params.stop == ["###"]
    assert params.logit_bias == {7: 2.0} and params.token_ids() == [7]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "structured_outputs: give exactly one of json, json_object, regex, choice, grammar"),
        ({"json": "{}", "regex": "a"}, "structured_outputs: give exactly one of json, "
                                       "json_object, regex, choice, grammar, not json and regex"),
        ({"choice": []}, "structured_outputs: choice must be a list of non-empty strings"),
        ({"choice": ["yes", ""]}, "structured_outputs: choice must be a list of non-empty strings"),
        ({"choice": ["yes", 1]}, "structured_outputs: choice must be a list of non-empty strings"),
    ],
)  # fmt: skip
def test_structured_outputs_take_exactly_one_constraint(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        StructuredOutputsParams(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "kind"),
    [({"json_object": True}, "json_object"), ({"choice": ["a", "b"]}, "choice"),
     ({"grammar": "start: /a/"}, "grammar"), ({"json": {"type": "object"}}, "json")],
)  # fmt: skip
def test_a_constraints_kind_is_the_one_given(kwargs, kind):
    assert StructuredOutputsParams(**kwargs).kind == kind
