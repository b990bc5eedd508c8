#!/usr/bin/env python3
"""Prints the GPU attention table of the device bundle from `gpu bench --json` and the torch
peer's JSON: our time, the peers' times and the ratios, and the fraction of copy bandwidth."""
import json
import sys


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
    print(f"{'shape':<14} {'ours ms':>9} {'of copy bw':>10} | {'SDPA ms':>8} {'ratio':>6} | "
          f"{'gather+SDPA':>11} {'ratio':>6}")
    # (row label, our bench row, how our time is judged, the second peer)
    kinds = [
        ("dense", "dense decode {}", "bw", "torch gather+SDPA {}"),
        ("sparse", "sparse decode 2K {}", "floor", "torch sparse gather+SDPA 2K {}"),
    ]
    for label, ours_name, judge, peer_name in kinds:
        for tag in ["B8 L32K", "B1 L128K"]:
            o = ours.get(ours_name.format(tag))
            if not o:
                continue
            if judge == "bw":
                fig = f"{o['bytes'] / o['ms'] / 1e6 / bw:>10.2f}"
            else:
                fig = f"{o['ms'] / (o['bytes'] / (bw * 1e6)):>9.2f}F"
            line = f"{label + ' ' + tag:<14} {o['ms']:>9.4f} {fig} | "
            for width, peer in [(8, peers.get(f"torch SDPA dense {tag}")),
                                (11, peers.get(peer_name.format(tag)))]:
                line += (f"{peer['ms']:>{width}.4f} {peer['ms'] / o['ms']:>5.2f}x | " if peer
                         else f"{'-':>{width}} {'-':>6} | ")
            print(line.rstrip(" |"))
    print("dense: fraction of the copy bandwidth (goal >= 0.85); sparse: time over its bytes floor "
          "(F, goal <= 1.3); ratios: peer time / our time (sparse rows: SDPA dense, then torch "
          "sparse gather+SDPA)")


if __name__ == "__main__":
    main()
