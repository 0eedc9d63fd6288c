"""Renders or lints a Helm chart with Helm's own engine (the helm-python-sdk package:
Helm's Go SDK as a shared library), for the Rust tests in this directory.

Reads one JSON request on stdin:
  {"op": "render" | "lint", "chart": DIR, "release": NAME, "namespace": NS, "values": {...}}
and writes one JSON answer on stdout: for "render" the rendered templates
({"mlaserve/templates/x.yaml": text, ...}), for "lint" Helm's lint report. A template
error is printed to stderr with exit status 1. No cluster and no network are used.
"""

import json
import sys

import helm_python as helm


def main() -> int:
    req = json.load(sys.stdin)
    try:
        if req["op"] == "render":
            with helm.Chart.load(req["chart"]) as chart:
                out = chart.render(req["values"], name=req["release"], namespace=req["namespace"])
        elif req["op"] == "lint":
            out = helm.lint(req["chart"], req["values"], namespace=req["namespace"])
        else:
            print(f"unknown op {req['op']!r}", file=sys.stderr)
            return 2
    except helm.HelmError as e:
        print(f"helm: {e}", file=sys.stderr)
        return 1
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
