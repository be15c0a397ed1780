"""Reading a config: YAML files (a `base:` chain merged), dotted command-line overrides, the preset named by
`algorithm.name` filled in, "null: another field" defaults resolved once, and the result validated into a
gapo.config.Config; and writing one back (the run's config.yaml, `--print-config`, `--help`'s field list).

Why apart from the schema: gapo/config.py says what a valid run is; this file says how text on disk and on a
command line becomes one, which is where presets, upgrades of old run folders and error messages live.
"""

from __future__ import annotations

import copy
import logging
import re
import textwrap
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError

from gapo.algorithms import PRESET_SWITCHES, PRESETS, preset_switches
from gapo.clip import RULES, UPPER_FIELDS, fmt_eps
from gapo.config import CONFIGS_DIR, Config
from gapo.errors import ConfigError, did_you_mean
from gapo.rundir import run_of

log = logging.getLogger("gapo.config")

_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


class _Loader(yaml.SafeLoader):
    """YAML 1.1, but only true/false are booleans (as in YAML 1.2): a bare `off`, `on`, `yes` or `no` stays the
    word, so `mode: off` names the mode; a bool field still reads those words (pydantic's lax booleans)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))


def read_yaml(text: str) -> Any:
    """Configs, overrides, manifests and the configs saved in runs and checkpoints are read with this one loader
    (YAML 1.1's yes/no/on/off stay strings: only true/false are booleans)."""
    return yaml.load(text, Loader=_Loader)  # a SafeLoader: no arbitrary objects


# A command-line token that is a config setting, key.path=value: what gapo-sweep and gapo-eval take from among their
# flags and positional paths (gapo-train takes every positional word as one).
# A key with a dot (section.field), or one of the config's top-level fields that is no section (plugins=[...]); a bare
# name=value is not taken, so that a value such as gapo-eval's --benchmarks mine=problems.jsonl stays the flag's.
_TOP_FIELDS = [n for n, f in Config.model_fields.items()
               if not (isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel))]
OVERRIDE = re.compile(rf"^([A-Za-z_]\w*(\.\w+)+|{'|'.join(_TOP_FIELDS)})=")


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected key.path=value, e.g. trainer.lr=2e-6")
    key, raw = item.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {item!r}: empty key path")
    try:
        value = read_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as err:
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        quoted = f": '{key}=\"{raw}\"'" if '"' not in raw and "'" not in raw else ""
        raise ConfigError(f"override {item!r}: the value is not valid YAML ({problem}); to pass it as text, quote it "
                          f"inside the shell's quotes{quoted}") from None
    if isinstance(value, str) and _FLOAT.fullmatch(value):  # YAML 1.1 reads 2e-6 (no dot) as a string
        value = float(value)
    return key.split("."), value


def _set_path(tree: dict, path: list[str], value: Any) -> None:
    node = tree
    for i, part in enumerate(path[:-1]):
        child = node.setdefault(part, {})
        if child is None:  # a section that is off (model.lora: null) is switched on by setting one of its keys
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[:i + 1])} is not a section")
        node = child
    node[path[-1]] = value


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            hint = did_you_mean(path, dict(field_descriptions())) or "; check the spelling"
            lines.append(f"{path}: unknown key{hint} (see `gapo-train --print-config`)")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            got = f" (got {e['input']!r})" if e["type"] != "value_error" and not isinstance(e["input"], dict) else ""
            lines.append(f"{path}: {msg}{got}" if path else msg)
    return "invalid configuration:\n  " + "\n  ".join(lines)


def find_config_file(name: str | Path) -> Path:
    """A path that exists wins; a bare name falls back to the configs shipped with the package."""
    p = Path(name)
    if p.is_file():
        return p
    for cand in (CONFIGS_DIR / p.name, CONFIGS_DIR / f"{p.name}.yaml"):
        if p.parent == Path(".") and cand.is_file():
            return cand
    shipped = sorted(f.stem for f in CONFIGS_DIR.glob("*.yaml"))
    raise ConfigError(f"config file {str(name)!r} not found (nor among the shipped configs in {CONFIGS_DIR})"
                      f"{did_you_mean(p.stem, shipped)}")


def resolve(raw: dict | None = None, overrides: list[str] | tuple[str, ...] = (),
            config_name: str | None = None) -> Config:
    """Merge raw YAML data (a config file), dotted overrides (the command line) and the algorithm preset.

    Precedence: command line > file > preset. One exception makes baseline commands mean what they say:
    when the command line names another algorithm than the file (`--config qwen_math algorithm.name=grpo`),
    the file's method switches (PRESET_SWITCHES) are dropped, because they described the file's method;
    the file's model-level settings (`clip_widths`, `correct_threshold`, `kl_coef`, `loss_constant`) stay.

    `config_name`: the config's name (its file's), for the run directory when neither the file nor the command line sets
    trainer.output_dir: runs/<name>/<method>/seed<seed> (see `default_output_dir`).
    """
    tree = copy.deepcopy(raw) if raw else {}
    if not isinstance(tree, dict):
        raise ConfigError(f"configuration must be a mapping of sections, got {type(tree).__name__}")
    upgrade(tree)
    tree = {k: ([] if k == "plugins" else {}) if v is None else v for k, v in tree.items()}  # left empty
    file_algo = tree.get("algorithm") or {}
    if not isinstance(file_algo, dict):
        raise ConfigError(f"algorithm: expected a mapping, got {file_algo!r}")
    file_algo = dict(file_algo)  # as the file has it, before the overrides write into the tree
    cli_algo: dict[str, Any] = {}
    method_overrides: list[tuple[str, Any]] = []  # algorithm.* from the command line, for the run directory's name
    for item in overrides:
        path, value = _parse_override(item)
        _set_path(tree, path, value)
        if path[0] == "algorithm" and len(path) == 2:
            cli_algo[path[1]] = value
        if path[0] == "algorithm" and path[1:] != ["name"]:
            method_overrides.append((".".join(path[1:]), value))
    if tree.get("plugins"):  # before anything reads a rule or a rewarder's name that a plugin adds
        tree["plugins"] = load_plugins(tree["plugins"])
    tree["algorithm"] = _algorithm(tree.get("algorithm") or {}, file_algo, cli_algo)
    try:
        cfg = Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None
    # "null: another field" defaults, filled here once, so that every reader sees the value that runs.
    if cfg.algorithm.loss_constant is None:
        cfg.algorithm.loss_constant = float(cfg.rollout.max_new_tokens)
    if cfg.eval.max_new_tokens is None:
        cfg.eval.max_new_tokens = cfg.rollout.max_new_tokens
    if cfg.eval.instruction is None:
        cfg.eval.instruction = cfg.data.instruction
    if cfg.trainer.output_dir is None:
        cfg.trainer.output_dir = default_output_dir(cfg, config_name, method_overrides)
    return cfg


def _algorithm(algo: Any, file_algo: dict, cli_algo: dict) -> dict:
    """The algorithm section as it runs: the preset's switches under the ones set (a command line naming another
    algorithm than the file drops the file's switches, see `resolve`)."""
    if not isinstance(algo, dict):
        raise ConfigError(f"algorithm: expected a mapping, got {algo!r}")
    name = algo.get("name", "gapo")
    if not isinstance(name, str) or name not in PRESETS:
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; allowed: {', '.join(PRESETS)}"
                          f"{did_you_mean(str(name), PRESETS)}")
    if "name" in cli_algo and name != file_algo.get("name", "gapo"):
        dropped = sorted(k for k in PRESET_SWITCHES if k in file_algo and k not in cli_algo)
        if dropped:
            log.info("algorithm.name=%s on the command line: not using the config file's %s (they set up %s)",
                     name, ", ".join(f"algorithm.{k}" for k in dropped), file_algo.get("name", "gapo"))
        algo = {k: v for k, v in algo.items() if k not in dropped}
    merged = {**preset_switches(name, algo), **{k: v for k, v in algo.items() if v is not None}}
    clip = merged.get("clip")
    if merged.get("surrogate") is None and isinstance(clip, str) and clip in RULES:  # the loss its bounds are for
        merged["surrogate"] = RULES[clip].surrogate
    # Configs written before each rule had its own shape carry both upper fields, always equal: keep the rule's.
    clip = merged.get("clip")
    own = RULES[clip].upper_field if isinstance(clip, str) and clip in RULES else UPPER_FIELDS[0]
    other = UPPER_FIELDS[1 - UPPER_FIELDS.index(own)]
    if other in merged and merged[other] == merged.get(own):
        del merged[other]
    return merged


def default_output_dir(cfg: Config, name: str | None, method_overrides: list[tuple[str, Any]]) -> str:
    """Where a run goes when nothing names its directory: runs/<config>/<method>/seed<seed>, the method being the
    algorithm and any algorithm.* set on the command line (gspo-eps_hi5e-3), so that a config's baselines and
    seeds never collide. A resumed run goes on in the run it resumes (a new algorithm there branches next to it)."""
    if cfg.trainer.resume_from and cfg.trainer.resume_from != "auto":
        return str(run_of(cfg.trainer.resume_from))
    parts = [cfg.algorithm.name]
    for key, value in sorted(method_overrides):
        values = value if isinstance(value, list | tuple) else [value]
        text = ",".join(fmt_eps(v) if isinstance(v, float) else str(v) for v in values)
        parts.append(f"{key}{text}".replace("/", "_").replace(" ", ""))
    return str(Path("runs") / (name or "run") / "-".join(parts) / f"seed{cfg.trainer.seed}")


def upgrade(tree: dict) -> None:
    """Keys that configs written by earlier versions (run directories, checkpoints) carry, in today's terms, so that
    a run trained before an upgrade resumes, evaluates and plots after it. In place."""
    rollout = tree.get("rollout")
    if isinstance(rollout, dict) and "enforce_eager" in rollout:  # before rollout.compile
        eager = rollout.pop("enforce_eager")
        rollout.setdefault("compile", "eager" if eager else "auto")
    reward = tree.get("reward")
    if isinstance(reward, dict) and "modules" in reward:  # before the top-level plugins (b97f3cd)
        modules = reward.pop("modules") or []
        plugins = tree.get("plugins") or []
        tree["plugins"] = [*plugins, *(m for m in modules if m not in plugins)]


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def read_config_file(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """YAML as a dict; a top-level `base: other.yaml` (relative to this file, or a shipped name) is read
    first and this file's keys are merged over it, so a variant config states only what differs."""
    file = find_config_file(path).resolve()
    if file in _seen:
        raise ConfigError(f"{file}: `base` chain loops back to itself")
    try:
        raw = read_yaml(file.read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{file}: not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file}: not UTF-8 text ({err.reason} at byte {err.start}): is it a config file?") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: expected a mapping of sections, got {type(raw).__name__}")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str):
        raise ConfigError(f"{file}: base: expected the name or path of another config file, got {base!r}")
    near = file.parent / base
    return _merge(read_config_file(near if near.is_file() else base, (*_seen, file)), raw)


def load_config(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    return resolve(read_config_file(path), overrides, config_name=find_config_file(path).stem)


def dump_config(cfg: Config, *, comments: bool = False) -> str:
    """The config as YAML; `comments`: each field's description above it (`--print-config`)."""
    if not comments:
        return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
    return "".join(_commented(cfg, cfg.model_dump(mode="json"), ""))


def _commented(model: BaseModel, data: dict, pad: str) -> list[str]:
    out = []
    for name, field in type(model).model_fields.items():
        if field.description:
            out += [f"{pad}# {line}\n" for line in textwrap.wrap(field.description, 98 - len(pad))]
        value = getattr(model, name)
        if isinstance(value, BaseModel):
            out += [f"{pad}{name}:\n", *_commented(value, data[name], pad + "  ")]
        else:
            out.append(textwrap.indent(yaml.safe_dump({name: data[name]}, sort_keys=False), pad))
    return out


def field_descriptions(model: type[BaseModel] = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted field name, description) of every described field, sections included (`--help`)."""
    out = []
    for name, field in model.model_fields.items():
        if field.description:
            out.append((prefix + name, field.description))
        for sub in (field.annotation, *get_args(field.annotation)):  # a section, or an optional one
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                out += field_descriptions(sub, f"{prefix}{name}.")
    return out


_imported: dict[str, object] = {}  # plugins imported in this process, by absolute path or module name


def load_plugins(plugins: Any) -> list[str]:
    """Import the config's plugins once per process (a rank, the launcher, gapo-compare reading a run) and return
    them as saved: a file by its absolute path, so that a resumed run or a report finds it from any folder."""
    import importlib
    import importlib.util
    import sys

    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        raise ConfigError(f"plugins: expected a list of .py files or module names, got {plugins!r}")
    saved = []
    for name in plugins:
        key = str(Path(name).resolve()) if name.endswith(".py") else name
        saved.append(key)
        if key in _imported:
            continue
        if name.endswith(".py"):
            if not Path(key).is_file():
                raise ConfigError(f"plugins: {name}: no such file (a path is read from where the command runs: "
                                  f"{Path.cwd()})")
            spec = importlib.util.spec_from_file_location(f"gapo_plugin_{len(_imported)}", key)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            try:
                spec.loader.exec_module(module)
            except (ValueError, ConfigError) as err:  # a register() that refused: the plugin, and why
                raise ConfigError(f"plugins: {name}: {err}") from err
            except SyntaxError as err:  # the file is not Python yet: where, not a traceback into importlib
                raise ConfigError(f"plugins: {name}: line {err.lineno}: {err.msg}") from None
        else:
            try:
                module = importlib.import_module(name)
            except ModuleNotFoundError as err:
                raise ConfigError(f"plugins: {name}: not importable ({err}); give a .py file or a module on the "
                                  "Python path") from None
        _imported[key] = module
    return saved
