"""Config resolution: presets, overrides, and the errors a user must see."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gapo.algorithms import PRESETS
from gapo.config import AlgorithmConfig
from gapo.configfile import load_config, resolve
from gapo.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# The documented switches of every preset (README's algorithm table, docs/REFERENCE.md). A change here is a change
# of the paper's settings and must be deliberate.
EXPECTED = {
    "grpo": ("token", "fixed", 0.2, 0.2, True, 0.0, "token_mean"),
    "dr_grpo": ("token", "fixed", 0.2, 0.28, False, 0.0, "seq_sum_constant"),
    "dapo": ("token", "fixed", 0.2, 0.28, False, 0.0, "token_mean"),
    "gspo": ("sequence", "fixed", 3e-3, 3e-3, False, 0.0, "token_mean"),
    "f_grpo": ("token", "fixed", 0.2, 0.2, True, 1.0, "token_mean"),
    "f_gspo": ("sequence", "fixed", 3e-3, 5e-3, False, 1.0, "token_mean"),
    "gapo": ("sequence", "adaptive", 3e-3, 5e-3, False, 0.0, "token_mean"),
    "gapo_token": ("token", "adaptive", 0.2, 0.28, False, 0.0, "token_mean"),
    "cispo": ("token", "cispo", 1.0, 4.0, False, 0.0, "token_mean"),
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_resolves_to_documented_switches(name):
    a = resolve({"algorithm": {"name": name}}).algorithm
    assert (a.is_level, a.clip, a.eps_lo, a.upper, a.std_normalize, a.focal_gamma, a.loss_agg) == EXPECTED[name]
    # one shape per rule: the other upper field is null
    assert (a.eps_hi if a.clip == "adaptive" else a.eps_hi_max) is None


def test_presets_cover_exactly_the_documented_algorithms():
    assert set(PRESETS) == set(EXPECTED)


def test_user_switches_win_over_preset():
    a = resolve({"algorithm": {"name": "gspo", "eps_hi": 5e-3}}).algorithm  # GSPO-asym
    assert (a.eps_lo, a.eps_hi, a.eps_hi_max, a.clip) == (3e-3, 5e-3, None, "fixed")
    a = resolve({}, ["algorithm.name=gapo", "algorithm.eps_hi_max=5.25e-3", "algorithm.std_normalize=true"]).algorithm
    assert (a.eps_hi_max, a.std_normalize, a.is_level) == (5.25e-3, True, "sequence")
    a = resolve({}, ["algorithm.name=grpo", "algorithm.focal_gamma=0.5", "algorithm.is_level=sequence"]).algorithm
    assert (a.focal_gamma, a.is_level, a.eps_lo) == (0.5, "sequence", 0.2)


@pytest.mark.parametrize("overrides, needle", [
    (["algorithm.name=gapo", "algorithm.eps_hi=0.01"],
     "algorithm.eps_hi=0.01: the adaptive rule (gapo) has no such bound; its upper bound is algorithm.eps_hi_max"),
    (["algorithm.name=gspo", "algorithm.eps_hi_max=0.007"],
     "algorithm.eps_hi_max=0.007: the fixed rule (gspo) has no such bound; its upper bound is algorithm.eps_hi"),
])
def test_the_other_rules_bound_is_an_error_not_ignored(overrides, needle):
    with pytest.raises(ConfigError, match=re.escape(needle)):
        resolve({}, overrides)


def test_configs_written_with_both_upper_fields_still_resolve():
    """Before each rule had one shape, resolved configs (checkpoints, run directories) carried eps_hi = eps_hi_max."""
    old = {"algorithm": {"name": "gspo", "clip": "fixed", "eps_lo": 3e-3, "eps_hi": 5e-3, "eps_hi_max": 5e-3}}
    assert (resolve(old).algorithm.eps_hi, resolve(old).algorithm.eps_hi_max) == (5e-3, None)
    old = {"algorithm": {"name": "gapo", "clip": "adaptive", "eps_lo": 3e-3, "eps_hi": 5e-3, "eps_hi_max": 5e-3}}
    assert (resolve(old).algorithm.eps_hi, resolve(old).algorithm.eps_hi_max) == (None, 5e-3)


def test_null_defaults_are_filled_once_at_resolve():
    cfg = resolve({"rollout": {"max_new_tokens": 77}, "data": {"instruction": "Box it."}})
    assert (cfg.eval.max_new_tokens, cfg.eval.instruction, cfg.algorithm.loss_constant) == (77, "Box it.", 77.0)
    cfg = resolve({"rollout": {"max_new_tokens": 77}, "eval": {"max_new_tokens": 9, "instruction": ""}})
    assert (cfg.eval.max_new_tokens, cfg.eval.instruction) == (9, "")


def test_batch_shape_is_derived_once_for_a_world_size():
    cfg = load_config("qwen_math")  # 128 prompts x 8, mini-batches of 512, micro-batches of 8
    sh = cfg.shape(8)
    assert (sh.prompts, sh.rollouts, sh.mini, sh.micro, sh.minis, sh.updates, sh.micro_per_mini) == \
        (16, 128, 64, 8, 2, 2, 8)
    with pytest.raises(ConfigError, match="rollout.prompts_per_step=128 must be divisible by the 3 ranks"):
        cfg.shape(3)


def test_dotted_overrides_reach_every_section():
    cfg = resolve({"trainer": {"lr": 1e-6}}, ["trainer.lr=2e-6", "rollout.group_size=4", "tracking.tags=[a, b]",
                                               "trainer.ppo_mini_batch_size=32",
                                               "trainer.output_dir=/tmp/x"])
    assert cfg.trainer.lr == 2e-6 and cfg.rollout.group_size == 4 and cfg.tracking.tags == ["a", "b"]
    assert cfg.trainer.output_dir == "/tmp/x"


def test_dr_grpo_constant_defaults_to_max_new_tokens():
    cfg = resolve({"algorithm": {"name": "dr_grpo"}, "rollout": {"max_new_tokens": 300}})
    assert cfg.algorithm.loss_constant == 300.0


@pytest.mark.parametrize("raw, overrides, needles", [
    ({}, ["algorithm.name=ppo2"], ["algorithm.name", "'ppo2'", "gapo", "gspo"]),
    ({}, ["algorithm.eps_lo=0.01", "algorithm.eps_hi_max=0.005"], ["algorithm.eps_lo=0.01", "eps_hi_max=0.005"]),
    ({}, ["rollout.group_size=1"], ["rollout.group_size", "greater than or equal to 2", "got 1"]),
    ({}, ["trainer.lr=-1e-6"], ["trainer.lr", "greater than 0", "-1e-06"]),
    ({"trainer": {"lrr": 1e-6}}, [], ["trainer.lrr", "unknown key"]),
    ({"trainerr": {}}, [], ["trainerr", "unknown key"]),
    ({}, ["trainer.total_steps=ten"], ["trainer.total_steps", "'ten'"]),
    ({}, ["trainer.ppo_mini_batch_size=48"], ["trainer.ppo_mini_batch_size=48", "64"]),
    ({}, ["algorithm.name=grpo", "algorithm.eps_lo=1.0"], ["algorithm.eps_lo=1.0", "< 1"]),
    ({}, ["trainer.lr"], ["override 'trainer.lr'", "key.path=value"]),
    ({}, ["trainer.lr.x=1"], ["trainer.lr", "valid number"]),
    # the embedded arithmetic set is drawn at config time: a size its levels cannot hold stops here, not in a rank
    ({}, ["data.arithmetic_levels=[add_small]", "data.arithmetic_size=1500"],
     ["data.arithmetic_size=1500", "['add_small']", "only 400"]),
    ({}, ["data.arithmetic_levels=[add_smal]"], ["data.arithmetic_levels=['add_smal']", "mul_small"]),
    # top-p renormalises the engine's log-probs over the nucleus: no ratio may mix them with the trainer's (issue 52)
    ({}, ["rollout.top_p=0.9", "rollout.use_engine_logprobs=true"],
     ["rollout.top_p=0.9", "rollout.use_engine_logprobs=true", "kept mass", "rollout.top_p=1.0"]),
    ({}, ["rollout.top_p=0.9", "algorithm.rollout_correction.mode=truncate"],
     ["rollout.top_p=0.9", "algorithm.rollout_correction.mode=truncate", "kept mass"]),
])
def test_bad_configs_name_key_value_and_rule(raw, overrides, needles):
    with pytest.raises(ConfigError) as e:
        resolve(raw, overrides)
    for needle in needles:
        assert needle in str(e.value), (needle, str(e.value))


def test_top_p_alone_and_either_engine_option_alone_still_resolve():
    """The refusal is of the combinations only: top-p with the trainer's own pi_old, and the engine's log-probs at
    top_p 1, are sound."""
    assert resolve({}, ["rollout.top_p=0.9"]).rollout.top_p == 0.9
    assert resolve({}, ["rollout.use_engine_logprobs=true"]).rollout.use_engine_logprobs
    assert resolve({}, ["algorithm.rollout_correction.mode=mask"]).algorithm.rollout_correction.mode == "mask"


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml.*not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)


def _cli(*args, cwd=ROOT):
    exe = Path(sys.executable).parent / "gapo-train"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, cwd=cwd, timeout=120)


def test_print_config_round_trips_and_works_from_any_directory(tmp_path):
    r = _cli("--config", "tiny_cpu", "--print-config", "algorithm.name=gspo", "trainer.total_steps=7", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    printed = yaml.safe_load(r.stdout)
    assert printed["algorithm"]["name"] == "gspo" and printed["trainer"]["total_steps"] == 7
    assert printed["algorithm"]["is_level"] == "sequence"
    assert resolve(printed).model_dump() == load_config(ROOT / "configs/tiny_cpu.yaml",
                                                        ["algorithm.name=gspo", "trainer.total_steps=7"]).model_dump()


def test_print_config_describes_fields_in_comments(capsys):
    from gapo.cli import train_main

    assert train_main(["--config", "tiny_cpu", "--print-config"]) == 0
    out = capsys.readouterr().out
    rows = out.splitlines()
    at = rows.index("  eps_hi_max: 0.005")
    above = []
    while rows[at - 1 - len(above)].startswith("  # "):
        above.insert(0, rows[at - 1 - len(above)].removeprefix("  # "))
    assert " ".join(above) == AlgorithmConfig.model_fields["eps_hi_max"].description
    assert "  # Dr.GRPO's constant normaliser (tokens per sequence); null = rollout.max_new_tokens." in rows
    assert resolve(yaml.safe_load(out)) == load_config("tiny_cpu")


@pytest.mark.parametrize("name, argv, ranks, why", [
    ("qwen_math", [], 8, "the config's own command"),  # written for 8 GPUs: not planned on one (issue 54)
    ("tiny_cpu", [], 1, "the config's own command"),  # its first line's note ("add --nproc 2") is not its command
    ("qwen_math", ["--nproc", "4"], 4, "as given"),
])
def test_print_config_plans_the_ranks_the_config_is_written_for(capsys, name, argv, ranks, why):
    from gapo.cli import train_main

    assert train_main(["--config", name, "--print-config", *argv]) == 0
    out = capsys.readouterr().out
    assert f"# planned for --nproc {ranks} ({why}" in out
    assert f", {ranks} rank{'s' if ranks > 1 else ''}, " in out
    yaml.safe_load(out)  # still a config file


def test_help_lists_the_described_fields(capsys):
    from gapo.cli import train_main

    with pytest.raises(SystemExit) as e:
        train_main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "--verbose" in out
    at = out.index("\n  algorithm.eps_hi_max\n")
    text = out[at:].split("\n  algorithm.eps_hi_max\n", 1)[1].split("\n  algorithm.")[0]
    assert " ".join(text.split()) == AlgorithmConfig.model_fields["eps_hi_max"].description
    assert "\n  eval.protocol.table\n" in out
    model_path = " ".join(out.split("\n  model.path\n", 1)[1].split("\n  model.")[0].split())
    assert "Hugging Face hub id" in model_path and "Qwen/Qwen2.5-Math-1.5B" in model_path  # not only local folders
    # what a user sets first comes first, each described, and once (issue 54)
    from gapo.cli import FIRST_FIELDS

    first, rest = out.split("The ones set first:", 1)[1].split("\nThe others:\n", 1)
    listed = [line.strip() for line in first.splitlines() if line.startswith("  ") and not line.startswith("   ")]
    assert listed == list(FIRST_FIELDS) and first.count("\n      ") >= len(FIRST_FIELDS)
    assert not any(f"\n  {name}\n" in rest for name in FIRST_FIELDS)
    assert "--resume PATH|auto" in out and "auto: the newest checkpoint" in " ".join(out.split())


def test_overrides_stand_before_and_after_resume(capsys):
    from gapo.cli import train_main

    assert train_main(["--config", "tiny_cpu", "trainer.output_dir=runs/x", "--resume", "runs/x/checkpoints/step_2",
                       "algorithm.name=gspo", "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trainer"]["output_dir"] == "runs/x" and printed["algorithm"]["name"] == "gspo"
    assert printed["trainer"]["resume_from"] == "runs/x/checkpoints/step_2"


def test_cli_reports_config_errors_on_stderr():
    r = _cli("--config", "configs/tiny_cpu.yaml", "--print-config", "algorithm.eps_lo=0.9")
    assert r.returncode == 2 and "algorithm.eps_lo=0.9" in r.stderr and r.stdout == ""


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves_and_opens_with_its_command(path):
    assert path.read_text().startswith("# gapo-train --config"), f"{path.name} must open with its command"
    load_config(path)


def test_base_configs_merge_and_loops_are_refused(tmp_path):
    (tmp_path / "parent.yaml").write_text("trainer:\n  lr: 3.0e-6\n  total_steps: 9\nalgorithm:\n  name: gspo\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\ntrainer:\n  total_steps: 4\n")
    cfg = load_config(tmp_path / "child.yaml")
    assert (cfg.trainer.lr, cfg.trainer.total_steps, cfg.algorithm.name) == (3e-6, 4, "gspo")
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(ConfigError, match="loops back"):
        load_config(tmp_path / "a.yaml")


def test_paper_configs_carry_the_paper_values():
    q = load_config(ROOT / "configs/qwen_math.yaml")
    assert (q.algorithm.name, q.algorithm.eps_lo, q.algorithm.eps_hi_max, q.rollout.group_size) == \
        ("gapo", 3e-3, 5e-3, 8)
    assert (q.rollout.max_new_tokens, q.rollout.temperature, q.algorithm.std_normalize, q.algorithm.kl_coef) == \
        (3092, 1.0, False, 0.0)
    assert len(q.eval.benchmarks) == 6
    r1 = load_config(ROOT / "configs/r1_distill_math.yaml")
    assert (r1.algorithm.eps_lo, r1.algorithm.eps_hi_max, r1.rollout.max_new_tokens, r1.eval.temperature) == \
        (7e-5, 3e-4, 24576, 0.6)
    assert load_config(ROOT / "configs/llama_math.yaml").rollout.max_new_tokens == 8192
    dc = load_config(ROOT / "configs/deepcoder.yaml")
    assert (dc.algorithm.is_level, dc.algorithm.clip, dc.algorithm.eps_lo, dc.algorithm.eps_hi_max, dc.data.type) == \
        ("token", "adaptive", 0.2, 0.28, "code")
    gi = load_config(ROOT / "configs/gspo_intervention.yaml")
    assert (gi.algorithm.name, gi.algorithm.eps_hi) == ("gspo", 5e-3)
    branched = load_config(ROOT / "configs/gspo_intervention.yaml", ["algorithm.name=gapo"]).algorithm
    assert (branched.clip, branched.eps_lo, branched.eps_hi_max) == ("adaptive", 3e-3, 5e-3)


@pytest.mark.parametrize("name, words", [
    ("gapo", "adaptive clip 1 - 3e-3 .. 1 + eps_hi(c), eps_hi from 5e-3 (c = 1) down to 3e-3 (c = k)"),
    ("gspo", "fixed clip 1 - 3e-3 .. 1 + 3e-3"),
    ("dapo", "fixed clip 1 - 0.2 .. 1 + 0.28"),
    ("cispo", "CISPO weight clipped to [1 - 1, 1 + 4]"),
])
def test_one_description_of_each_clip_rule_for_every_display(name, words):
    """The console header, the rehearsal report and gapo-plot all show the rule through describe()."""
    assert resolve({"algorithm": {"name": name}}).algorithm.describe() == words


def test_offload_sets_the_stage_it_needs_and_refuses_what_deepspeed_cannot_do():
    from gapo.configfile import resolve

    one = resolve({"trainer": {"offload": {"optimizer": "cpu"}}})
    assert one.zero_stage(1) == 2 and one.zero_stage(4) == 3  # one rank: ZeRO-Offload's stage; several: as set
    assert resolve({"trainer": {"offload": {"optimizer": "cpu", "params": "cpu"}}}).zero_stage(1) == 3
    with pytest.raises(ConfigError, match="trainer.offload.params=cpu needs trainer.offload.optimizer=cpu"):
        resolve({"trainer": {"offload": {"params": "cpu"}}})
    with pytest.raises(ConfigError, match=r"needs trainer.zero_stage >= 3, not 2"):
        resolve({"trainer": {"zero_stage": 2, "offload": {"optimizer": "cpu", "params": "cpu"}}})
    with pytest.raises(ConfigError, match=r"needs trainer.zero_stage >= 1, not 0"):
        resolve({"trainer": {"zero_stage": 0, "offload": {"optimizer": "cpu"}}})


def test_the_one_gpu_recipe_fits_24_and_48_gb_and_prices_its_host_memory():
    from gapo.memory import GiB, memory_plan, offload_table
    from gapo.models import model_facts

    cfg = load_config("qwen_math_1gpu")
    facts = model_facts(cfg.model.path)
    for gb in (24, 48):
        plan = memory_plan(cfg, facts, world=1, device_gb=gb)
        assert plan.fits(gb) and plan.zero_stage == 2, (gb, plan.total / GiB)
        # fp32 master + Adam moments + fp32 gradients of 1.54 B params, bf16 staging copies, pinned blocks rounded up
        # (tests/test_memory.py has every term by hand)
        assert 30 < plan.host_states / GiB < 34
    full = memory_plan(load_config("qwen_math"), facts, world=1, device_gb=48)
    assert not full.fits(48) and full.host_states == 0
    table = offload_table(cfg, 1, [24.0, 48.0]).splitlines()
    assert any(line.strip().startswith("optimizer (this config)") and line.count("fits") == 2 for line in table)
    assert any(line.strip().startswith("none ") and line.count("NO") == 2 for line in table)


def test_algorithm_names_and_clip_rules_come_from_the_presets_table():
    """algorithm.name accepts exactly the presets of PRESETS (a new preset is one row there), and each preset's
    clip is a rule the loss knows."""
    from typing import get_args

    from gapo.algorithms import PRESETS
    from gapo.clip import RULES

    assert get_args(AlgorithmConfig.model_fields["name"].annotation) == tuple(PRESETS)
    assert {p["clip"] for p in PRESETS.values()} == set(RULES)
    with pytest.raises(Exception, match="gapo_token"):  # the error lists the presets
        AlgorithmConfig(name="ppo")
