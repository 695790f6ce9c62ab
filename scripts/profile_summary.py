#!/usr/bin/env python3
"""Summarizes `perf script -F comm,tid,ip,sym` output of `webproxy serve`.

Two tables: self time by crate (the sample's innermost frame), and the inclusive
share of the kinds of work the performance issue tracks (a sample counts for every
kind one of its frames belongs to, so the shares overlap). Stacks are often cut
short in deep async code, so inclusive shares are lower bounds.
"""

import re
import sys
from collections import Counter

WORK = [
    ("OpenTelemetry layer and SDK", r"tracing_opentelemetry|opentelemetry_sdk::trace"),
    ("fmt layer: span fields", r"on_record|on_new_span|JsonFields|FormattedFields"),
    ("fmt layer: log events", r"format_event|FormatEvent"),
    ("envelope parsing", r"parse_request"),
    ("reply encoding", r"outbox::"),
    ("trace context in and out", r"webproxy_dispatcher::observability::trace::|TraceContextPropagator"),
    ("metrics", r"prometheus_client|metrics::Metrics"),
    ("URL parsing", r"url::parser|Url::parse"),
    ("reqwest", r"reqwest::"),
    ("hyper", r"hyper::|hyper_util"),
    ("async-nats", r"async_nats"),
    ("serde_json", r"serde_json"),
    ("tokio scheduler", r"tokio::runtime::scheduler"),
    ("kernel", r"entry_SYSCALL|do_syscall|irqentry"),
]


def samples(path):
    stack = None
    with open(path, errors="replace") as lines:
        for line in lines:
            if not line.strip():
                if stack is not None:
                    yield stack
                stack = None
            elif not line[0].isspace():
                stack = []
            elif stack is not None:
                parts = line.strip().split(" ", 1)
                stack.append(parts[1] if len(parts) > 1 else parts[0])
    if stack:
        yield stack


def crate(frame):
    if re.match(r"^_?mi_", frame) or frame.startswith(("malloc", "free", "realloc")):
        return "allocator"
    if frame.startswith("__mem"):
        return "memcpy/memmove"
    found = re.match(r"^<?(?:&(?:mut )?)?([a-z_][a-z0-9_]*)::", frame)
    return found.group(1) if found else "kernel, libc, unknown"


def main():
    total = 0
    by_crate = Counter()
    by_work = Counter()
    for stack in samples(sys.argv[1]):
        total += 1
        if stack:
            by_crate[crate(stack[0])] += 1
        joined = "\n".join(stack)
        for name, pattern in WORK:
            if re.search(pattern, joined):
                by_work[name] += 1
    if not total:
        sys.exit("no samples")
    print(f"{total} samples\n\nself time by crate:")
    for name, count in by_crate.most_common(16):
        print(f"  {100 * count / total:5.1f}%  {name}")
    print("\ninclusive, by work:")
    for name, _ in WORK:
        print(f"  {100 * by_work[name] / total:5.1f}%  {name}")


if __name__ == "__main__":
    main()
