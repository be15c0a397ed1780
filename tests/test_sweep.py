"""Experiment manifests: every paper table and figure as runs x seeds, their commands, the SLURM scripts, the kept
checkpoints, the evaluation of a run's checkpoints, and the table built from it. The chain (sweep -> evaluate ->
table) runs end to end on the tiny manifest, and the intervention manifest rehearses parent -> kept checkpoint ->
branch."""

import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pydantic
import pytest

from gapo.configfile import load_config
from gapo.errors import ConfigError
from gapo.study import slurm
from gapo.study.manifest import EXPERIMENTS_DIR, graph, jobs, load_manifest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ENV = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "WANDB_SILENT": "true", "HF_HUB_OFFLINE": "1"}
MANIFESTS = sorted(p.stem for p in EXPERIMENTS_DIR.glob("*.yaml"))
PAPER = {"table1_r1": "Table 1", "table2_deepcoder": "Table 2", "table3_qwen": "Table 3 (Qwen", "table3_llama":
         "Table 3 (Llama", "table8_eps_hi_max": "Table 8", "fig6_group_size": "Fig. 6", "fig7_intervention": "Fig. 7"}


def sweep(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "gapo-sweep"), *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_every_paper_table_and_figure_has_a_manifest():
    for name, what in PAPER.items():
        assert what in load_manifest(name).produces, name


@pytest.mark.parametrize("name", MANIFESTS)
def test_every_manifest_resolves_each_command(name, capsys):
    """Each command is resolved as gapo-train would (a typo fails here), its output directory is its own, and the
    evaluated steps and branch points are kept from pruning."""
    from gapo.study.sweep import main

    assert main([name, "--print"]) == 0
    lines = capsys.readouterr().out.splitlines()
    m = load_manifest(name)
    assert len(lines) == len(m.runs) * len(m.seeds)
    outs = []
    for line in lines:
        words = shlex.split(line)
        over = [w for w in words if "=" in w and not w.startswith("-")]
        resume = words[words.index("--resume") + 1] if "--resume" in words else None
        cfg = load_config(words[2], over + ([f"trainer.resume_from={resume}"] if resume else []))
        outs.append(cfg.trainer.output_dir)
        assert set(m.eval.steps) <= set(cfg.trainer.keep_steps)
        # its own, or the run of the manifest it uses (runs.use: Table 3's runs in Table 8 and Figs. 6, 7)
        owners = {name} | {r.use.split("/")[0] for r in m.runs if r.use}
        roots = [f"{Path(load_manifest(owner).output_root) / owner}/" for owner in owners]
        assert any(cfg.trainer.output_dir.startswith(root) for root in roots), cfg.trainer.output_dir
    assert len(set(outs)) == len(outs)


def test_table3_qwen_lists_its_methods_times_three_seeds():
    m = load_manifest("table3_qwen")
    js = jobs(m)
    rows = {(j.label, load_config(j.config, j.args).algorithm.name) for j in js}
    assert len(js) == 8 * 3 and len(rows) == 8  # Table 3's eight Qwen rows
    algos = {load_config(j.config, j.args).algorithm.model_dump(include={"name", "eps_lo", "eps_hi", "eps_hi_max"})
             .__repr__() for j in js}
    assert len(algos) == 8
    assert sorted({j.seed for j in js}) == [0, 1, 2]


def test_paper_page_and_manifest_commands_never_share_an_output_directory():
    from test_paper_configs import paper_page_commands

    dirs = {}
    for config, overrides in paper_page_commands():
        resume = [o for o in overrides if o.startswith("trainer.resume_from")]
        d = load_config(config, overrides).trainer.output_dir if not resume else None
        if d:
            assert d not in dirs, (config, overrides, dirs.get(d))
            dirs[d] = (config, overrides)
    for name in MANIFESTS:
        for j in jobs(load_manifest(name)):
            if j.shared:  # the other manifest's run itself, met there
                continue
            d = str(j.out)
            assert d not in dirs, (name, j.run.name, dirs.get(d))
            dirs[d] = (name, j.run.name)


def test_weights_only_checkpoints_are_refused_to_a_run_that_others_branch_from(tmp_path):
    """trainer.save_only_model given to a sweep with an intervention: the parent's branch point would hold only
    weights, which no branch can resume; gapo-sweep's check says so before any run (the branch itself may use it).
    (A parent another manifest owns, as fig7_intervention's, keeps whatever its own sweep was given.)"""
    from gapo.study.manifest import check

    m = load_manifest("tiny_cluster")
    slim = m.model_copy(update={"runs": [r.model_copy(update={"overrides": [*r.overrides, "trainer.save_only_model="
                                                                             "true"]}) for r in m.runs]})
    parent = next(b.branch.run for b in m.runs if b.branch)
    with pytest.raises(ConfigError, match=rf"run {parent}: trainer.save_only_model=true, but run\(s\) \S+ branch from"):
        check(slim, jobs(slim, tmp_path))
    check(m, jobs(m, tmp_path))


def test_a_branch_is_evaluated_after_its_branch_point_and_reads_its_parents_before(tmp_path):
    """The intervention's branch starts at GSPO's step 600 and saves no step 600 of its own: its evaluation asks only
    for its later checkpoints, and the table reads step 600 (the same weights) from the parent's evaluation."""
    from gapo.study.manifest import eval_commands
    from gapo.study.tables import results

    m = load_manifest("fig7_intervention")
    js = jobs(m, tmp_path)
    steps_of = {}
    for together in (False, True):
        for cmd in eval_commands(m, js, together=together):
            steps = cmd[cmd.index("--steps") + 1]
            runs = cmd[cmd.index("--run") + 1:cmd.index("--steps")]
            for run in runs:
                steps_of[(together, Path(run).parts[-2])] = steps
    for together in (False, True):
        assert steps_of[(together, "gspo_asym")] == "600,700,800,900,1000"
        assert steps_of[(together, "gapo_from_600")] == "700,800,900,1000"
    for j in js:
        for step in j.own_steps(m.eval.steps):
            d = j.out / "eval" / m.protocol_name / f"step_{step:06d}"
            d.mkdir(parents=True)
            v = step / 10_000 + (0.5 if j.parent else 0.0)
            (d / "results.json").write_text(json.dumps({"meta": {}, "metrics": {"val/mean/pass@1": v}}))
    found = results(m, js)
    for seed in m.seeds:
        assert found[("gapo_from_600", seed)][600] == found[("gspo_asym", seed)][600] == {"val/mean/pass@1": 0.06}
        assert found[("gapo_from_600", seed)][700] == {"val/mean/pass@1": 700 / 10_000 + 0.5}
    from gapo.study.tables import write

    md = write(m, tmp_path).read_text()
    assert "## Missing" not in md and (tmp_path / "fig7_intervention" / "compare" / "branch.png").is_file()


def test_fig6_varies_k_alone_prompts_and_updates_per_step_fixed():
    """Fig. 6 changes only k: every run draws the same prompts a step and takes as many optimizer steps on them (at
    least two, so that something is off-policy and can clip); the rollouts grow with k."""
    m = load_manifest("fig6_group_size")
    shapes = {}
    for j in jobs(m):
        cfg = load_config(j.config, j.args)
        rollouts = cfg.rollout.prompts_per_step * cfg.rollout.group_size
        updates = rollouts // cfg.trainer.ppo_mini_batch_size * cfg.trainer.ppo_epochs
        shapes[cfg.rollout.group_size] = (cfg.rollout.prompts_per_step, updates, rollouts)
    assert sorted(shapes) == [4, 8, 16]
    assert {(p, u) for p, u, _ in shapes.values()} == {(128, 2)}, shapes
    assert [shapes[k][2] for k in (4, 8, 16)] == [512, 1024, 2048]


def test_fig6_is_drawn_against_k_from_the_evaluations(tmp_path):
    from gapo.study.tables import fig_vs_group_size, results

    m = load_manifest("fig6_group_size")
    js = jobs(m, tmp_path)
    for j in js:
        d = j.out / "eval" / m.protocol_name / "step_001000"
        d.mkdir(parents=True)
        v = 0.3 + 0.01 * j.seed + (0.05 if j.run.name.startswith("gapo") else 0.0)
        (d / "results.json").write_text(json.dumps({"meta": {}, "metrics": {"val/mean/pass@1": v}}))
    fig = fig_vs_group_size(m, js, results(m, js))
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert sorted(lines) == ["GAPO", "GSPO"]
    assert list(lines["GAPO"].get_xdata()) == [4, 8, 16]
    assert list(lines["GAPO"].get_ydata()) == pytest.approx([0.36] * 3)  # the mean over seeds 0, 1, 2


def test_the_base_row_is_one_evaluation_of_the_configs_model():
    """Tables 1 and 2's Base column: the config's model before training, once (no seeds), under the protocol."""
    from gapo.study.manifest import base_results, eval_commands

    m = load_manifest("table1_r1")
    js = jobs(m)
    base = [c for c in eval_commands(m, js) if "--model" in c]
    assert len(base) == 1
    cmd = base[0]
    model = load_config(m.config).model
    assert cmd[cmd.index("--model") + 1] == model.path and cmd[cmd.index("--config") + 1] == m.eval.protocol
    assert cmd[cmd.index("--dtype") + 1] == model.dtype and cmd[cmd.index("--out") + 1] == str(base_results(m, js))


def test_an_unnamed_output_directory_comes_from_the_config_the_method_and_the_seed():
    dirs = {load_config("qwen_math", args).trainer.output_dir for args in (
        [], ["trainer.seed=1"], ["algorithm.name=gspo"], ["algorithm.name=gspo", "trainer.seed=1"],
        ["algorithm.name=gspo", "algorithm.eps_hi=5e-3"])}
    assert dirs == {"runs/qwen_math/gapo/seed0", "runs/qwen_math/gapo/seed1", "runs/qwen_math/gspo/seed0",
                    "runs/qwen_math/gspo/seed1", "runs/qwen_math/gspo-eps_hi5e-3/seed0"}


def test_slurm_scripts_parse_and_branches_wait_for_their_parents(tmp_path):
    m = load_manifest("fig7_intervention")
    written = slurm.render(m, graph(m, jobs(m)), tmp_path, Path.cwd())
    assert [p.name for p in written] == ["fig7_intervention.runs.sbatch", "fig7_intervention.branches.sbatch",
                                         "fig7_intervention.eval.sbatch", "submit.sh"]
    for p in written:
        r = subprocess.run(["bash", "-n", str(p)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    runs, branches, ev, submit = (p.read_text() for p in written)
    assert "#SBATCH --array=0-2" in runs and "#SBATCH --requeue" in runs and "--gpus-per-node=8" in runs
    assert "#SBATCH --cpus-per-task=32" in runs and "#SBATCH --time" not in runs  # 4 per rank; the partition's
    # Each branch task waits for its own parent's task, and each evaluation for its run's training.
    assert "aftercorr" not in submit
    for seed in range(3):
        assert f"--array={seed} --job-name=fig7_intervention-gapo_from_600-seed{seed} " \
               f"--dependency=afterok:${{RUNS}}_{seed} " in submit
        assert f"--array={3 + seed} --dependency=afterok:${{B{seed}}}_{seed} " in submit
    # A branch task starts from its parent's step-600 checkpoint, a requeued one from its own latest.
    assert "runs/table3_qwen/gspo_asym/seed1/checkpoints/step_000600" in branches  # Table 3's run (runs.use)
    assert 'RESUME=(--resume auto)' in branches and "--signal=USR1@300" in runs
    assert 'scontrol requeue "$SLURM_JOB_ID"' in runs  # a preempted task (exit 75)
    assert "#SBATCH --signal=B:USR1@300" in ev and "--steps 600,700,800,900,1000" in ev


def test_slurm_scripts_hold_from_any_folder_and_take_the_schedulers_options(tmp_path, monkeypatch):
    """Paths are absolute (the log folder, the scripts) or relative to --chdir, the folder gapo-sweep ran in;
    submit.sh creates the log folder; a CPU manifest asks for no GPU and for its own CPUs; the command line's
    --partition, --time, ... go over the manifest's slurm: block; two parents and a branch of the second: the
    branch waits for task 1."""
    from gapo.study.sweep import main

    monkeypatch.chdir(tmp_path)
    assert main(["tiny_cluster", "--slurm", "--partition", "cpu", "--account", "lab", "--qos", "low", "--mem",
                 "4G", "--constraint", "zen"]) == 0
    d = tmp_path / "runs" / "tiny_cluster" / "slurm"
    runs, ev, submit = ((d / f).read_text() for f in ("tiny_cluster.runs.sbatch", "tiny_cluster.eval.sbatch",
                                                       "submit.sh"))
    for text in (runs, ev):
        assert f"#SBATCH --chdir={tmp_path}\n" in text and f"#SBATCH --output={d}/logs/%x-%A_%a.out" in text
        assert "--gpus-per-node" not in text and "#SBATCH --cpus-per-task=2\n" in text
        for line in ("--partition=cpu", "--account=lab", "--qos=low", "--mem=4G", "--constraint=zen"):
            assert f"#SBATCH {line}\n" in text
    assert "#SBATCH --time=0:30:00\n" in runs and "#SBATCH --time=0:20:00\n" in ev  # the manifest's
    assert 'srun --cpus-per-task="$SLURM_CPUS_PER_TASK"' in runs and 'srun --cpus-per-task="$SLURM_CPUS_PER_TASK"' in ev
    assert '--rdzv_endpoint "$HEAD:$PORT"' in runs and "29500" not in runs
    assert f"mkdir -p {d}/logs" in submit and "cd " not in submit and f"submit {d}/tiny_cluster.runs.sbatch" in submit
    assert "--dependency=afterok:${RUNS}_1 " in submit and "B0=$(submit --array=0 " in submit
    assert main(["tiny_cluster", "--slurm", "--time", "2:00:00"]) == 0
    assert "#SBATCH --time=2:00:00\n" in (d / "tiny_cluster.runs.sbatch").read_text()
    assert main(["tiny_cluster", "--eval", "--slurm"]) == 0
    sub = (d / "submit_eval.sh").read_text()
    assert "dependency" not in sub and f"EVAL=$(submit {d}/tiny_cluster.eval.sbatch)" in sub


def test_a_signal_lead_shorter_than_the_preemption_deadline_is_refused(tmp_path, capsys):
    from gapo.study.sweep import main

    f = tmp_path / "m.yaml"
    f.write_text((EXPERIMENTS_DIR / "tiny_cpu.yaml").read_text().replace("cpus_per_task: 2}",
                                                                         "cpus_per_task: 2, signal_lead_s: 200}"))
    m = load_manifest(f)
    with pytest.raises(ConfigError, match=r"slurm.signal_lead_s=200 must exceed run gapo's "
                                          r"trainer.preempt_deadline_s=240"):
        slurm.check(m, jobs(m))
    assert main([str(f), "--print"]) == 2  # gapo-sweep asks every scheduler in its table, whichever mode
    assert "slurm.signal_lead_s=200 must exceed" in capsys.readouterr().err


def test_a_schedulers_block_is_its_own_and_gapo_sweep_refuses_one_no_scheduler_reads(tmp_path, capsys):
    from gapo.study.sweep import main

    good = (EXPERIMENTS_DIR / "tiny_cpu.yaml").read_text()
    f = tmp_path / "m.yaml"
    for old, new, needle in [("slurm: {", "slrum: {", "slrum: not a manifest field (name, title, produces, config, "
                                                      "nproc, nodes, seeds, output_root, runs, base, eval, compare) "
                                                      "nor a scheduler's block (slurm)"),
                             ("cpus_per_task: 2}", "cpus_per_tasks: 2}", "slurm.cpus_per_tasks: Extra inputs"),
                             ("cpus_per_task: 2}", "cpus_per_task: 0}", "slurm.cpus_per_task: Input should be "
                                                                        "greater than or equal to 1")]:
        f.write_text(good.replace(old, new))
        assert main([str(f), "--slurm", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert needle in err, (new, err)
        assert not (tmp_path / "out").exists()
    f.write_text(good.replace("slurm: {gpus_per_node: 0, cpus_per_task: 2}", "slurm: 2"))
    with pytest.raises(ConfigError, match="slurm: not a manifest field .* is a mapping"):
        load_manifest(f)
    assert main(["tiny_cpu", "--print", "--partition", "x"]) == 2
    assert "--partition goes with --slurm" in capsys.readouterr().err
    # a misspelt field is no scheduler's block: gapo-compare table refuses it too
    f.write_text(good.replace("compare:", "comparison:"))
    from gapo.study.compare import main as compare_main

    assert compare_main(["table", str(f)]) == 2
    assert "comparison: not a manifest field (name, title" in capsys.readouterr().err


def test_gapo_sweep_refuses_a_transport_no_row_has(tmp_path, capsys):
    """config.py cannot read gapo.rollout's transport table: the sweep's check does, as gapo-train's does."""
    from gapo.study.sweep import main

    f = tmp_path / "m.yaml"
    f.write_text((EXPERIMENTS_DIR / "tiny_cpu.yaml").read_text().replace(
        "overrides: [algorithm.name=gspo,", "overrides: [rollout.placement=split, rollout.generator_ranks=1, "
                                           "rollout.transport=glooo, algorithm.name=gspo,"))
    assert main([str(f), "--print"]) == 2
    assert "run gspo seed 0: rollout.transport='glooo': no such transport" in capsys.readouterr().err


# tiny_cluster's graph: two runs and a branch of the second, each evaluated after its training.
TINY_CLUSTER_GRAPH = [("gapo seed 0", "-"), ("gspo seed 0", "-"), ("gapo_from_gspo seed 0", "gspo seed 0"),
                      ("evaluation of gapo seed 0", "gapo seed 0"), ("evaluation of gspo seed 0", "gspo seed 0"),
                      ("evaluation of gapo_from_gspo seed 0", "gapo_from_gspo seed 0")]


class ShellSpec(pydantic.BaseModel):
    """The test scheduler's settings: the manifest's `shell:` block, --shell-name over it."""

    model_config = pydantic.ConfigDict(extra="forbid")
    shell_name: str = "bash"


def _shell_backend(m, tasks, out_dir: Path, workdir: Path) -> list[Path]:
    """A second scheduler, for the tests alone: the graph's edges as `task <- what it waits for` lines, and one
    script for its shell that runs every task after the tasks it waits for."""
    out_dir = workdir / out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    edges = out_dir / "graph.txt"
    edges.write_text("".join(f"{t.name} <- {', '.join(t.depends_on) or '-'}\n" for t in tasks))
    head = [f"#!/bin/{m.block('shell', ShellSpec).shell_name}", "set -euo pipefail", f"cd {shlex.quote(str(workdir))}"]
    lines, done, pending = head, set(), list(tasks)
    while pending:
        t = next(t for t in pending if set(t.depends_on) <= done)
        lines += [f"echo {shlex.quote(t.name)}", shlex.join(t.argv)]
        done.add(t.name)
        pending.remove(t)
    script = out_dir / "run.sh"
    script.write_text("\n".join(lines) + "\n")
    return [edges, script]


def test_a_second_scheduler_is_one_render_function_and_one_row(tmp_path, monkeypatch, capsys):
    """The graph carries all a scheduler needs: a test-only backend in gapo-sweep's table gets its own flag
    (--shell [DIR]), its own manifest block (shell:) and --FLAG over it, and renders tiny_cluster's tasks,
    dependencies and commands, with no change to the manifest code; with --eval, the evaluations alone, after
    nothing."""
    from gapo.study import sweep

    monkeypatch.setitem(sweep.BACKENDS, "shell", sweep.Backend(_shell_backend, "a bash script", ShellSpec,
                                                               ("shell_name",)))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny_cluster.yaml").write_text((EXPERIMENTS_DIR / "tiny_cluster.yaml").read_text()
                                                 + "shell: {shell_name: sh}\n")
    assert sweep.main(["tiny_cluster.yaml", "--shell"]) == 0
    assert "submit with: bash runs/tiny_cluster/shell/run.sh" in capsys.readouterr().out
    d = tmp_path / "runs" / "tiny_cluster" / "shell"
    assert [tuple(line.split(" <- ")) for line in (d / "graph.txt").read_text().splitlines()] == TINY_CLUSTER_GRAPH
    script = (d / "run.sh").read_text()
    assert script.startswith("#!/bin/sh\n")  # the manifest's block
    assert sweep.main(["tiny_cluster.yaml", "--shell", "--shell-name", "bash"]) == 0
    script = (d / "run.sh").read_text()
    assert script.startswith("#!/bin/bash\n")  # the command line's over it
    assert subprocess.run(["bash", "-n", str(d / "run.sh")]).returncode == 0
    m = load_manifest("tiny_cluster")
    trains = [shlex.join(j.command(m.nproc)) + "\n" for j in jobs(m)]  # as --print writes them
    assert all(cmd in script for cmd in trains) and script.index(trains[1]) < script.index(trains[2])
    assert script.count("gapo-eval --run runs/tiny_cluster/") == 3
    assert sweep.main(["tiny_cluster", "--eval", "--shell", "elsewhere"]) == 0
    assert (tmp_path / "elsewhere" / "graph.txt").read_text().splitlines() == [
        f"{name} <- -" for name, _ in TINY_CLUSTER_GRAPH[3:]]
    with pytest.raises(SystemExit):  # one scheduler at a time
        sweep.main(["tiny_cluster", "--shell", "--slurm"])


def test_slurm_renders_the_graph_it_is_given(tmp_path):
    """slurm.py reads only the tasks: an evaluation that waits for two runs waits for both tasks; one that waits
    for a task the graph lacks is refused, naming both."""
    m = load_manifest("tiny_cluster")
    tasks = graph(m, jobs(m, tmp_path))
    assert [(t.name, ", ".join(t.depends_on) or "-") for t in tasks] == TINY_CLUSTER_GRAPH
    runs = [t for t in tasks if t.kind == "train" and not t.depends_on]
    both = dataclasses.replace(tasks[-1], depends_on=tuple(t.name for t in runs))
    written = slurm.render(m, [*runs, both], tmp_path / "slurm", tmp_path)
    assert [p.name for p in written] == ["tiny_cluster.runs.sbatch", "tiny_cluster.eval.sbatch", "submit.sh"]
    assert "E0=$(submit --array=0 --dependency=afterok:${RUNS}_0:${RUNS}_1 " in written[-1].read_text()
    # submitted again after run 0 failed unsaved, the evaluation (listed first here) still follows it, and says that
    # it also waits for run 1, whose job the printed commands cannot know
    written = slurm.render(m, [both, *runs], tmp_path / "slurm", tmp_path)
    again = written[0].read_text().split("AGAIN=(")[1].split("\n)")[0]
    assert (f"# {both.name} also waits for gspo seed 0: add afterok:<its job>_<task> if it has not finished\n"
            f"J1=$(sbatch --parsable --array=0 --dependency=afterok:${{J0}}_0 --kill-on-invalid-dep=yes ") in again
    lost = dataclasses.replace(both, depends_on=("nobody seed 0",))
    with pytest.raises(ConfigError, match="evaluation of gapo_from_gspo seed 0 waits for nobody seed 0"):
        slurm.render(m, [*runs, lost], tmp_path / "slurm", tmp_path)


def test_a_manifests_protocol_reaches_gapo_eval_whole():
    """The manifest's own protocol extends the configs' (gapo.config.EvalProtocol): each of its settings becomes
    a gapo-eval flag, and gapo-eval takes exactly those from a config's protocol."""
    from gapo.config import EvalProtocol
    from gapo.study.eval import PROTOCOL_KEYS
    from gapo.study.manifest import Protocol, eval_commands

    m = load_manifest("tiny_cpu")
    assert isinstance(m.eval.protocol, Protocol)
    cmd = eval_commands(m, jobs(m))[0]
    assert set(EvalProtocol.model_fields) == set(PROTOCOL_KEYS)
    for field in [*EvalProtocol.model_fields, "limit", "name"]:
        assert f"--{field.replace('_', '-')}" in cmd, field
    assert cmd[cmd.index("--top-p") + 1] == "1.0"  # not given: the shared default


def _fake_slurm(tmp_path: Path) -> Path:
    """Stand-ins for srun, python (the launcher) and scontrol that record their arguments."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "srun").write_text('#!/bin/bash\necho "$@" > "$RECORD.srun"; shift; "$@"\n')
    (fake / "python").write_text('#!/bin/bash\nif [ "$1" = -c ]; then echo 40001; exit; fi\n'
                                 'printf "%s\\n" "$@" > "$RECORD"\nexit "${EXIT:-0}"\n')
    (fake / "scontrol").write_text('#!/bin/bash\necho "$@" >> "$RECORD.scontrol"; echo node1\n')
    for f in fake.iterdir():
        f.chmod(0o755)
    return fake


def _branch_task(tmp_path: Path, task: int, job_id: int, **extra: str):
    """fig7_intervention's jobs, its branch script, and the environment SLURM would give its task `task`, with
    stand-ins for srun, torchrun and scontrol on the PATH."""
    m = load_manifest("fig7_intervention")
    js = jobs(m, tmp_path / "runs")
    _, branches, _, _ = slurm.render(m, graph(m, js), tmp_path / "slurm", Path.cwd())
    fake = _fake_slurm(tmp_path)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": str(task),
           "SLURM_NNODES": "1", "SLURM_JOB_NODELIST": "node1", "RECORD": str(tmp_path / "args"),
           "GAPO_PYTHON": str(fake / "python"), "SLURM_JOB_ID": str(job_id), "SLURM_CPUS_PER_TASK": "32", **extra}
    return js, branches, env


def test_slurm_script_runs_the_right_command_for_each_task(tmp_path):
    """The script's task-to-command mapping, executed with stand-ins for srun, torchrun and scontrol."""
    js, branches, env = _branch_task(tmp_path, task=1, job_id=78)
    assert subprocess.run(["bash", str(branches)], env=env).returncode == 0
    args = (tmp_path / "args").read_text().split("\n")
    job = [j for j in js if j.parent is not None][1]
    assert args[args.index("--resume") + 1] == str(job.resume) and f"trainer.output_dir={job.out}" in args
    assert args[args.index("--rdzv_endpoint") + 1] == "node1:40001"  # the port the batch host found free
    assert (tmp_path / "args.srun").read_text().startswith("--cpus-per-task=32 ")
    (job.out / "checkpoints").mkdir(parents=True)
    (job.out / "checkpoints" / "latest").write_text("step_000700")  # requeued after saving step 700
    assert subprocess.run(["bash", str(branches)], env=env).returncode == 0
    args = (tmp_path / "args").read_text().split("\n")
    assert args[args.index("--resume") + 1] == "auto" and args[:2] == ["-m", "gapo.launch"]
    assert "requeue" not in (tmp_path / "args.scontrol").read_text()
    r = subprocess.run(["bash", str(branches)], env={**env, "EXIT": "75"})  # preempted: the task requeues itself
    assert r.returncode == 75 and "requeue 78" in (tmp_path / "args.scontrol").read_text()


def test_a_task_that_fails_unsaved_says_what_submits_it_and_its_waiters_again(tmp_path):
    """A training task killed before its ranks could save (exit 137, e.g. scancel --full) is not requeued, and
    SLURM cancels what waits for it (--kill-on-invalid-dep, in submit.sh); the task's log names the commands that
    submit it again and, each after its own, every task that waits for it. Those commands, run with a stand-in
    sbatch, submit exactly that: tiny_cluster's gspo run, its branch after it, and both evaluations after theirs."""
    m = load_manifest("tiny_cluster")
    runs, _, _, submit = slurm.render(m, graph(m, jobs(m, tmp_path / "runs")), tmp_path / "slurm", Path.cwd())
    assert submit.read_text().count("--kill-on-invalid-dep=yes") == 4  # the branch and the three evaluations
    fake = _fake_slurm(tmp_path)
    (fake / "sbatch").write_text('#!/bin/bash\nn=$(( $(wc -l < "$RECORD.sbatch" 2>/dev/null || echo 0) + 500 ))\n'
                                 'echo "$@" >> "$RECORD.sbatch"; echo "$n;cluster"\n')
    (fake / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_ARRAY_TASK_ID": "1", "SLURM_NNODES": "1",
           "SLURM_JOB_NODELIST": "node1", "RECORD": str(tmp_path / "args"), "GAPO_PYTHON": str(fake / "python"),
           "SLURM_JOB_ID": "80", "SLURM_CPUS_PER_TASK": "2", "EXIT": "137"}
    r = subprocess.run(["bash", str(runs)], env=env, capture_output=True, text=True)
    assert r.returncode == 137 and "stopped unsaved (exit 137)" in r.stdout, r.stdout + r.stderr
    assert "requeue" not in (tmp_path / "args.scontrol").read_text()
    again = r.stdout.split("the tasks that wait for it:\n")[1].split("gapo-sweep: exit")[0]
    assert subprocess.run(["bash", "-c", f"set -eu\n{again}"], env=env).returncode == 0
    d = tmp_path / "slurm"
    assert (tmp_path / "args.sbatch").read_text().splitlines() == [
        f"--parsable --array=1 {d}/tiny_cluster.runs.sbatch",  # gspo seed 0 (job 500)
        f"--parsable --array=0 --job-name=tiny_cluster-gapo_from_gspo-seed0 --dependency=afterok:500_1 "
        f"--kill-on-invalid-dep=yes {d}/tiny_cluster.branches.sbatch",
        f"--parsable --array=1 --dependency=afterok:500_1 --kill-on-invalid-dep=yes {d}/tiny_cluster.eval.sbatch",
        f"--parsable --array=2 --dependency=afterok:501_0 --kill-on-invalid-dep=yes {d}/tiny_cluster.eval.sbatch"]


def test_a_branch_stopped_before_its_first_save_starts_over_from_its_parent(tmp_path):
    """Requeued with a metrics.jsonl and a half-written checkpoint but no complete checkpoint of its own, the
    branch task clears them and starts from its parent's checkpoint again (gapo-train refuses a directory that
    holds a run, which would fail every requeue); the run's other files stay."""
    js, branches, env = _branch_task(tmp_path, task=0, job_id=79, SLURM_RESTART_COUNT="1")
    job = [j for j in js if j.parent is not None][0]
    (job.out / "checkpoints" / ".tmp-step_000700").mkdir(parents=True)
    (job.out / "metrics.jsonl").write_text('{"step": 601}\n')
    (job.out / "train.log").write_text("the first start\n")
    r = subprocess.run(["bash", str(branches)], env=env, capture_output=True, text=True)
    assert r.returncode == 0 and "starting over" in r.stdout
    args = (tmp_path / "args").read_text().split("\n")
    assert args[args.index("--resume") + 1] == str(job.resume)
    assert not (job.out / "metrics.jsonl").exists() and not (job.out / "checkpoints").exists()
    assert (job.out / "train.log").read_text() == "the first start\n"


def test_bad_manifests_name_the_field(tmp_path):
    good = (EXPERIMENTS_DIR / "fig7_intervention.yaml").read_text()
    for old, new, needle in [("run: gspo_asym, step: 600", "run: gspo, step: 600", "no run named 'gspo'"),
                             ("[GSPO 3e-3/5e-3]", "[GSPO sym]", "'GSPO sym' is not a run's label"),
                             ("name: gapo_from_600", "name: gspo_asym", "names repeat (gspo_asym)")]:
        f = tmp_path / "m.yaml"
        f.write_text(good.replace(old, new))
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_manifest(f)
    f.write_text(good.replace("algorithm.name=gapo", "algorithm.nam=gapo"))
    r = sweep(str(f), "--print")
    assert r.returncode == 2 and "run gapo_from_600 seed 0" in r.stderr and "algorithm.nam" in r.stderr


def test_budget_reports_gpus_memory_and_hours():
    from gapo.study.budget import budget

    text = budget(load_manifest("table1_r1"), jobs(load_manifest("table1_r1")))
    assert "9 runs of 8 GPU(s)" in text and "GPU-hours" in text and "memory plan" in text


def test_budget_counts_the_evaluation_and_the_checkpoints_disk():
    """Table 3 (Qwen): 24 runs x 10 evaluated checkpoints x 2,131 problems x 256 samples, about 3x the training;
    each kept checkpoint ~16 bytes per parameter (weights, fp32 weights and Adam's moments), ~6 TB in all."""
    from gapo.study.budget import budget

    m = load_manifest("table3_qwen")
    text = budget(m, jobs(m))
    train = float(re.search(r"training +~([\d,]+) GPU-hours", text)[1].replace(",", ""))
    evaluation = float(re.search(r"evaluation ~([\d,]+) GPU-hours \(545,536 samples", text)[1].replace(",", ""))
    assert 2_131 * 256 == 545_536 and 2.5 * train < evaluation < 4 * train
    disk, weights_only = map(float, re.search(r"disk +([\d.]+) TB .* ([\d.]+) TB if those kept", text).groups())
    assert 5 < disk < 7 and weights_only < disk / 2
    assert "10 kept checkpoints" in text  # eval.steps (10) and the newest keep_last among them


def _fake_results(root: Path, m, values: dict[tuple[str, int], float]) -> None:
    for j in jobs(m, root):
        v = values.get((j.run.name, j.seed))
        if v is None:
            continue
        d = j.out / "eval" / m.protocol_name / f"step_{max(m.eval.steps):06d}"
        d.mkdir(parents=True)
        metrics = {"val/arithmetic/pass@1": v, "val/arithmetic/pass@4": min(1.0, 2 * v), "val/mean/pass@1": v,
                   "val/mean/pass@4": min(1.0, 2 * v), "val/arithmetic/coverage": round(16 * v)}
        (d / "results.json").write_text(json.dumps({"meta": {}, "metrics": metrics}))


def test_a_clip_range_reads_the_same_in_the_table_and_the_figure_legends(tmp_path):
    """The table's eps_lo / eps_hi cells and a run's legend (gapo-plot, gapo-compare's figures) are one rendering:
    AlgorithmConfig.clip_range."""
    from gapo.study.figures import default_label
    from gapo.study.tables import write

    m = load_manifest("tiny_cpu")
    _fake_results(tmp_path, m, {(r.name, s): 0.3 for r in m.runs for s in m.seeds})
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in write(m, tmp_path).read_text().splitlines()
            if line.startswith("| ")}
    for j in jobs(m, tmp_path):
        cfg = load_config(j.config, j.args)
        legend = default_label(tmp_path / "run", cfg.model_dump(mode="json"))
        lo, hi = rows[j.run.label or j.run.name][1:3]
        assert legend == f"run ({cfg.algorithm.name} {lo}/{hi})"
    assert {rows[r.label or r.name][2] for r in m.runs} == {"0.05 adaptive", "3e-3"}


def logit_cell(a: float, b: float) -> str:
    """Two seeds' fractions as a table cell, by hand: t(0.975, 1) = 12.706 on the logit scale, mapped back, in %."""
    z = [math.log(p / (1 - p)) for p in (a, b)]
    h = 12.706204736 * abs(z[0] - z[1]) / math.sqrt(2) / math.sqrt(2)
    c, lo, hi = (100 / (1 + math.exp(-(sum(z) / 2 + d))) for d in (0, -h, h))
    assert 0 < lo < c < hi < 100
    return f"{c:.1f} [{lo:.1f}, {hi:.1f}]"


def test_the_table_is_built_from_the_evaluations_with_cis_and_paired_tests(tmp_path):
    from gapo.study.tables import write

    m = load_manifest("tiny_cpu")
    _fake_results(tmp_path, m, {("gapo", 0): 0.30, ("gapo", 1): 0.34, ("gspo", 0): 0.10})
    md = write(m, tmp_path).read_text()
    # GAPO: the logit-scale centre and t(0.975, 1) interval of (0.30, 0.34) and of pass@4 (0.60, 0.68), mapped back;
    # GSPO has one seed of the two so far.
    cells = f"{logit_cell(0.30, 0.34)} / {logit_cell(0.60, 0.68)}"
    assert f"| GAPO | 3e-3 | 0.05 adaptive | {cells} | {cells} |" in md
    assert "| GSPO | 3e-3 | 3e-3 | 10.0 (n = 1 of 2) / 20.0 (n = 1 of 2) |" in md
    assert "## Missing" in md and "gspo seed 1, step 2" in md
    _fake_results(tmp_path, m, {("gspo", 1): 0.12})
    md = write(m, tmp_path).read_text()
    assert "| GAPO vs GSPO | +21.00 [" in md and "2 pairs)" in md and "## Missing" not in md  # by seed: 0.2, 0.22
    assert "![coverage.png](coverage.png)" in md and (tmp_path / "tiny_cpu" / "compare" / "coverage.png").is_file()
    rows = (tmp_path / "tiny_cpu" / "compare" / "table.csv").read_text().splitlines()
    assert rows[0] == "method,benchmark,metric,step,seeds,mean,centre,ci95_low,ci95_high,values"
    assert len(rows) == 1 + 2 * 2 * 2


@pytest.fixture
def swept(once) -> tuple[Path, str]:
    """(output root, the sweep's stdout) of the tiny manifest's `--run` after an interruption: its first run finished
    and its second saved step 1 of 2 and died before the sweep began. Shared by the resume test and the chain test,
    which goes on from it (four gapo-train starts fewer; issue 46)."""
    def make(folder: Path) -> tuple[Path, str]:
        root = folder / "runs"
        first, second = jobs(load_manifest("tiny_cpu"), root)[:2]
        ok = subprocess.run([str(BIN / "gapo-train"), *first.command(1)[1:]], cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=600)
        assert ok.returncode == 0, ok.stderr[-3000:]
        died = subprocess.run([str(BIN / "gapo-train"), *second.command(1)[1:], "trainer.save_every=1"], cwd=ROOT,
                              env={**ENV, "GAPO_FAULT": "kill_before_rename:2"}, capture_output=True, text=True,
                              timeout=600)
        assert died.returncode != 0 and (second.out / "checkpoints" / "step_000001").is_dir()
        r = sweep("tiny_cpu", "--run", "--output-root", str(root))
        assert r.returncode == 0, r.stderr[-4000:]
        return root, r.stdout

    return once("tiny_cpu swept after an interruption", make)


@pytest.mark.e2e
def test_an_interrupted_sweep_resumes_the_run_it_stopped_in(swept):
    """A sweep killed mid-run: the same command skips the finished run, resumes the interrupted one from its
    checkpoint and starts the two still to run."""
    root, stdout = swept
    second = jobs(load_manifest("tiny_cpu"), root)[1]
    assert "[1/4] gapo seed 0: finished, skipped" in stdout
    assert f"[2/4] gapo seed 1: resuming: gapo-train --config tiny_cpu --nproc 1 --resume {second.out}" in stdout
    assert stdout.count("starting") == 2
    rows = [json.loads(x) for x in (second.out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows if "reward/mean" in x] == [1, 2]


@pytest.mark.e2e
def test_the_chain_sweep_evaluate_table_on_the_tiny_manifest(swept):
    """2 methods x 2 seeds trained (the sweep above), their kept checkpoints evaluated under the manifest's protocol
    (one engine per run), the table in the paper's layout; a second pass of each command finds its work done."""
    root, _ = swept
    r = sweep("tiny_cpu", "--eval", "--output-root", str(root))
    assert r.returncode == 0, r.stderr[-4000:]
    m = load_manifest("tiny_cpu")
    for j in jobs(m, root):
        res = json.loads((j.out / "eval" / "tiny" / "step_000002" / "results.json").read_text())
        assert res["meta"]["settings"]["n"] == 4 and 0 <= res["metrics"]["val/arithmetic/pass@1"] <= 1
        assert res["meta"]["model"] == str(j.out / "checkpoints" / "step_000002" / "hf")
    r = subprocess.run([str(BIN / "gapo-compare"), "table", "tiny_cpu", "--output-root", str(root)], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (root / "tiny_cpu" / "compare" / "table.md").read_text()
    for label in ("GAPO", "GSPO"):
        row = next(x for x in md.splitlines() if x.startswith(f"| {label} |"))
        assert row.count(" [") == 4, row  # two benchmarks columns (arithmetic, mean) x pass@1 / pass@4
    assert "| GAPO vs GSPO |" in md and "## Missing" not in md
    for fig in ("clip_vs_c.png", "coverage.png"):
        assert (root / "tiny_cpu" / "compare" / fig).is_file()
    again = sweep("tiny_cpu", "--run", "--output-root", str(root))
    assert again.returncode == 0 and again.stdout.count("finished, skipped") == 4
    again = sweep("tiny_cpu", "--eval", "--output-root", str(root))
    assert again.returncode == 0 and again.stderr.count("evaluated already") == 4


@pytest.mark.e2e
def test_the_intervention_manifest_rehearses_parent_kept_checkpoint_branch(tmp_path):
    """The parent rehearsed (2 steps, its kept step scaled to step 1, kept while step 2 saves with keep_last 1),
    then the branch rehearsed from that kept checkpoint with the other algorithm."""
    r = sweep("fig7_intervention", "--rehearse", "--output-root", str(tmp_path), timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("# Rehearsal: ") == 2 and "FAILED" not in r.stdout  # (its hub data: offline, not checked)
    parent = tmp_path / "table3_qwen" / "gspo_asym" / "seed0-rehearsal"  # Table 3's run (runs.use), its own directory
    assert sorted(p.name for p in (parent / "checkpoints").glob("step_*")) == ["step_000001", "step_000002"]
    branch = tmp_path / "fig7_intervention" / "gapo_from_600" / "seed0-rehearsal-resumed"
    cfg = load_config(branch / "config.yaml")
    assert (cfg.algorithm.name, cfg.trainer.resume_from) == ("gapo", str(parent / "checkpoints" / "step_000001"))
    rows = [json.loads(x) for x in (branch / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["branch/parent_step"] == 1 and [x["step"] for x in rows if "reward/mean" in x] == [2, 3]


def test_gapo_train_help_names_the_signals_slurm_sends(capsys):
    from gapo.cli import train_main

    with pytest.raises(SystemExit):
        train_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "SIGTERM, what SLURM sends at a preemption" in text and "--signal=USR1@300" in text
    assert "exit 75" in text and "GraceTime" in text


def _settings(cfg) -> str:
    """A run's resolved settings without what only says where it writes, what it keeps or how it is tracked."""
    from gapo.configfile import dump_config

    t = cfg.trainer.model_copy(update={"output_dir": None, "keep_steps": [], "keep_every": 0, "resume_from": None})
    return dump_config(cfg.model_copy(update={"trainer": t, "tracking": type(cfg.tracking)()}))


def test_every_distinct_run_of_the_paper_manifests_is_launched_once():
    """Over every manifest's --print, two output directories never hold the same settings (a run paid for twice):
    Table 8, Fig. 6 and Fig. 7 reuse Table 3's runs; and a shared run is the same command wherever it is printed."""
    by_settings: dict[tuple, set[str]] = {}
    commands: dict[str, set[str]] = {}
    for name in MANIFESTS:
        m = load_manifest(name)
        for j in jobs(m):
            cfg = j.resolved()
            key = (_settings(cfg), str(j.resume.relative_to(j.resume.parents[3])) if j.resume else None)
            by_settings.setdefault(key, set()).add(str(j.out))
            commands.setdefault(str(j.out), set()).add(shlex.join(j.command(m.nproc)))
    twice = [dirs for dirs in by_settings.values() if len(dirs) > 1]
    assert not twice, twice
    assert all(len(c) == 1 for c in commands.values()), [c for c in commands.values() if len(c) > 1]
    shared = {j.out for j in jobs(load_manifest("table8_eps_hi_max")) if j.shared}
    assert len(shared) == 9 and all("table3_qwen" in str(d) for d in shared)


def test_a_shared_run_must_keep_what_its_user_needs_and_is_counted_by_its_owner(tmp_path):
    from gapo.study.budget import budget
    from gapo.study.manifest import check

    m = load_manifest("table8_eps_hi_max")
    js = jobs(m)
    check(m, js)
    text = budget(m, js)
    assert "gspo_5e-3 seed 0: table3_qwen/gspo_asym's run, trained and kept by that sweep (counted there); ~0 " \
           "GPU-hours evaluating 0 checkpoint(s) it does not" in text
    assert "3 of them" not in text and "9 of them another manifest's (runs.use)" in text
    bad = tmp_path / "m.yaml"
    bad.write_text((EXPERIMENTS_DIR / "table8_eps_hi_max.yaml").read_text().replace("steps: [1000]", "steps: [950]"))
    m = load_manifest(bad)
    with pytest.raises(ConfigError, match=r"runs.gspo_3e-3.use: table3_qwen/gspo_sym keeps no checkpoint of step 950"):
        check(m, jobs(m))
    bad.write_text((EXPERIMENTS_DIR / "table8_eps_hi_max.yaml").read_text().replace(
        'use: table3_qwen/gspo_sym}', 'use: table3_qwen/gspo_sym, overrides: [algorithm.eps_hi=1e-3]}'))
    with pytest.raises(ConfigError, match="takes its settings from table3_qwen/gspo_sym"):
        load_manifest(bad)


def test_a_shared_branch_run_needs_its_parent_before_it_and_then_waits_for_it(tmp_path):
    """`use:` of another manifest's branch run (issue 52 item 7: this crashed in Job.own_steps): refused by name
    unless the manifest also uses the parent, above it; then the graph trains the parent first, the branch resumes
    from the parent's checkpoint, and only steps after the branch point are the branch's own."""
    from gapo.study.manifest import graph

    text = """name: uses_branch
title: a branch of another manifest's
produces: test
config: gspo_intervention
nproc: 8
seeds: [0]
runs:
  - {name: after600, label: GAPO from 600, use: fig7_intervention/gapo_from_600}
eval: {protocol: qwen_math, steps: [500, 700, 1000]}
"""
    bad = tmp_path / "uses_branch.yaml"
    bad.write_text(text)
    with pytest.raises(ConfigError, match=r"runs.after600.use: fig7_intervention/gapo_from_600 branches from "
                                          r"fig7_intervention's run gspo_asym at step 600.*above it"):
        jobs(load_manifest(bad))
    good = tmp_path / "uses_both.yaml"
    good.write_text(text.replace("runs:\n", "runs:\n  - {name: gspo, label: GSPO, use: fig7_intervention/gspo_asym}\n"))
    m = load_manifest(good)
    parent, branch = jobs(m)
    assert branch.branch_step == 600 and branch.own_steps(m.eval.steps) == [700, 1000]
    assert parent.own_steps(m.eval.steps) == [500, 700, 1000]
    assert str(branch.resume).endswith("table3_qwen/gspo_asym/seed0/checkpoints/step_000600")
    tasks = {t.name: t for t in graph(m, [parent, branch])}
    assert tasks["after600 seed 0"].depends_on == ("gspo seed 0",)


def test_usage_shows_one_mode_is_required_and_the_eval_list_flag(capsys):
    """Its usage line says a mode is required (it is), and --eval's companion is --list (issue 54)."""
    from gapo.study.sweep import main

    with pytest.raises(SystemExit) as e:
        main(["tiny"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: gapo-sweep MANIFEST (--print | --run |" in err and "is required" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert "--eval [--list]" in out and "(--list: print" in out and "(--print: list)" not in out


def test_key_path_overrides_reach_every_run_and_leave_slurms_dir_alone(capsys, tmp_path):
    """gapo-sweep NAME --print key.path=value: the setting on every run's command after the run's own (so that it
    wins), and never taken for --slurm's optional DIR; a misspelt key is a config error naming it."""
    from gapo.errors import Exit
    from gapo.study.sweep import main

    assert main(["tiny_cpu", "--print", "trainer.lr=3e-4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(load_manifest("tiny_cpu").runs) * len(load_manifest("tiny_cpu").seeds)
    for line in lines:
        words = shlex.split(line)
        assert words.index("trainer.lr=3e-4") > max(i for i, w in enumerate(words) if w.startswith("algorithm."))
        cfg = load_config(words[2], [w for w in words if "=" in w and not w.startswith("-")])
        assert cfg.trainer.lr == 3e-4
    assert main(["tiny_cpu", "--slurm", str(tmp_path / "s"), "trainer.lr=3e-4"]) == 0
    assert "trainer.lr=3e-4" in (tmp_path / "s" / "tiny_cpu.runs.sbatch").read_text()
    assert main(["tiny_cpu", "--print", "trainer.lrr=3e-4"]) == Exit.CONFIG
    assert "trainer.lrr" in capsys.readouterr().err
    assert main(["tiny_cpu", "--print", "trainer.seed=7"]) == Exit.CONFIG  # the sweep's own per-job settings
    assert "trainer.seed=7: gapo-sweep sets this per run and seed" in capsys.readouterr().err


def test_a_sweep_whose_checkpoints_exceed_the_free_disk_is_warned_before_its_first_run(tmp_path, monkeypatch):
    """demo_mechanism's 48 runs keep one 2.15 GB checkpoint each (SmolLM2-135M: 134.5 M parameters x 16 bytes): on
    a laptop with less free, gapo-sweep --run says so before the first run, with the sum and the fixes."""
    import collections

    from gapo.study import budget

    js = jobs(load_manifest("demo_mechanism"), tmp_path)
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: usage(10**12, 0, 9 * 10**9))
    said = budget.disk_shortfall(js, tmp_path / "demo_mechanism")
    assert said.startswith("the 48 run(s) left keep about 103.3 ") and "GB of checkpoints and 9.0 GB are free under " \
        f"{tmp_path}:" in said  # (the folder does not exist yet: its nearest existing parent)
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: usage(10**12, 0, 200 * 10**9))
    assert budget.disk_shortfall(js, tmp_path / "demo_mechanism") is None
    # weights only (trainer.save_only_model=true, given to gapo-sweep): 134.5 M x 4 bytes (fp32) a run, 25.8 GB in all
    m = load_manifest("demo_mechanism")
    m_slim = m.model_copy(update={"runs": [r.model_copy(update={"overrides": [*r.overrides, "trainer.save_only_model="
                                                                               "true"]}) for r in m.runs]})
    slim = jobs(m_slim, tmp_path)
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda p: usage(10**12, 0, 9 * 10**9))
    assert budget.disk_shortfall(slim, tmp_path / "demo_mechanism").startswith("the 48 run(s) left keep about 25.8 GB")
    whole, weights = (float(re.search(r"disk +([\d.]+) TB", budget.budget(*x))[1]) for x in ((m, js), (m_slim, slim)))
    assert (whole, weights) == (0.10, 0.03)


# ------------------------------------------------------------------------------- a run folder is its job's own


def _run_folder(j, *overrides: str) -> None:
    """A run folder as gapo-train leaves it, enough for gapo-sweep and gapo-compare: its config.yaml (the job's,
    with `overrides`), metrics.jsonl and a checkpoint of the job's last step (what rundir.checkpoints counts)."""
    from gapo.configfile import dump_config

    cfg = load_config(j.config, [*j.args, *([f"trainer.resume_from={j.resume}"] if j.resume else []), *overrides])
    ckpt = j.out / "checkpoints" / f"step_{cfg.trainer.total_steps:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "trainer.json").write_text("{}")
    (j.out / "config.yaml").write_text(dump_config(cfg))
    (j.out / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward/mean": 0.5}) + "\n")


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_run_folder_trained_with_other_settings_is_refused_by_the_sweep_and_the_table(tmp_path, capsys,
                                                                                     monkeypatch):
    """Issue 67: a finished run at the folder of the tiny sweep's gapo seed 0, trained with eps_hi_max 0.02 (the
    manifest says 0.05). gapo-sweep --run used to skip it as finished and gapo-compare to label it "0.05 adaptive";
    now --run, --eval and --slurm refuse it (exit 2) naming the key, both values and the ways out, before anything
    is trained or written, and gapo-compare table will not table it."""
    from gapo.errors import Exit
    from gapo.study import sweep
    from gapo.study.compare import main as compare_main

    m = load_manifest("tiny_cpu")
    js = jobs(m, tmp_path)
    _run_folder(js[0], "algorithm.eps_hi_max=0.02")
    _fake_results(tmp_path, m, {(r.name, s): 0.3 for r in m.runs for s in m.seeds})  # a table could be built
    assert sweep.finished(js[0])  # what used to let it through
    before = _tree(tmp_path)
    monkeypatch.setattr(sweep.subprocess, "call", lambda *a, **k: pytest.fail(f"ran {a}"))
    said = "algorithm.eps_hi_max 0.02 there, 0.05 in this job"
    for mode in (["--run"], ["--eval"], ["--eval", "--list"], ["--slurm"], ["--eval", "--slurm"]):
        assert sweep.main(["tiny_cpu", *mode, "--output-root", str(tmp_path)]) == Exit.CONFIG, mode
        err = capsys.readouterr().err
        assert f"gapo-sweep: run gapo seed 0: {js[0].out} holds a run trained with other settings ({said})" in err
        assert f"give another --output-root, or move {js[0].out} away" in err
    assert compare_main(["table", "tiny_cpu", "--output-root", str(tmp_path)]) == Exit.CONFIG
    assert said in capsys.readouterr().err
    assert _tree(tmp_path) == before  # nothing trained, evaluated or written (no slurm/, no compare/)


def test_the_jobs_own_run_folder_is_accepted_whatever_its_paths_tracking_and_resumes(tmp_path):
    """What a folder may hold otherwise and still be the job's run: its paths (output_dir, the resumed checkpoint),
    tracking, and what a resume may change (steps, kept checkpoints, the engine's compile); a branch's folder holds
    its own algorithm, which is not its parent's. A key that defines the run (trainer.lr) is named."""
    from gapo.study.manifest import check_folders, settings_differ

    m = load_manifest("tiny_cluster")  # two runs and a branch of the second
    js = jobs(m, tmp_path)
    assert any(j.parent for j in js)
    for j in js:
        _run_folder(j, f"trainer.output_dir={tmp_path / 'moved'}", f"trainer.resume_from={j.out}",
                    "tracking.mode=online", "tracking.wandb=false", "tracking.project=other",
                    "trainer.total_steps=120", "trainer.keep_last=5", "rollout.compile=auto")
    check_folders(js)
    for j in js:
        assert settings_differ(load_config(j.out / "config.yaml"), j.resolved()) == {}
    _run_folder(next(j for j in js if j.parent), "trainer.lr=3e-4")
    with pytest.raises(ConfigError, match=r"run gapo_from_gspo seed 0: .* \(trainer.lr 0.0003 there, 0.0001 in this "
                                          r"job\), not this job's"):
        check_folders(js)
    # the demo's own run (gapo-train --config tiny_cpu) against the sweep's gapo seed 0: the collision
    gapo = jobs(load_manifest("tiny_cpu"), tmp_path)[0]
    assert settings_differ(load_config("tiny_cpu"), gapo.resolved()) == {"algorithm.eps_hi_max": (0.005, 0.05)}


def test_no_manifest_writes_where_gapo_train_puts_a_configs_runs():
    """`gapo-train --config C` (docs/demo.md's tiny_cpu) writes runs/C/<method>/seed<seed> unless told otherwise; a
    manifest's runs there would share that command's folders (issue 67: the tiny_cpu manifest's did)."""
    mine = {Path("runs", p.stem) for p in (ROOT / "configs").glob("*.yaml")}
    for name in MANIFESTS:
        for j in jobs(load_manifest(name)):
            assert Path(*j.out.parts[:2]) not in mine, (name, j.run.name, j.out)
