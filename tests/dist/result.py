"""What every multi-rank check script here ends with: its rank's result as JSON at <out>.<rank>, which
tests/conftest.py's run_torchrun reads back (a missing file tells a fault in the work from one on the way out)."""

import json


def write_result(out: str, rank: int, result: dict) -> None:
    with open(f"{out}.{rank}", "w") as f:
        json.dump(result, f)
