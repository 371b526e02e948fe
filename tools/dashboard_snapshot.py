"""The monitoring dashboard's panels over a real local run, as one picture (k8s/README.md shows it).

    python -m tools.dashboard_snapshot --out k8s/components/monitoring/dashboard.png

Grafana is not installed here, so the picture is the same PromQL evaluated by a real Prometheus and
plotted: the stack `make run` starts (tools.run_stack.Stack: the tiny checkpoint on the CPU), the
`prometheus` binary (Debian's package) scraping every metrics port every 2 s as the PodMonitors would,
traffic from the load driver (a lifecycle run, whose third session is refused, then paced sessions),
and then every panel's queries from k8s/components/monitoring/dashboard.json, with Grafana's
`$__rate_interval` set to 10 s, evaluated over the run with query_range and drawn with matplotlib.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

from tools.procs import REPO_ROOT, free_port
from tools.run_stack import Stack

DASHBOARD = REPO_ROOT / "k8s" / "components" / "monitoring" / "dashboard.json"
SCRAPE_S = 2
RATE_INTERVAL = "10s"
UNITS = {"s": ("ms", 1000.0), "bytes": ("GiB", 1 / 2**30), "percent": ("%", 1.0), "reqps": ("/s", 1.0),
         "short": ("", 1.0)}


def prometheus_config(stack: Stack) -> dict:
    """One job per kind of pod, labelled as the PodMonitors' targets would be (pod, stage by the metric)."""
    g = stack.gateway
    cells = [{"targets": [f"{p.host}:{p.metrics_port}" for p in cell.all()], "labels": {"pod": f"cell-{i}"}}
             for i, cell in enumerate(stack.cell_procs)]
    return {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
            "scrape_configs": [
                {"job_name": "gateway", "static_configs": [{"targets": [f"{g.host}:{g.port}"],
                                                            "labels": {"pod": "gateway-0"}}]},
                {"job_name": "cells", "static_configs": cells}]}


def query_range(base: str, expr: str, start: float, end: float) -> list[dict]:
    q = urllib.parse.urlencode({"query": expr.replace("$__rate_interval", RATE_INTERVAL), "start": start,
                                "end": end, "step": SCRAPE_S})
    with urllib.request.urlopen(f"{base}/api/v1/query_range?{q}", timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    for k, v in labels.items():
        fmt = fmt.replace("{{" + k + "}}", v)
    return fmt


def drive_traffic(stack: Stack, out: Path, sessions: int) -> None:
    """A lifecycle run (two sessions, a third refused, a replacement), paced sessions, and the lifecycle
    again (a refusal counter's series starts at its first refusal, so a rate shows from the second on)."""
    common = [sys.executable, "-m", "tools.load_driver", "--url", stack.gateway.ws_url, "--progress", "false"]
    for i, mode in enumerate(("lifecycle", "load", "lifecycle")):
        args = ["--capacity", str(stack.sessions)] if mode == "lifecycle" else ["--sessions", str(sessions),
                                                                                "--load-frames", "500"]
        subprocess.run([*common, *args, "--output-dir", str(out / f"{i}-{mode}")], cwd=REPO_ROOT, timeout=600)


def plot(panels: list[dict], series: dict, start: float, out: Path, note: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = (len(panels) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.2 * rows), constrained_layout=True)
    for ax, panel in zip(axes.flat, panels):
        unit, scale = UNITS.get(panel["fieldConfig"]["defaults"].get("unit", "short"), ("", 1.0))
        drawn = 0
        for target in panel["targets"]:
            for s in series[(panel["id"], target["refId"])]:
                t = [float(x) - start for x, _ in s["values"]]
                y = [float(v) * scale for _, v in s["values"]]
                ax.plot(t, y, label=legend(target.get("legendFormat", ""), s["metric"]))
                drawn += 1
        ax.set_title(panel["title"], fontsize=10)
        ax.set_xlabel("s into the run", fontsize=8)
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=8)
        if drawn:
            ax.legend(fontsize=7, loc="upper left")
        else:
            ax.text(0.5, 0.5, "no data in this run", ha="center", va="center", transform=ax.transAxes, fontsize=9)
    fig.suptitle(note, fontsize=10)
    fig.savefig(out, dpi=80)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.dashboard_snapshot", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="the PNG to write")
    p.add_argument("--sessions", type=int, default=2, help="paced sessions after the lifecycle run")
    a = p.parse_args(argv)
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        print("needs the prometheus binary: apt-get install prometheus", file=sys.stderr)
        return 2
    from tools.make_checkpoint import ensure_checkpoint

    panels = json.loads(DASHBOARD.read_text())["panels"]
    with tempfile.TemporaryDirectory() as tmp, Stack(ensure_checkpoint("tiny", seed=0), sessions=2) as stack:
        tmp = Path(tmp)
        (tmp / "prometheus.yml").write_text(json.dumps(prometheus_config(stack)))  # JSON is YAML
        port = free_port("127.0.0.1")
        prom = subprocess.Popen([prometheus, f"--config.file={tmp / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            start = time.time()
            time.sleep(3 * SCRAPE_S)
            drive_traffic(stack, tmp, a.sessions)
            time.sleep(3 * SCRAPE_S)
            end = time.time()
            base = f"http://127.0.0.1:{port}"
            series = {(panel["id"], t["refId"]): query_range(base, t["expr"], start, end)
                      for panel in panels for t in panel["targets"]}
        finally:
            prom.terminate()
            prom.wait(10)
    note = (f"{DASHBOARD.relative_to(REPO_ROOT)}: its PromQL over a make run (tiny checkpoint, CPU, one cell of "
            f"2 slots), scraped by Prometheus every {SCRAPE_S} s\nthe load driver: a lifecycle run (its third "
            f"session refused), {a.sessions} paced sessions, the lifecycle run again")
    plot(panels, series, start, a.out, note)
    print(f"wrote {a.out} ({sum(len(v) for v in series.values())} series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
