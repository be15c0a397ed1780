"""Each paper config's `eval.protocol` is its table's reporting protocol, and `gapo-eval --protocol` applies it
with explicit flags winning.

The expected values are written here from the paper (§4.1 "evaluate" paragraph and the headers of Tables 1-3),
not from the configs, so a config that drifts from its table fails here.
"""

import pytest

from gapo.configfile import load_config
from gapo.errors import ConfigError
from gapo.evaluation import BENCHMARKS
from gapo.study.eval import apply_protocol, main, parser

MATH6 = ["aime24", "aime25", "amc", "math500", "minerva", "olympiad_bench"]
PAPER = {
    # Table 3: six in-domain math benchmarks plus IFEval (OOD); Pass@1 / Pass@256, T 1.0, top-p 1, n 256
    "qwen_math": dict(table="Table 3", benchmarks=[*MATH6, "ifeval"], n=256, temperature=1.0, top_p=1.0,
                      max_new_tokens=3092),
    "llama_math": dict(table="Table 3", benchmarks=[*MATH6, "ifeval"], n=256, temperature=1.0, top_p=1.0,
                       max_new_tokens=8192),
    # Table 1: the six in-domain math benchmarks (no IFEval); Pass@1 / Pass@16, T 0.6, top-p 1, n 16
    "r1_distill_math": dict(table="Table 1", benchmarks=MATH6, n=16, temperature=0.6, top_p=1.0,
                            max_new_tokens=24576),
    # Table 2: LCB-v5 (8/1/24-2/1/25) and HumanEval+; Pass@1, T 0.6, top-p 1, n 2
    "deepcoder": dict(table="Table 2", benchmarks=["livecodebench@2024-08-01:2025-02-01", "humaneval_plus"], n=2,
                      temperature=0.6, top_p=1.0, max_new_tokens=24576),
    # §4.2.1 / Fig. 7 continues the Qwen2.5-Math-1.5B runs: Table 3's protocol
    "gspo_intervention": dict(table="Table 3", benchmarks=[*MATH6, "ifeval"], n=256, temperature=1.0, top_p=1.0,
                              max_new_tokens=3092),
}
KEYS = ("benchmarks", "n", "temperature", "top_p", "max_new_tokens")


@pytest.mark.parametrize("config", sorted(PAPER))
def test_config_protocol_is_the_papers_table(config):
    p = load_config(config).eval.protocol
    want = PAPER[config]
    assert p is not None and p.table.startswith(want["table"] + ",")
    assert {k: getattr(p, k) for k in KEYS} == {k: want[k] for k in KEYS}
    for spec in p.benchmarks:  # every spec names a benchmark gapo-eval knows
        assert spec.partition("=")[0].partition("@")[0] in BENCHMARKS, spec


@pytest.mark.parametrize("config", sorted(PAPER))
def test_gapo_eval_protocol_resolves_to_the_table(config):
    args = parser().parse_args(["--model", "m", "--protocol", config])
    note = apply_protocol(args)
    want = PAPER[config]
    assert (args.benchmarks, args.n, args.temperature, args.top_p, args.max_new_tokens) == (
        ",".join(want["benchmarks"]), want["n"], want["temperature"], want["top_p"], want["max_new_tokens"])
    assert note.startswith(f"protocol {config} ({want['table']}") and "from the command line" not in note


def test_explicit_flags_override_the_protocol():
    args = parser().parse_args(["--model", "m", "--protocol", "qwen_math", "--n", "8", "--top-p", "0.95",
                                "--benchmarks", "aime24"])
    note = apply_protocol(args)
    assert (args.benchmarks, args.n, args.temperature, args.top_p, args.max_new_tokens) == (
        "aime24", 8, 1.0, 0.95, 3092)
    assert note.endswith("from the command line: benchmarks, n, top_p")


def test_without_protocol_the_defaults_apply_and_benchmarks_are_required():
    args = parser().parse_args(["--model", "m", "--benchmarks", "amc"])
    assert apply_protocol(args) is None
    assert (args.n, args.temperature, args.top_p, args.max_new_tokens) == (16, 0.6, 1.0, 3072)
    with pytest.raises(ConfigError, match="give --benchmarks, or --config"):
        apply_protocol(parser().parse_args(["--model", "m"]))


def test_a_config_without_protocol_or_a_missing_one_is_refused(capsys, tmp_path):
    with pytest.raises(ConfigError, match="has no eval.protocol section"):
        apply_protocol(parser().parse_args(["--model", "m", "--protocol", "tiny_cpu"]))
    assert main(["--model", str(tmp_path), "--protocol", "no_such_config"]) == 2
    assert "gapo-eval: config file 'no_such_config' not found" in capsys.readouterr().err


def test_a_partial_protocol_is_refused_naming_the_missing_keys():
    with pytest.raises(ConfigError, match=r"eval.protocol.n: Field required"):
        load_config("tiny_cpu", ["eval.protocol={table: x, benchmarks: [amc], temperature: 1.0, top_p: 1.0, "
                                 "max_new_tokens: 8}"])


def test_help_says_where_each_default_comes_from():
    text = parser().format_help()
    for part in ("--config CONFIG, --protocol CONFIG", "default: the protocol's, else 16",
                 "default: the protocol's, else 0.6", "default: the protocol's, else 3072",
                 "qwen_math, llama_math (Table 3)"):
        assert part in " ".join(text.split()), part


def test_key_path_settings_reach_the_config_and_need_one(capsys):
    """gapo-eval --config qwen_math eval.protocol.n=8: the setting changes the protocol as on gapo-train's command
    line (a --run folder list around it stays folders); without --config it is refused by name."""
    args = parser().parse_args(["--run", "a", "b", "--config", "qwen_math"])
    args.overrides = ["eval.protocol.n=8"]
    apply_protocol(args)
    assert args.n == 8 and args.run == ["a", "b"]
    assert main(["--model", "m", "eval.protocol.n=8"]) == 2
    assert "eval.protocol.n=8: a key.path=value setting applies to the --config" in capsys.readouterr().err
