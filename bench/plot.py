#!/usr/bin/env python3
"""Draws the PNG plots of a `deltaserve bench` JSON file (matplotlib; run on the GPU machine by
scripts/gpu_bench.sh, or anywhere with matplotlib):

  tpot.png     decode TPOT (P50, with P99 as error bars) vs context, one line per batch size,
               against the bandwidth floor of each (dashed), with the peers' TPOT when given
  ttft.png     prefill TTFT vs prompt length against the FLOP floor, with peers when given
  profile.png  per-kernel-class breakdown of one decode step and one prefill chunk

Usage: plot.py BENCH.json [--peers PEERS.json] [--out DIR]
"""
import argparse
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"plot.py: cannot read {path}: {e}")


def title_of(doc):
    meta = doc.get("meta", {})
    dev = meta.get("device", meta.get("device_option", "?"))
    commit = str(meta.get("commit", "?"))[:10]
    return f"{dev}\ncommit {commit}, {meta.get('date', '?')}"


def plot_tpot(plt, doc, peers, out):
    rows = doc.get("decode") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    batches = sorted({r["batch"] for r in rows})
    for i, b in enumerate(batches):
        rs = sorted((r for r in rows if r["batch"] == b), key=lambda r: r["context"])
        x = [r["context_mean"] for r in rs]
        p50 = [r["tpot_s"]["p50"] * 1e3 for r in rs]
        p99 = [r["tpot_s"]["p99"] * 1e3 for r in rs]
        err = [[0] * len(rs), [hi - lo for lo, hi in zip(p50, p99)]]
        line = ax.errorbar(x, p50, yerr=err, marker="o", capsize=3, label=f"batch {b} (P50, bar to P99)")
        floors = [r["floor_s"] * 1e3 for r in rs if r.get("floor_s")]
        if len(floors) == len(rs):
            ax.plot(x, floors, "--", color=line[0].get_color(), alpha=0.7, label=f"batch {b} floor (bytes / read BW)")
    for name, pts in (peers or {}).get("tpot", {}).items():
        pts = sorted(pts, key=lambda p: p["context"])
        if pts:
            ax.plot([p["context"] for p in pts], [p["tpot_s"] * 1e3 for p in pts], "s:", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("TPOT (ms per step)")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("decode TPOT vs context\n" + title_of(doc), fontsize=9)
    path = os.path.join(out, "tpot.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ttft(plt, doc, peers, out):
    rows = doc.get("prefill") or []
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(8, 5))
    rows = sorted(rows, key=lambda r: r["prompt"])
    x = [r["prompt"] for r in rows]
    ax.plot(x, [r["ttft_s"]["p50"] for r in rows], "o-", label="deltaserve TTFT (P50)")
    if all(r.get("floor_s") for r in rows):
        ax.plot(x, [r["floor_s"] for r in rows], "k--", label="FLOP floor (FLOPs / GEMM ceiling)")
    for name, pts in (peers or {}).get("ttft", {}).items():
        pts = sorted(pts, key=lambda p: p["prompt"])
        ax.plot([p["prompt"] for p in pts], [p["ttft_s"] for p in pts], "s:", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("TTFT (s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title("prefill TTFT vs prompt length\n" + title_of(doc), fontsize=9)
    path = os.path.join(out, "ttft.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_profile(plt, doc, out):
    profs = doc.get("profile") or []
    if not profs:
        return None
    fig, axes = plt.subplots(1, len(profs), figsize=(7 * len(profs), 5))
    if len(profs) == 1:
        axes = [axes]
    for ax, p in zip(axes, profs):
        es = sorted(p["entries"], key=lambda e: e["time_s"])
        names = [e["kernel"] for e in es]
        t = [e["time_s"] * 1e3 for e in es]
        bars = ax.barh(names, t)
        for bar, e in zip(bars, es):
            rate = (f"{e['bytes'] / e['time_s'] / 1e9:.0f} GB/s" if e["flops"] < 50 * e["bytes"]
                    else f"{e['flops'] / e['time_s'] / 1e12:.0f} TFLOP/s") if e["time_s"] > 0 else ""
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2,
                    f" {100 * e['share']:.1f}%  {rate}", va="center", fontsize=7)
        total = p["kernel_sum_s"] * 1e3
        meas = p.get("measured_s")
        sub = f"kernel sum {total:.3f} ms" + (f", engine step {meas * 1e3:.3f} ms" if meas else "")
        ax.set_title(f"{p['phase']}: {p['shape']}\n{sub}", fontsize=9)
        ax.set_xlabel("ms per step")
        ax.set_xlim(0, max(t) * 1.45 if t else 1)
        ax.tick_params(axis="y", labelsize=7)
    fig.suptitle("per-kernel breakdown (isolated kernel timings at the forward's shapes)\n" + title_of(doc),
                 fontsize=9)
    path = os.path.join(out, "profile.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bench_json")
    ap.add_argument("--peers", help="JSON written by bench/peers/peers.py")
    ap.add_argument("--out", default=".", help="folder for the PNG files")
    a = ap.parse_args()
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("plot.py: matplotlib is not installed")
    doc = load(a.bench_json)
    peers = load(a.peers) if a.peers and os.path.exists(a.peers) else None
    os.makedirs(a.out, exist_ok=True)
    for p in (plot_tpot(plt, doc, peers, a.out), plot_ttft(plt, doc, peers, a.out), plot_profile(plt, doc, a.out)):
        if p:
            print("wrote", p)


if __name__ == "__main__":
    main()
