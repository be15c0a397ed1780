"""The step's per-c metrics (gapo/trainer/step_metrics.py) under the keys gapo-plot and gapo-compare read back
(gapo.rundir.per_c / logged_cs: one owner for the key format)."""

import torch

from gapo.rundir import logged_cs, per_c
from gapo.trainer.losses import RolloutStats
from gapo.trainer.step_metrics import loss_metrics


def test_per_c_keys_round_trip_and_ignore_their_neighbours():
    keys = [per_c("clip_frac", c) for c in (10, 1, 3)] + ["clip_frac/high", "clip_frac", "is_ratio/c2", "clip_frac/cx"]
    assert logged_cs("clip_frac", keys) == [1, 3, 10] and logged_cs("is_ratio", keys) == [2]
    assert per_c("clip_units", 4) == "clip_units/c4"


def test_sequence_clip_fractions_by_c_are_logged_where_the_readers_look():
    # six correct rollouts: c = 1 (one, clipped), c = 3 (two, one clipped), c = 6 (three, none); two incorrect
    c = torch.tensor([1, 3, 3, 6, 6, 6, 3, 6])
    adv = torch.tensor([0.875, 0.625, 0.625, 0.25, 0.25, 0.25, -0.375, -0.75])
    hi = torch.tensor([4.0, 0, 2, 0, 0, 0, 0, 0])
    s = RolloutStats(seq_log_ratio=torch.tensor([0.02, 0.0, 0.01, 0.0, -0.001, 0.001, 0.0, 0.0]), adv=adv, c=c,
                     k=torch.full((8,), 8), n_tokens=torch.full((8,), 5.0), clip_hi_tokens=hi,
                     clip_lo_tokens=torch.zeros(8), kl_sum=torch.zeros(8))
    out = loss_metrics(s, "sequence")
    assert logged_cs("clip_frac", out) == logged_cs("clip_units", out) == logged_cs("is_ratio", out) == [1, 3, 6]
    assert [out[per_c("clip_frac", x)] for x in (1, 3, 6)] == [1.0, 0.5, 0.0]
    assert [out[per_c("n_correct", x)] for x in (1, 3, 6)] == [1.0, 2.0, 3.0]
    # the float32 log ratio, exponentiated in float64
    assert out[per_c("is_ratio", 1)] == torch.exp(torch.tensor(0.02).double()).item()
