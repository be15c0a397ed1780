"""Micro-batches by token budget: the packing rule, and the invariance that makes it safe (the step's gradient
does not depend on how its rollouts are split, over 1 and 2 ranks, ZeRO-2 and ZeRO-3)."""

import pytest

from gapo.configfile import resolve
from gapo.errors import ConfigError
from gapo.trainer.logprobs import micro_batch_rows


def test_by_count_is_consecutive_runs():
    assert micro_batch_rows([5] * 7, 3, None) == [[0, 1, 2], [3, 4, 5], [6]]


def test_by_budget_longest_first_within_rows_times_longest():
    lengths = [10, 100, 30, 30, 90, 10, 10, 10]
    bins = micro_batch_rows(lengths, 8, 200)
    assert bins == [[1, 4], [2, 3, 0, 5, 6, 7]]  # 2 x 100 <= 200; 6 x 30 <= 200, a 7th would not fit
    assert all(len(b) * max(lengths[i] for i in b) <= 200 for b in bins)
    assert micro_batch_rows(lengths, 3, 200) == [[1, 4], [2, 3, 0], [5, 6, 7]]  # the row cap still holds


def test_a_rank_that_needs_fewer_micro_batches_splits_its_largest():
    bins = micro_batch_rows([10] * 8, 8, 1000, count=3)
    assert sorted(len(b) for b in bins) == [2, 2, 4] and sorted(i for b in bins for i in b) == list(range(8))
    with pytest.raises(ValueError, match="cannot split 2 rollouts into 3"):
        micro_batch_rows([10, 10], 8, 1000, count=3)


def test_a_budget_that_cannot_hold_one_rollout_is_refused():
    with pytest.raises(ConfigError, match="max_tokens_per_micro_batch=100 must hold one rollout .* 768"):
        resolve({"data": {"max_prompt_tokens": 512}, "rollout": {"max_new_tokens": 256},
                 "trainer": {"max_tokens_per_micro_batch": 100}})


@pytest.mark.dist
@pytest.mark.parametrize("stage, nproc", [(3, 1), (2, 2), (3, 2)])
def test_gradient_is_the_same_whatever_the_split(torchrun, stage, nproc):
    results = torchrun("dist_budget_check.py", str(stage), nproc=nproc)
    for res in results:
        for name in ("count_4", "budget_48", "budget_120"):
            assert res[name]["norm"] == pytest.approx(res["torch"], rel=1e-5), (name, res)
            assert res[name]["rows"] == list(range(16 // nproc))  # every rollout exactly once
        assert res["budget_120"]["padded"] < res["count_4"]["padded"]  # sorting by length cuts padding
    if nproc == 2:  # the long shard needs more micro-batches by budget; both ranks ran the larger count
        assert results[0]["budget_48"]["local_count"] > results[1]["budget_48"]["local_count"]
        assert results[0]["budget_48"]["count"] == results[1]["budget_48"]["count"]


@pytest.mark.dist
def test_prompt_sharing_is_decided_by_all_ranks(torchrun):
    """A micro-batch shares its prompts' KV cache only when it can on every rank: under ZeRO-3 a rank running
    the decoder twice while the other runs it once would diverge in its collectives (hang or trace assertion)."""
    res = torchrun("dist_share_check.py", nproc=2, timeout=300)
    assert [r["mixed"]["shared"] for r in res] == [False, False]
    assert [r["both"]["shared"] for r in res] == [True, True]
    assert all(r[case]["grad_norm"] > 0 for r in res for case in ("mixed", "both"))
