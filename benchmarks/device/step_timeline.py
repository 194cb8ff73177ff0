"""Where a decode step's time goes on the GPU's own clock: kernels, copies and the idle gaps
between them, from a CUPTI trace (torch.profiler) of an offline run.

usage: python3 benchmarks/device/step_timeline.py MODEL_DIR [NUM_PROMPTS] [IN] [OUT]
(default: 1 prompt of 32 tokens, 256 out: ``bench latency``'s batch-1 recipe).

Steps are cut at the copy of the sampled tokens to the host (one per step). Over the
decode steps of the run (the first ten and the last two left out) it prints the median
step's span, busy and idle time; each event name's time per step; and the gaps before
events that open a gap of over 0.5 us, grouped by the events on either side, so that the
idle time is attributed to a place in the step (after the graph, around the host-to-device
copies, before the sampler, ...).
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import dataclass

import torch
from profile_step import offline_workload  # this folder is on sys.path as the script's own
from torch.profiler import ProfilerActivity, profile, record_function

GAP_US = 0.5
STEP_END = "Memcpy DtoH"
# The host range around ``generate``; the profiler also lists it on the GPU's timeline,
# where it is not GPU work.
RANGE = "tm_generate"


@dataclass(frozen=True)
class Event:
    """One kernel, copy or memset on the GPU: name and microseconds on the GPU clock."""

    name: str
    start: float
    end: float


def gpu_events(prof, width: int = 70) -> list[Event]:
    """The GPU activity of a finished ``torch.profiler.profile``, by start time."""
    events = [
        Event(e.name[:width], e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.name != RANGE
    ]
    return sorted(events, key=lambda e: e.start)


def split_steps(events: list[Event]) -> list[list[Event]]:
    """Events grouped into steps, each ending with its copy of sampled tokens to the host."""
    steps: list[list[Event]] = [[]]
    for e in events:
        steps[-1].append(e)
        if e.name.startswith(STEP_END):
            steps.append([])
    return [s for s in steps if s and s[-1].name.startswith(STEP_END)]


def busy_us(events: list[Event], lo: float, hi: float) -> float:
    """Microseconds in [lo, hi] covered by at least one event (events may overlap)."""
    total, cur_start, cur_end = 0.0, None, None
    for e in events:
        s, t = max(e.start, lo), min(e.end, hi)
        if t <= s:
            continue
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, t
        else:
            cur_end = max(cur_end, t)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def summarize(steps: list[list[Event]], skip_first: int = 10, skip_last: int = 2) -> str:
    """The report described in the module docstring, for steps[skip_first:-skip_last]."""
    if len(steps) <= skip_first + skip_last + 1:
        return f"TIMELINE only {len(steps)} steps traced"
    mid = range(skip_first, len(steps) - skip_last)
    spans, busies = [], []
    per_name: dict[str, float] = {}
    gaps: dict[tuple[str, str], list[float]] = {}
    for i in mid:
        prev_end = steps[i - 1][-1].end
        step = steps[i]
        span = step[-1].end - prev_end
        spans.append(span)
        busies.append(busy_us(step, prev_end, step[-1].end))
        reach, before = prev_end, steps[i - 1][-1].name
        for e in step:
            per_name[e.name] = per_name.get(e.name, 0.0) + (e.end - e.start)
            if e.start - reach > GAP_US:
                gaps.setdefault((before, e.name), []).append(e.start - reach)
            if e.end > reach:
                reach, before = e.end, e.name
    n = len(spans)
    span, busy = statistics.median(spans), statistics.median(busies)
    lines = [
        f"TIMELINE {n} steps: median span {span:.1f} us, busy {busy:.1f} us, "
        f"idle {span - busy:.1f} us ({100 * (span - busy) / span:.2f}%)",
        "TIMELINE time per step by event (us, mean):",
    ]
    for name, us in sorted(per_name.items(), key=lambda kv: -kv[1])[:25]:
        lines.append(f"TIMELINE   {us / n:9.1f}  {name}")
    lines.append(
        f"TIMELINE gaps over {GAP_US} us (us per step, mean; count per step): after -> before"
    )
    ranked = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:25]
    for (after, before), values in ranked:
        lines.append(
            f"TIMELINE   {sum(values) / n:8.2f}  x{len(values) / n:5.2f}  {after} -> {before}"
        )
    lines.extend(step_edges(steps[mid[len(mid) // 2]], steps[mid[len(mid) // 2] - 1][-1].end))
    return "\n".join(lines)


def step_edges(step: list[Event], prev_end: float, head: int = 12, tail: int = 24) -> list[str]:
    """The first ``head`` and last ``tail`` events of one step: start (us after the previous
    step's end), duration and the idle gap before each, to show the step's seams."""
    lines = [f"TIMELINE one step's edges ({len(step)} events): start  dur  gap  name"]
    reach = prev_end
    for i, e in enumerate(step):
        gap = max(0.0, e.start - reach)
        reach = max(reach, e.end)
        if i < head or i >= len(step) - tail:
            lines.append(
                f"TIMELINE   {e.start - prev_end:8.1f} {e.end - e.start:7.1f} {gap:6.1f}  {e.name}"
            )
        elif i == head:
            lines.append("TIMELINE   ...")
    return lines


def _host_range(prof) -> tuple[float, float] | None:
    """Start and end (us) of the host's ``RANGE``, or None if it was not recorded."""
    host = [e for e in prof.events() if e.name == RANGE]
    return (host[0].time_range.start, host[0].time_range.end) if host else None


def run_edges(prof, steps: list[list[Event]]) -> str:
    """Where the host's ``generate`` call spends time outside the GPU's steps: from its
    start to the first GPU event, the first three steps' spans, the last two, and from the
    last GPU event to its return (us, on the profiler's common clock)."""
    host = _host_range(prof)
    if host is None or not steps:
        return "TIMELINE no host range recorded"
    start, end = host
    first, last = steps[0][0].start, steps[-1][-1].end
    spans = [steps[0][-1].end - first]
    spans += [steps[i][-1].end - steps[i - 1][-1].end for i in range(1, len(steps))]
    head = ", ".join(f"{x:.1f}" for x in spans[:3])
    tail = ", ".join(f"{x:.1f}" for x in spans[-2:])
    return (
        f"TIMELINE generate {end - start:.1f} us: {first - start:.1f} before the first GPU "
        f"event, {last - first:.1f} from it to the last step's end, {end - last:.1f} after; "
        f"{len(steps)} steps, first spans {head}, last {tail}"
    )


def first_step(prof, steps: list[list[Event]], top: int = 15) -> str:
    """What the request's first step does: its GPU events by name (count, us), and the
    host's profiled calls (CUDA runtime and aten ops, by name: count, us) from the start of
    ``generate`` to the first GPU event and from there to the first step's end."""
    host = _host_range(prof)
    if host is None or not steps:
        return "TIMELINE no host range recorded"
    start, first, end = host[0], steps[0][0].start, steps[0][-1].end
    lines = [f"TIMELINE first step: {len(steps[0])} GPU events, span {end - first:.1f} us, "
             f"busy {busy_us(steps[0], first, end):.1f} us"]  # fmt: skip
    lines += _by_name(((e.name, e.end - e.start) for e in steps[0]), "GPU", top)
    cpu = [e for e in prof.events()
           if e.device_type == torch.autograd.DeviceType.CPU and e.name != RANGE]  # fmt: skip
    for label, lo, hi in (("host before it", start, first), ("host during it", first, end)):
        inside = ((e.name[:70], e.time_range.end - e.time_range.start) for e in cpu
                  if lo <= e.time_range.start < hi)  # fmt: skip
        lines += _by_name(inside, label, top)
    return "\n".join(lines)


def _by_name(pairs, label: str, top: int) -> list[str]:
    total: dict[str, list[float]] = {}
    for key, us in pairs:
        total.setdefault(key, []).append(us)
    ranked = sorted(total.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [f"TIMELINE   {label}: {sum(v):9.1f} us x{len(v):4d}  {k}" for k, v in ranked]


def main() -> None:
    llm, prompts, params, n, in_len, out_len = offline_workload(sys.argv, 1, 32, 256, 4)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(RANGE):
            llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    print(f"TIMELINE {n} prompts {in_len}/{out_len}")
    steps = split_steps(gpu_events(prof))
    print(summarize(steps))
    print(run_edges(prof, steps))
    print(first_step(prof, steps))


if __name__ == "__main__":
    main()
