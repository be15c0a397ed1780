"""End to end with the real components: vLLM (CPU), DeepSpeed ZeRO-3 on gloo (1 and 2 ranks), math-verify,
wandb offline. The tiny model is built offline (gapo.models, `tiny-qwen2`)."""

import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gapo.clip import adaptive_eps_hi

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true"}
TIMING = ("time/", "throughput/")


def gapo_train(out: Path, *args: str, nproc: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "gapo-train"), "--config", "configs/tiny_cpu.yaml", "--nproc", str(nproc),
           f"trainer.output_dir={out}", "trainer.total_steps=2", *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def rollouts(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "rollouts.jsonl").read_text().splitlines()]


def wandb_history(run: Path) -> list[dict]:
    """History rows from the offline .wandb file (LevelDB-style log of protobuf records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run / "wandb" / "offline-run-*" / "run-*.wandb"))
    raw, pos, buf, rows = Path(path).read_bytes(), 7, b"", []
    while pos + 7 <= len(raw):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        pos += 7
        if n == 0 and kind == 0:
            pos += left - 7
            continue
        buf, pos = buf + raw[pos:pos + n], pos + n
        if kind in (1, 4):  # FULL or LAST
            rec = pb.Record()
            rec.ParseFromString(buf)
            buf = b""
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


# GAPO with a wide adaptive range (eps_hi from 5e-2 at c = 1 down to 3e-3), so that the second mini-batch's
# IS ratios land between its bounds and GSPO's fixed 3e-3.
WIDE = ["algorithm.eps_lo=3e-3", "algorithm.eps_hi_max=5e-2", "trainer.log_rollouts=true"]
# tiny_cpu starts vLLM uncompiled (eager); these runs take the default compile path (CPU: torch.compile with
# inductor's cache), so that a weight push into a compiled model stays proven (logprob_mismatch after step 1).
COMPILED = "rollout.compile=auto"


# One set of tiny runs, each asserted many ways (issue 46: one gapo-train start costs ~20 s on 2 cores):
# - gapo: the reference; gspo: the same seeds under GSPO's fixed bound;
# - gapo_2ranks: ZeRO-3 on 2 ranks, with uniform groups filtered out of the loss, so that one rank's micro-batch can
#   hold no token while the other's does (test_two_ranks_zero3_with_masked_micro_batches); sampling is unaffected,
#   so its first step is still comparable with gapo's;
# - neutral: gapo's command line plus a rollout correction that changes nothing: equal to gapo to the bit, which
#   also proves that one config gives the same metrics in two processes (test_a_neutral_correction_...).
NEUTRAL = ["algorithm.rollout_correction.mode=reject", "algorithm.rollout_correction.kl_max=1e9"]
RUNS = {"gapo": ([*WIDE, COMPILED], 1), "gapo_2ranks": ([*WIDE, COMPILED, "rollout.filter_uniform_groups=true"], 2),
        "gspo": (["algorithm.name=gspo", "trainer.log_rollouts=true", COMPILED], 1),
        "neutral": ([*WIDE, COMPILED, *NEUTRAL], 1)}


class Runs(dict):
    """name -> its run folder, trained the first time a test asks for it: the fast tier's smoke test asks for gapo
    alone, so `make test` starts one gapo-train instead of four."""

    def __init__(self, once):
        super().__init__()
        self.once = once

    def __missing__(self, name: str) -> Path:
        def train(folder: Path) -> Path:
            args, nproc = RUNS[name]
            r = gapo_train(folder / "run", *args, nproc=nproc)
            (folder / "train.log").write_text(r.stderr)
            errors = "\n".join(line for line in r.stderr.splitlines() if "Error" in line or 'File "' in line)
            assert r.returncode == 0, f"{name} failed (log: {folder / 'train.log'}):\n{errors[-6000:]}"
            return folder / "run"

        return self.once(f"test_engine {name} run", train)


@pytest.fixture(scope="module")
def runs(once) -> Runs:
    return Runs(once)


EXPECTED_KEYS = {"reward/mean", "reward/correct_frac", "reward/timeout_frac", "reward/error_frac",
                 "group/all_correct_frac", "group/all_wrong_frac", "clip_frac", "clip_frac/high", "clip_frac/low",
                 "is_adv_corr", "approx_kl", "response/len_mean", "response/len_max", "response/truncated_frac",
                 "entropy", "grad_norm", "lr", "logprob_mismatch/mean_abs", "logprob_mismatch/max_abs",
                 "logprob_mismatch/is_ratio", "time/generate_s", "time/reward_s", "time/old_logprob_s",
                 "time/train_s", "time/weight_push_s", "throughput/gen_tokens_per_s"}


@pytest.mark.e2e
@pytest.mark.parametrize("name", [pytest.param("gapo", marks=pytest.mark.smoke), "gapo_2ranks"])
def test_run_writes_metrics_config_and_wandb(runs, name):
    run = runs[name]
    rows = metrics(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert EXPECTED_KEYS <= set(row), EXPECTED_KEYS - set(row)
        assert any(k.startswith("clip_frac/c") for k in row)  # the tiny model's groups have 0 < c < k
        assert 0 < row["entropy"] < 6 and row["grad_norm"] > 0  # mean over the step's optimizer steps
    # After a real update and weight push, the engine samples from the trainer's policy (fp32).
    assert rows[1]["logprob_mismatch/max_abs"] < 1e-3
    assert 0 < rows[0]["time/startup_s"] < 600 and "time/startup_s" not in rows[1]  # once per process
    assert rows[1]["approx_kl"] > 0
    cfg = (run / "config.yaml").read_text()
    assert "eps_hi_max: 0.05" in cfg and "name: gapo" in cfg
    history = wandb_history(run)
    assert len(history) == 2 and EXPECTED_KEYS <= set(history[0])
    # each rank its share of the cores (gapo.launch), not torchrun's one thread per rank (issue 52 item 2)
    share = ENV.get("OMP_NUM_THREADS") or str(max(1, len(os.sched_getaffinity(0)) // RUNS[name][1]))
    assert f"threads    {share} per rank (" in (run.parent / "train.log").read_text()
    assert history[1]["reward/mean"] == pytest.approx(rows[1]["reward/mean"])


@pytest.mark.e2e
def test_two_ranks_sample_the_same_first_step(runs):
    """Sampling seeds are per prompt of the step, not per rank: step 1 (same weights) has identical rollouts."""
    one, two = rollouts(runs["gapo"]), rollouts(runs["gapo_2ranks"])
    step1 = lambda rs: [(r["problem"], r["text"], r["reward"]) for r in rs if r["step"] == 1]  # noqa: E731
    assert step1(one) == step1(two)
    assert {r["rank"] for r in two} == {0, 1}


@pytest.mark.e2e
def test_gapo_and_gspo_differ_exactly_where_their_bounds_differ(runs):
    gapo = [r for r in rollouts(runs["gapo"]) if r["step"] == 1]
    gspo = [r for r in rollouts(runs["gspo"]) if r["step"] == 1]
    assert [(r["text"], r["adv"], r["c"]) for r in gapo] == [(r["text"], r["adv"], r["c"]) for r in gspo]
    differ = 0
    for a, b in zip(gapo, gspo, strict=True):
        bound = float(adaptive_eps_hi(max(a["c"], 1), a["k"], 3e-3, 5e-2))  # (c = 0: the bound at c = 1)
        assert a["eps_hi"] == pytest.approx(bound) and b["eps_hi"] == pytest.approx(3e-3)
        (ua,), (ub,) = a["updates"], b["updates"]
        # Same weights until the first clip decision can differ: identical ratios in both runs.
        assert ua["is_ratio"] == pytest.approx(ub["is_ratio"], rel=1e-6)
        r = ua["is_ratio"]
        in_band = a["adv"] > 0 and 1 + 3e-3 < r <= 1 + bound
        assert (ua["clip_hi_tokens"] > 0) == (a["adv"] > 0 and r > 1 + bound)
        assert (ub["clip_hi_tokens"] > 0) == (a["adv"] > 0 and r > 1 + 3e-3)
        assert ((ua["clip_hi_tokens"] > 0) != (ub["clip_hi_tokens"] > 0)) == in_band
        assert ua["clip_lo_tokens"] == ub["clip_lo_tokens"]  # the lower bound is the same
        differ += in_band
    assert differ > 0, "no rollout landed between the two bounds: the comparison proves nothing"
    assert metrics(runs["gapo"])[0]["clip_frac/high"] < metrics(runs["gspo"])[0]["clip_frac/high"]


@pytest.mark.dist
def test_weight_push_matches_trainer_on_each_rank(torchrun):
    """2 ranks, ZeRO-3: after an update and a bucketed push, vLLM's log-probs of fixed sequences (longer than
    one KV block, cached before the push) equal the trainer's, and the HF engine agrees too."""
    for res in torchrun("dist_push_check.py", nproc=2, timeout=600):
        assert res["before"] > 1e-2  # the update changed the policy, so the push had work to do
        assert res["after"] < 1e-4 and res["hf"] < 1e-4, res


@pytest.mark.e2e
def test_hf_engine_trains_end_to_end(tmp_path):
    r = gapo_train(tmp_path / "hf", "rollout.engine=hf", "trainer.total_steps=1", "tracking.mode=disabled")
    assert r.returncode == 0, r.stderr[-4000:]
    (row,) = metrics(tmp_path / "hf")
    assert row["logprob_mismatch/max_abs"] < 1e-3 and row["response/len_mean"] > 0


@pytest.mark.e2e
@pytest.mark.parametrize("args, needle", [
    (["model.path=/no/such/model"], "model.path: '/no/such/model' is neither a directory"),
    (["data.train=/no/such.jsonl"], "data file '/no/such.jsonl' not found"),
    (["algorithm.eps_lo=0.9"], "algorithm.eps_lo=0.9"),
    (["rollout.prompts_per_step=1", "trainer.ppo_mini_batch_size=8"],
     "rollout.prompts_per_step=1 must be divisible by the 2 ranks"),
])
def test_bad_inputs_fail_fast_with_a_message(tmp_path, args, needle):
    nproc = 2 if "prompts" in args[0] else 1
    r = gapo_train(tmp_path / "bad", *args, "tracking.mode=disabled", nproc=nproc, timeout=120)
    assert r.returncode != 0 and needle in r.stderr, r.stderr[-3000:]


@pytest.mark.e2e
def test_a_record_the_rank_refuses_is_named_and_its_log_kept(tmp_path):
    """What only a rank can find (here: a record its rewarder cannot score, under data.on_invalid=error) stops the run
    after its log is in the run folder: exit 2, the message, and where that log is (a record without its prompt
    field is named before, by the launcher: tests/test_bad_input.py)."""
    data = tmp_path / "d.jsonl"
    data.write_text('{"problem": "1+1?", "answer": "2"}\n{"problem": "2+2?", "answer": null}\n')
    r = gapo_train(tmp_path / "bad", f"data.train={data}", "data.on_invalid=error", "tracking.mode=disabled",
                   timeout=120)
    assert r.returncode == 2 and "cannot be scored (data.on_invalid=error)" in r.stderr, r.stderr[-2000:]
    assert f"(log of this failed start: {tmp_path / 'bad' / 'train.log'})" in r.stderr  # kept, and said so


def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path):
    """A directory holding only a metrics log (no checkpoint yet) is refused by a fresh run, and left as it was. In
    this process: the refusal is the first thing a rank does (checkpoint.resume_or_branch), and how gapo-train turns
    such a ConfigError into exit 2 with its message is test_missing_field_in_data_file_is_named's (issue 46: this
    was a gapo-train start of its own)."""
    from gapo.configfile import load_config
    from gapo.errors import ConfigError
    from gapo.trainer.checkpoint import resume_or_branch

    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text('{"step": 1}\n')
    cfg = load_config("tiny_cpu", [f"trainer.output_dir={tmp_path / 'old'}", "trainer.total_steps=2",
                                   "tracking.mode=disabled"])
    with pytest.raises(ConfigError, match="already holds a run: continue it with --resume"):
        resume_or_branch(cfg, world=1, rank=0)
    assert (tmp_path / "old" / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.e2e
def test_other_knobs_run_end_to_end(tmp_path):
    """ZeRO-2, gradient checkpointing, warmup + cosine LR, 2 PPO epochs, reference KL, group filtering,
    truncation masking and engine log-probs as old log-probs, all in one short run."""
    out = tmp_path / "knobs"
    r = gapo_train(out, "trainer.zero_stage=2", "model.gradient_checkpointing=true", "trainer.lr_schedule=cosine",
                   "trainer.warmup_steps=1", "trainer.ppo_epochs=2", "algorithm.kl_coef=0.1",
                   "rollout.filter_uniform_groups=true", "rollout.mask_truncated=true",
                   "rollout.use_engine_logprobs=true", "tracking.mode=disabled")
    assert r.returncode == 0, r.stderr[-4000:]
    one, two = metrics(out)
    # 4 optimizer steps per training step (2 epochs x 2 mini-batches); warmup ends after the first 4,
    # then a cosine over the remaining 4 reaches 0.
    assert one["lr"] == pytest.approx(1e-4) and two["lr"] == pytest.approx(0.0, abs=1e-12)
    assert one["kl_ref"] < 1e-6 < two["kl_ref"]  # the policy starts at the reference and moves away
    assert 0 < two["logprob_mismatch/max_abs"] < 1e-3  # measured on the first update's forwards


@pytest.mark.e2e
def test_two_ranks_zero3_with_masked_micro_batches(runs):
    """Filtering uniform groups leaves some micro-batches with no tokens on one rank and not on the other;
    under ZeRO-3 both ranks must still make the same collective calls (no hang), and the run must finish
    (the fixture asserts exit 0; gapo_2ranks filters)."""
    out = runs["gapo_2ranks"]
    assert "filter_uniform_groups: true" in (out / "config.yaml").read_text()
    recs = rollouts(out)
    by_rank_group = {}
    for x in recs:
        by_rank_group.setdefault((x["step"], x["rank"], x["problem"]), []).append(x["c"])
    uniform = [k for k, cs in by_rank_group.items() if cs[0] in (0, 8)]
    assert uniform and len(uniform) < len(by_rank_group)  # both kinds of groups occurred
    assert len(metrics(out)) == 2


@pytest.mark.dist
@pytest.mark.parametrize("stage, nproc", [(3, 1), (3, 2), (2, 2)])
def test_gradient_accumulates_over_micro_batches_and_ranks(torchrun, stage, nproc):
    """The DeepSpeed step's gradient equals one torch backward over all micro-batches of all ranks.
    (Calling the model around the engine once made ZeRO-3 keep only the last micro-batch's gradient.)"""
    for res in torchrun("dist_grad_check.py", str(stage), nproc=nproc):
        assert res["ds"] == pytest.approx(res["torch"], rel=1e-5)
        assert abs(res["torch"] - res["last_micro_only"]) > 1e-3 * res["torch"]  # the check can tell them apart


@pytest.fixture(scope="module")
def stop_check(once):
    """One vLLM engine (tests/dist/dist_stop_check.py, 1 rank) on a model whose EOS is <|endoftext|> while its chat
    turns end at <|im_end|>; its samples with and without the template's stop tokens, and at top_p 1.0 and 0.9."""
    import shutil

    from conftest import run_torchrun
    from transformers import AutoTokenizer

    from gapo.models import resolve_model

    def make(tmp: Path) -> tuple[dict, Path, int]:
        model = tmp / "base-eos"
        shutil.copytree(resolve_model("tiny-qwen2"), model)
        tok = AutoTokenizer.from_pretrained(model)
        tok.eos_token = "<|endoftext|>"
        tok.save_pretrained(model)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        for name in ("config.json", "generation_config.json"):
            cfg = json.loads((model / name).read_text())
            cfg["eos_token_id"] = eos
            (model / name).write_text(json.dumps(cfg))
        [res] = run_torchrun("dist_stop_check.py", tmp, str(model), nproc=1)
        return res, model, eos

    return once("test_engine stop check", make)


@pytest.mark.dist
def test_generation_stops_at_the_chat_templates_end_of_turn(stop_check):
    """A base model's generation config stops only at <|endoftext|>; the chat turn ends at <|im_end|>. Without
    the template's end-of-turn as a stop token the model writes past its turn (and a last-\\boxed{} reader
    would read what follows); with it, <|im_end|> ends every response that is not truncated."""
    res, _, eos = stop_check
    im_end = res["im_end"]
    assert im_end in res["stop_ids"] and eos in res["stop_ids"]
    past = [ids for ids, _ in res["without"] if im_end in ids[:-1]]
    assert past, "the model never wrote past <|im_end|> without the stop: the test cannot tell"
    for ids, text in res["with"]:
        assert im_end not in ids[:-1] and (ids[-1] in (im_end, eos) or len(ids) == 40), ids
        assert "<|im_end|>" not in text
    assert any(ids[-1] == im_end for ids, _ in res["with"])
    assert res["frames_compiled"] == 0  # an eager engine compiles nothing (~3 s a CPU start: PERFORMANCE.md §13)


@pytest.mark.dist
def test_top_p_engine_logprobs_are_off_by_the_log_of_the_kept_mass(stop_check):
    """Why gapo refuses rollout.top_p < 1 with the engine's log-probs as pi_old or pi_rollout (config.py): vLLM's
    processed log-probs are log-softmax over the tokens top-p keeps, the trainer's over the whole vocabulary. At
    top_p 1 the two agree (fp32); at 0.9 the engine's exceed the trainer's by exactly -log(kept mass) at each
    position, which the trainer's own distribution gives (tokens sorted by probability, kept while the mass before
    them is below p)."""
    from transformers import AutoModelForCausalLM

    res, model_dir, _ = stop_check
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gaps, predicted = {}, {}
    for top_p in (1.0, 0.9):
        gaps[top_p], predicted[top_p] = [], []
        for prompt, response, engine_lp in res[f"top_p {top_p}"]:
            with torch.no_grad():
                logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1:-1]  # T=1
            logp = torch.log_softmax(logits.double(), -1)
            trainer_lp = logp.gather(1, torch.tensor(response)[:, None])[:, 0]
            gaps[top_p] += (torch.tensor(engine_lp, dtype=torch.float64) - trainer_lp).tolist()
            probs, _ = logp.exp().sort(-1, descending=True)
            before = probs.cumsum(-1) - probs  # the mass of the more probable tokens
            predicted[top_p] += (-torch.log((probs * (before < top_p)).sum(-1))).tolist()
    full, nucleus = torch.tensor(gaps[1.0]), torch.tensor(gaps[0.9])
    assert full.abs().max() < 1e-4, full.abs().max()  # no truncation: engine and trainer agree
    assert nucleus.min() > 0 and nucleus.max() > 0.05, nucleus  # the bias the refusal is about, at every token
    assert torch.allclose(nucleus, torch.tensor(predicted[0.9]), atol=1e-3), (nucleus - torch.tensor(predicted[0.9]))


@pytest.mark.e2e
def test_bad_records_are_dropped_and_a_failing_rewarder_costs_only_its_group(tmp_path):
    """A math file with empty, null, half-empty and blank answers mixed in: the run names what it dropped before
    step 1 and trains on the rest; a rewarder that raises for one problem mid-step (injected) turns that group's
    rollouts into status error with no gradient, and the step completes."""
    from gapo.data import arithmetic_problems

    good = [{"id": p.uid, "problem": p.question, "answer": p.gold}
            for p in arithmetic_problems(8, seed=31, levels=["add_small"])]
    bad = [{"id": "empty", "problem": "1 + 1?", "answer": ""}, {"id": "null", "problem": "1 + 2?", "answer": None},
           {"id": "half", "problem": "1 + 3?", "answer": ["4", ""]},
           {"id": "blank", "problem": "1 + 4?", "answer": " "}]
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(x) + "\n" for x in bad[:2] + good[:4] + bad[2:] + good[4:]))
    out, victim = tmp_path / "run", good[5]["id"]
    cmd = [str(BIN / "gapo-train"), "--config", "configs/tiny_cpu.yaml", f"trainer.output_dir={out}",
           "trainer.total_steps=2", f"data.train={data}", "trainer.log_rollouts=true", "tracking.mode=disabled",
           "trainer.ppo_epochs=2"]  # the second epoch's updates are off-policy for every rollout
    r = subprocess.run(cmd, cwd=ROOT, env={**ENV, "GAPO_FAULT": f"score_raise:{victim}"}, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "data.train: dropped 4 of 12 records (empty answer: 3, no answer: 1); trains on the other 8" in r.stderr
    assert f"dropped    4 records before training: {out / 'dropped_records.jsonl'}" in r.stderr
    dropped = [json.loads(x) for x in (out / "dropped_records.jsonl").read_text().splitlines()]
    assert [(x["uid"], x["reason"]) for x in dropped] == [("empty", "empty answer"), ("null", "no answer"),
                                                          ("half", "empty answer"), ("blank", "empty answer")]
    rows = metrics(out)
    assert sorted(row["reward/error_frac"] for row in rows) == [0.0, 8 / 32]  # 2 steps x 4 prompts: each problem once
    failed = [x for x in rollouts(out) if x["problem"] == victim]
    assert len(failed) == 8 and {x["status"] for x in failed} == {"error"}
    # No gradient: none of its tokens is in the loss, so its ratio stays exactly 1 through every update.
    assert all(u["is_ratio"] == 1.0 and u["clip_hi_tokens"] == 0 for x in failed for u in x["updates"])
    moved = [u["is_ratio"] for x in rollouts(out) if x["problem"] != victim for u in x["updates"][1:]]
    assert moved and any(v != 1.0 for v in moved)


@pytest.mark.e2e
def test_a_masking_correction_in_bf16_changes_only_the_loss(tmp_path):
    """bf16 trainer and bf16 vLLM, token-level masking with a band tight enough to mask some tokens: the
    correction's metrics are in metrics.jsonl, the old-log-prob pass and the first update still agree exactly
    (both project the same tokens; only the loss leaves the masked ones out), and step 1, whose rollouts and
    old log-probs precede any update, reads the same entropy and mismatch as the uncorrected run."""
    runs = {}
    for mode in ("off", "mask"):
        out = tmp_path / mode
        r = gapo_train(out, "model.dtype=bfloat16", f"algorithm.rollout_correction.mode={mode}",
                       "algorithm.rollout_correction.mask_low=0.995", "algorithm.rollout_correction.mask_high=1.005")
        assert r.returncode == 0, r.stderr[-4000:]
        runs[mode] = metrics(out)
    off, masked = runs["off"], runs["mask"]
    assert "rollout_is/masked_token_frac" not in off[0]
    for row in masked:
        assert 0 < row["rollout_is/masked_token_frac"] < 1, row["rollout_is/masked_token_frac"]
        assert row["first_minibatch/max_abs_log_ratio"] == 0.0
        assert row["logprob_mismatch/kl_k3"] > 0  # bf16 on both sides still disagrees
    for key in ("entropy", "logprob_mismatch/kl_k1", "logprob_mismatch/kl_k3", "reward/mean", "response/len_mean"):
        assert masked[0][key] == off[0][key], key


@pytest.mark.e2e
def test_a_neutral_correction_trains_exactly_as_none(runs):
    """The rollout-correction code path with weights of exactly 1 and nothing masked (reject, kl_max huge) gives
    the metrics of the run without it, to the bit: weights, masking and the normaliser change nothing they should
    not. Its own metrics say it kept every token. Being another process with the same seeds, it also proves that
    the same config gives the same metrics (every one but the timings; gapo logs no rollout_is/ key): a run that
    is not deterministic fails here (this replaced a second plain gapo run, issue 46)."""
    out = runs["neutral"]
    strip = lambda rows: [{k: v for k, v in x.items() if not k.startswith((*TIMING, "rollout_is/"))}  # noqa: E731
                          for x in rows]
    assert not any(k.startswith("rollout_is/") for row in metrics(runs["gapo"]) for k in row)
    assert [x["step"] for x in metrics(out)] == [1, 2]
    assert strip(metrics(out)) == strip(metrics(runs["gapo"]))
    for row in metrics(out):
        assert row["rollout_is/masked_token_frac"] == 0.0 and row["rollout_is/weight_max"] == 1.0
        assert row["logprob_mismatch/kl_k3"] >= 0 and "logprob_mismatch/pos5" in row
