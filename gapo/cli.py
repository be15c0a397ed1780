"""Command-line entry points."""

from __future__ import annotations

import argparse
import sys

from gapo.config import ConfigError, dump_config, load_config


def train_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gapo-train", description="Train a policy with GAPO and its baselines.")
    p.add_argument("--config", required=True, help="YAML file, or the name of a config shipped in configs/")
    p.add_argument("--print-config", action="store_true", help="print the fully resolved config and exit")
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="e.g. algorithm.name=gspo trainer.lr=2e-6")
    args = p.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as err:
        print(f"gapo-train: {err}", file=sys.stderr)
        return 2
    if args.print_config:
        sys.stdout.write(dump_config(cfg))
        return 0
    print("gapo-train: training is not available yet; only --print-config works in this version", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(train_main())
