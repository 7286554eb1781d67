"""Run `tokenmill bench` in-process and read back what it wrote."""

import json
from pathlib import Path

from tokenmill.cli import main


def run_bench(url: str, out: Path, *args: str, plots: bool = False) -> tuple[int, dict, list[dict]]:
    argv = ["bench", "--target", url, "--out", str(out), "--no-progress", *args]
    if not plots:
        argv.append("--no-plots")
    rc = main(argv)
    result = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()] \
        if (out / "requests.jsonl").exists() else []
    return rc, result, rows
