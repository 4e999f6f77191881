"""What dropping the trainer's pages of a shared-memory segment after each push costs the push.

`SharedMemorySender` releases its resident pages of a segment once a version is written
(`Segment.release_data_pages`), so a pushed model does not stay in the trainer's memory; the next
write into that segment maps its pages back (minor faults). This times `publish` + `send` of the
same weights into reused segments with the release (the product) and without it (the release
replaced by a no-op), side by side in one process, alternating arm by arm, and reports the
sender's resident growth after the pushes. No receivers: each segment is marked loaded by hand.

    python benchmarks/shm_page_release.py [--mib 512] [--pushes 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from titanrl.memory import current_rss_bytes
from titanrl.weight_sync import TensorsWeights
from titanrl.weight_sync.segment import Segment
from titanrl.weight_sync.shared_memory import SharedMemorySender


def _pushes(weights: dict[str, torch.Tensor], pushes: int, release: bool) -> dict:
    """Seconds of each publish + send into reused segments, and the RSS growth after them."""
    original = Segment.release_data_pages
    if not release:
        Segment.release_data_pages = lambda self: None  # the baseline: pages stay resident
    sender = SharedMemorySender(num_receivers=1, timeout_s=30)
    try:
        source, seconds = TensorsWeights(weights), []
        before = current_rss_bytes()
        for version in range(1, pushes + 1):
            t0 = time.perf_counter()
            ann = sender.publish(version, source)
            sender.send(version, source)
            seconds.append(time.perf_counter() - t0)
            seg = next(s for s in sender.segments if s.name == ann.segment)
            seg.mark_mapped(1)
            seg.mark_done(1)  # loaded: the next push may reuse it
        return dict(push_s=seconds, rss_growth_mib=round((current_rss_bytes() - before) / 2**20, 1),
                    segments=len(sender.segments))
    finally:
        sender.close()
        Segment.release_data_pages = original


def _cpu_name() -> str:
    """The CPU's model name (Linux), for the result line."""
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=512, help="size of the pushed weights")
    parser.add_argument("--pushes", type=int, default=6, help="pushes per arm and round (the first fills a segment)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of the two arms")
    parser.add_argument("--out", help="also write the JSON lines to this file")
    parser.add_argument("--smoke", action="store_true", help="16 MiB, 3 pushes, 1 round (numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        if args.out:
            parser.error("--smoke writes no result file")
        args.mib, args.pushes, args.rounds = 16, 3, 1
    torch.set_num_threads(1)
    weights = {f"w{i}": torch.randn(args.mib << 16, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    lines, steady = [], {"release": [], "keep": []}
    for round_ in range(args.rounds):
        for arm in ("release", "keep"):
            result = _pushes(weights, args.pushes, release=arm == "release")
            # Pushes after the first MAX_SEGMENTS write into reused segments: the steady state.
            steady[arm] += result["push_s"][4:] or result["push_s"][1:]
            lines.append(dict(benchmark="shm_page_release", arm=arm, round=round_, mib=args.mib, **result))
    summary = dict(benchmark="shm_page_release", summary=True, mib=args.mib, smoke=args.smoke,
                   steady_push_s={arm: statistics.median(s) for arm, s in steady.items()},
                   rss_growth_mib={arm: [line["rss_growth_mib"] for line in lines if line["arm"] == arm]
                                   for arm in steady},
                   cpu=_cpu_name())
    summary["release_over_keep"] = summary["steady_push_s"]["release"] / summary["steady_push_s"]["keep"]
    lines.append(summary)
    for line in lines:
        print(json.dumps(line))
    if args.out:
        with open(args.out, "a") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
