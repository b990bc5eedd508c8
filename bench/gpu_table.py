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
    for tag in ["B8 L32K", "B1 L128K"]:
        o = ours.get(f"dense decode {tag}")
        if not o:
            continue
        frac = o["bytes"] / o["ms"] / 1e6 / bw
        sd = peers.get(f"torch SDPA dense {tag}")
        ga = peers.get(f"torch gather+SDPA {tag}")
        line = f"{'dense ' + tag:<14} {o['ms']:>9.4f} {frac:>10.2f} | "
        line += f"{sd['ms']:>8.4f} {sd['ms'] / o['ms']:>5.2f}x | " if sd else f"{'-':>8} {'-':>6} | "
        line += f"{ga['ms']:>11.4f} {ga['ms'] / o['ms']:>5.2f}x" if ga else f"{'-':>11} {'-':>6}"
        print(line)
    for tag in ["B8 L32K", "B1 L128K"]:
        o = ours.get(f"sparse decode 2K {tag}")
        if not o:
            continue
        floor = o["bytes"] / (bw * 1e6)
        sd = peers.get(f"torch SDPA dense {tag}")
        sg = peers.get(f"torch sparse gather+SDPA 2K {tag}")
        line = f"{'sparse ' + tag:<14} {o['ms']:>9.4f} {o['ms'] / floor:>9.2f}F | "
        line += f"{sd['ms']:>8.4f} {sd['ms'] / o['ms']:>5.2f}x | " if sd else f"{'-':>8} {'-':>6} | "
        line += f"{sg['ms']:>11.4f} {sg['ms'] / o['ms']:>5.2f}x" if sg else f"{'-':>11} {'-':>6}"
        print(line)
    print("dense: fraction of the copy bandwidth (goal >= 0.85); sparse: time over its bytes floor "
          "(F, goal <= 1.3); ratios: peer time / our time (sparse rows: SDPA dense, then torch "
          "sparse gather+SDPA)")


if __name__ == "__main__":
    main()
