#!/usr/bin/env python3
"""Prints the GPU table of the device bundle from `gpu bench --json`, the torch peer's JSON and
(optionally) `gpu_io bench --json` and `gpu_select bench --json`: our attention times, the
peers' times and the ratios, the fraction of copy bandwidth, the Quest rows with their ratios
to the peers, then the diff and IO rows."""
import json
import sys


def rows_table(title, rows, width, queued):
    """Prints a tool's rows: name, ms (and queued ms), GB/s where it moved bytes, note."""
    head = f"{title:<{width}} {'ms':>9}" + (f" {'queued':>9}" if queued else "")
    print(f"{head} {'GB/s':>7}  note")
    for name, r in rows.items():
        gbs = r["bytes"] / r["ms"] / 1e6 if r["bytes"] else 0.0
        line = f"{name:<{width}} {r['ms']:>9.4f}" + (f" {r['queued_ms']:>9.4f}" if queued else "")
        print(f"{line} {gbs:>7.1f}  {r['note']}")


def load(path):
    try:
        with open(path) as f:
            data = json.load(f)
        return {r["name"]: r for r in data["rows"]}, data["device"]
    except (OSError, ValueError, KeyError):
        return {}, "?"


def main():
    ours, dev = load(sys.argv[1])
    peers, _ = load(sys.argv[2])
    if not ours:
        print("no GPU bench results")
        return
    copy = ours.get("copy d2d 1 GiB")
    bw = copy["bytes"] / copy["ms"] / 1e6 if copy else float("nan")
    print(f"device: {dev}; copy bandwidth {bw:.0f} GB/s (read + write, same run)")
    print("times in ms, synced / queued (each run waited for / runs enqueued back to back)")
    print(f"{'shape':<15} {'ours':>15} {'judged':>11} | {'SDPA dense':>15} {'ratio':>11} | "
          f"{'gather+SDPA':>15} {'ratio':>11}")
    # (row label, our bench row, how our time is judged, the second peer)
    kinds = [
        ("dense", "dense decode {}", "bw", "torch gather+SDPA {}"),
        ("sparse", "sparse decode 2K {}", "floor", "torch sparse gather+SDPA 2K {}"),
    ]

    def pair(r):
        return r["ms"], r.get("queued_ms", r["ms"])

    for label, ours_name, judge, peer_name in kinds:
        for tag in ["B8 L32K", "B1 L128K"]:
            o = ours.get(ours_name.format(tag))
            if not o:
                continue
            ot = pair(o)
            if judge == "bw":
                fig = "/".join(f"{o['bytes'] / t / 1e6 / bw:.2f}" for t in ot)
            else:
                fig = "/".join(f"{t / (o['bytes'] / (bw * 1e6)):.2f}F" for t in ot)
            line = f"{label + ' ' + tag:<15} {ot[0]:>7.4f}/{ot[1]:<7.4f} {fig:>11} | "
            for peer in [peers.get(f"torch SDPA dense {tag}"), peers.get(peer_name.format(tag))]:
                if peer:
                    pt = pair(peer)
                    line += (f"{pt[0]:>7.4f}/{pt[1]:<7.4f} "
                             f"{pt[0] / ot[0]:>5.2f}x/{pt[1] / ot[1]:.2f}x | ")
                else:
                    line += f"{'-':>15} {'-':>11} | "
            print(line.rstrip(" |"))
    print("judged: dense, fraction of the copy bandwidth (goal >= 0.85); sparse, time over its "
          "bytes floor (F, goal <= 1.3). ratio: peer time / our time (sparse rows: SDPA dense, "
          "then torch sparse gather+SDPA)")
    sel, _ = load(sys.argv[4]) if len(sys.argv) > 4 else ({}, "?")
    if sel:
        print()
        rows_table("sparse-algo Quest", sel, 36, queued=True)
        print()
        print("Quest estimate + top-k + sparse attention (2K budget) against the torch peers, "
              "synced / queued (tc: scores on tensor cores; graph: replayed from a CUDA graph; "
              "published: attention waits per row; e4m3: Quest's bounds in FP8 E4M3):")
        goals = {"B8 L32K": 5.0, "B1 L128K": 6.0}
        for (tag, goal), how in [(g, h) for g in goals.items()
                                 for h in ["", " tc", " tc graph", " tc published",
                                           " tc graph published", " e4m3", " tc graph e4m3",
                                           " tc published e4m3", " tc graph published e4m3",
                                           " tc graph published e4m3 1 of 8 layers",
                                           " tc graph published e4m3 8 layers",
                                           " tc graph published e4m3 8 layers one graph",
                                           " tc graph e4m3 1 of 8 layers",
                                           " tc graph e4m3 8 layers",
                                           " tc graph e4m3 8 layers one graph"]]:
            o = sel.get(f"quest+sparse attn 2K{how} {tag}")
            if not o:
                continue
            ot = pair(o)
            line = f"  {tag + how:<32} ours {ot[0]:.4f}/{ot[1]:.4f} ms"
            for peer, want in [(f"torch SDPA dense {tag}", goal),
                               (f"torch Quest pipeline 2K {tag}", 10.0)]:
                p = peers.get(peer)
                if p:
                    pt = pair(p)
                    line += (f"; {peer} {pt[0]:.4f}/{pt[1]:.4f} ms = "
                             f"{pt[0] / ot[0]:.2f}x/{pt[1] / ot[1]:.2f}x (goal >= {want:g}x)")
            print(line)
    io, _ = load(sys.argv[3]) if len(sys.argv) > 3 else ({}, "?")
    if io:
        print()
        rows_table("offload diff and IO", io, 32, queued=False)


if __name__ == "__main__":
    main()
