"""The sampling and prompt checks shared by router and worker (kvmesh.sampling)."""

from __future__ import annotations

import pytest

from kvmesh.errors import InvalidArgument
from kvmesh.sampling import Sampling, check_prompt, check_sampling, fitted_max_tokens


class TestSampling:
    @pytest.mark.parametrize(
        ("sampling", "match", "field"),
        [
            pytest.param(
                Sampling(max_tokens=0),
                r"max_tokens must be > 0",
                "sampling.max_tokens",
                id="max-tokens-0",
            ),
            pytest.param(
                Sampling(max_tokens=1, temperature=2.5),
                r"temperature must be in \[0, 2\]",
                "sampling.temperature",
                id="temp-high",
            ),
            pytest.param(
                Sampling(max_tokens=1, temperature=-0.1),
                r"temperature",
                "sampling.temperature",
                id="temp-neg",
            ),
            pytest.param(
                Sampling(max_tokens=1, top_p=0.0),
                r"top_p must be in \(0, 1\]",
                "sampling.top_p",
                id="top-p-0",
            ),
            pytest.param(
                Sampling(max_tokens=1, top_p=1.5), r"top_p", "sampling.top_p", id="top-p-high"
            ),
            pytest.param(Sampling(max_tokens=1, top_k=-2), r"top_k", "sampling.top_k", id="top-k"),
            pytest.param(
                Sampling(max_tokens=1, stop=("",)),
                r"empty string",
                "sampling.stop",
                id="empty-stop",
            ),
            pytest.param(
                Sampling(max_tokens=1, stop=("x",) * 17),
                r"at most 16",
                "sampling.stop",
                id="many-stops",
            ),
        ],
    )
    def test_bad_sampling(self, sampling, match, field):
        with pytest.raises(InvalidArgument, match=match) as err:
            check_sampling(sampling)
        assert err.value.field == field

    @pytest.mark.parametrize(
        "sampling",
        [
            Sampling(max_tokens=1),
            Sampling(max_tokens=1, temperature=0.0, top_p=1.0, top_k=-1),
            Sampling(max_tokens=1, temperature=2.0, top_p=0.01, top_k=0),
        ],
        ids=["defaults", "greedy", "edges"],
    )
    def test_good_sampling(self, sampling):
        check_sampling(sampling)

    @pytest.mark.parametrize(
        ("ids", "max_tokens", "match", "field"),
        [
            pytest.param([], 1, "no tokens", "input", id="empty"),
            pytest.param(
                [1, 1024],
                1,
                r"token id 1024 is outside the model's vocabulary \[0, 1024\)",
                "input",
                id="vocab",
            ),
            pytest.param(
                [1] * 100,
                1,
                "prompt has 100 tokens but the model's context is 100",
                "input",
                id="too-long",
            ),
            pytest.param(
                [1] * 90, 20, "lower max_tokens to at most 10", "sampling.max_tokens", id="no-room"
            ),
        ],
    )
    def test_bad_prompt(self, ids, max_tokens, match, field):
        with pytest.raises(InvalidArgument, match=match) as err:
            check_prompt(ids, max_tokens, vocab_size=1024, max_model_len=100)
        assert err.value.field == field

    def test_prompt_that_fits_exactly(self):
        check_prompt([1] * 90, 10, vocab_size=1024, max_model_len=100)

    def test_stop_token_ids_inside_vocab(self):
        with pytest.raises(InvalidArgument, match=r"stop_token_ids has 2000"):
            check_sampling(Sampling(max_tokens=1, stop_token_ids=(1, 2000)), vocab_size=1024)


@pytest.mark.parametrize(
    ("max_tokens", "prompt", "fit", "want"),
    [(32000, 90, True, 10), (5, 90, True, 5), (32000, 90, False, 32000), (8, 100, True, 1)],
    ids=["lowered", "fits", "not-fitted", "no-room"],
)
def test_fitted_max_tokens(max_tokens: int, prompt: int, fit: bool, want: int) -> None:
    """Anthropic's max_tokens is an upper bound: the context's room lowers it (a prompt that
    fills the context stays check_prompt's error)."""
    assert fitted_max_tokens(max_tokens, prompt, 100, fit) == want
