"""Replay every corpus file (fuzz/corpus/<harness>/*) through its harness.

    python -m fuzz.replay                  # every harness; a line per harness with its digest
    python -m fuzz.replay --harness stream # one harness
    python -m fuzz.replay --json           # {harness: {file: outcome}}: compared between twins
    python -m fuzz.replay --findings       # replay fuzz/findings/* too (known defects: they fail)

Exit status 1 when any input is a finding (its harness raised), with the file and the error.
Runs without atheris.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import sys
import traceback

HARNESSES = ("baidu_server", "http_server", "h2_server", "stream", "baidu_client", "grpc_client",
             "compress", "json_transcode", "naming", "codec", "collective", "lanes", "lane_messages",
             "tensor_meta", "ps_server")
ROOT = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(ROOT, "corpus")
FINDINGS = os.path.join(ROOT, "findings")


def files(harness: str, findings: bool = False) -> list[str]:
    d = os.path.join(FINDINGS if findings else CORPUS, harness)
    if not os.path.isdir(d):
        return []
    return sorted(os.path.join(d, f) for f in os.listdir(d) if not f.startswith("."))


def replay(harness: str, paths: list[str]) -> tuple[dict, list]:
    mod = importlib.import_module(f"fuzz.{harness}")
    outcomes, failures = {}, []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        try:
            outcomes[os.path.basename(path)] = mod.one_input(data)
        except Exception as e:  # noqa: BLE001 - every exception out of a harness is a finding
            outcomes[os.path.basename(path)] = f"FINDING {type(e).__name__}: {e}"
            failures.append((path, "".join(traceback.format_exception(e))))
    return outcomes, failures


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--harness", action="append", choices=HARNESSES, help="only this harness (repeatable)")
    ap.add_argument("--json", action="store_true", help="print {harness: {file: outcome}} as JSON")
    ap.add_argument("--findings", action="store_true", help="replay fuzz/findings/<harness>/* instead")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every file's outcome")
    args = ap.parse_args(argv)
    result, failures = {}, []
    for h in args.harness or HARNESSES:
        outcomes, failed = replay(h, files(h, args.findings))
        result[h] = outcomes
        failures += failed
    if args.json:
        json.dump(result, sys.stdout, indent=1, sort_keys=True)
        print()
    else:
        for h, outcomes in result.items():
            digest = hashlib.sha256(json.dumps(outcomes, sort_keys=True).encode()).hexdigest()[:16]
            print(f"{h:16} {len(outcomes):5} inputs  digest {digest}")
            if args.verbose:
                for name, out in outcomes.items():
                    print(f"    {name}: {out}")
    for path, tb in failures:
        print(f"\nFINDING in {path}:\n{tb}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
