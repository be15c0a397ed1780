"""gapo-compare: runs compared across seeds, three ways, each a subcommand of its own module.

    gapo-compare table MANIFEST        a sweep's paper table from its evaluations (gapo.study.tables)
    gapo-compare seeds LABEL=RUN,...   labels of several seeds each: estimates, CIs, paired tests (gapo.study.seeds)
    gapo-compare band RUN... --rules   where two clip rules decide differently, per c (gapo.study.band)

Subcommands are named, not guessed from the arguments' shape: a run directory or a manifest path may hold an "="
too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gapo.errors import ConfigError, Exit
from gapo.study import band, seeds, tables
from gapo.study.manifest import load_manifest
from gapo.study.sweep import known_blocks


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gapo-compare", description="Seeds aggregated into the paper's tables and "
                                "figures (table), several seeds per label compared directly (seeds), or two clip "
                                "rules' decisions on logged ratios (band).")
    sub = p.add_subparsers(dest="command", required=True, metavar="{table,seeds,band}")
    table = sub.add_parser("table", help="a manifest's paper table from its sweep's evaluations",
                           description=tables.__doc__.split("\n\n")[0])
    table.add_argument("manifest", help="experiments/NAME.yaml, or NAME")
    table.add_argument("--out", type=Path, help="default: <output_root>/<manifest>/compare")
    table.add_argument("--output-root", help="where the sweep wrote its runs (default: the manifest's output_root)")
    by_seed = sub.add_parser("seeds", help="labels of several seeds each: mean ± CI, tests paired by seed, figures",
                             description=seeds.__doc__.split("\n\n")[0],
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    seeds.add_arguments(by_seed)
    bands = sub.add_parser("band", help="where two clip rules decide differently, per c, on logged runs' ratios",
                           description=band.__doc__.split("\n\n")[0])
    bands.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories with rollouts.jsonl")
    bands.add_argument("--rules", nargs=2, required=True, metavar="NAME:EPS_LO[/EPS_HI]",
                       help="the two rules, e.g. gapo:0.003/0.015 gspo:0.003/0.015 (the upper width is eps_hi_max of "
                            "an adaptive rule, eps_hi of a fixed one; without it a fixed rule is symmetric)")
    args = p.parse_args(sys.argv[1:] if argv is None else list(argv))
    if args.command == "seeds":
        return seeds.run(args)
    if args.command == "band":
        return band.main(args)
    try:
        path = tables.write(known_blocks(load_manifest(args.manifest)), args.output_root, args.out)
    except ConfigError as err:
        print(f"gapo-compare: {err}", file=sys.stderr)
        return Exit.CONFIG
    print(f"gapo-compare: wrote {path}, {path.with_suffix('.csv').name} and the figures")
    return 0


if __name__ == "__main__":
    sys.exit(main())
