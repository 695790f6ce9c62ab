#!/usr/bin/env python3
"""Summarizes two `perf script -F comm,tid,ip,sym` recordings of the same work:
webproxy's and the minimal pipeline's (issue 33's differential profile).

    profile_summary.py WEBPROXY.script WEBPROXY_US PIPELINE.script PIPELINE_US
    profile_summary.py --nats WEBPROXY_NATS.script US PIPELINE_NATS.script US

Each *_US is the process's CPU per conversation (the bench row's `svc µs`), which a
group's share of the samples turns into µs per conversation. Two tables, each with
webproxy's µs, the pipeline's, and the difference, largest first:
- self time by crate (the sample's innermost frame): these add up to the total;
- by the code that asked for it: the innermost frame outside the generic crates
  (allocator, memcpy, core, alloc, std, hashbrown, bytes, tokio, the kernel), webproxy's
  own crates by module; these add up to the total too;
- inclusive, by kind of work (a sample counts for every kind one of its frames belongs
  to, so the rows overlap). Stacks are often cut short in deep async code, so
  inclusive figures are lower bounds.

With --nats, the two recordings are of each one's nats-server (`perf script -F ip,sym`,
no call graphs) and *_US its CPU per conversation (`nats µs`): self time by function,
the largest differences first, and by kind (Go runtime, kernel, the server's own code).
"""

import re
import sys
from collections import Counter

WORK = [
    ("fmt layer: log events", r"format_event|FormatEvent"),
    ("envelope parsing", r"parse_request|Envelope.*Deserialize"),
    ("reply encoding", r"outbox::|Reply.*Serialize"),
    ("trace context in and out", r"webproxy_dispatcher::observability::trace::"),
    ("metrics", r"prometheus_client|metrics::Metrics"),
    ("URL parsing", r"url::parser|Url::parse"),
    ("HTTP call: reqwest", r"reqwest::"),
    ("HTTP call: hyper", r"hyper::|hyper_util"),
    ("async-nats: publish", r"async_nats::client::Client::publish|async_nats::jetstream::context::Context::(send_)?publish"),
    ("async-nats: connection", r"async_nats::connection|async_nats::ConnectionHandler"),
    ("async-nats: acks", r"async_nats::jetstream::message::.*ack"),
    ("async-nats: pull consumer", r"async_nats::jetstream::consumer"),
    ("async-nats: header maps", r"async_nats::header"),
    ("serde_json", r"serde_json"),
    ("allocator", r"^_?mi_|\n_?mi_|malloc|free\b"),
    # The timer machinery itself: not `Timeout`'s poll, which wraps the work it times,
    # nor the time driver's park, which wraps the IO driver's.
    ("tokio timers", r"tokio::runtime::time::(?!Driver::park)|tokio::time::(sleep|interval)"),
    ("kernel: syscalls", r"entry_SYSCALL|do_syscall"),
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


GENERIC = {"allocator", "memcpy/memmove", "core", "alloc", "std", "hashbrown", "bytes", "tokio", "kernel, libc, unknown"}


# Futures that wrap another: the wrapped future's body is often inlined into their
# poll, so a sample whose innermost named frame is one of these is that body's work.
WRAPPERS = r"Instrumented<T>|TrackedFuture<F>|TaskLocalFuture<T,F>|Timeout<T>|PollFn<F>|Pin<P> as core::future"


def asker(stack):
    """The innermost frame's owner outside GENERIC: a webproxy crate's module, another
    crate, the body of a future inlined into a wrapper's poll, or, when every frame is
    generic, the runtime itself (polling, parking, waking)."""
    for frame in stack:
        if re.search(WRAPPERS, frame):
            return "(future bodies inlined into a wrapper)"
        owner = crate(frame)
        if owner in GENERIC:
            continue
        if owner.startswith("webproxy"):
            found = re.match(r"^<?(?:&(?:mut )?)?(webproxy[a-z_]*::[a-z_]+)", frame)
            return found.group(1) if found else owner
        return owner
    return "(runtime: polls, parks, wake-ups)"


def summarize(path):
    """(samples, self samples by crate, by the code that asked, inclusive by kind of work)."""
    total = 0
    by_crate = Counter()
    by_asker = Counter()
    by_work = Counter()
    for stack in samples(path):
        total += 1
        if stack:
            by_crate[crate(stack[0])] += 1
            by_asker[asker(stack)] += 1
        joined = "\n".join(stack)
        for name, pattern in WORK:
            if re.search(pattern, joined):
                by_work[name] += 1
    if not total:
        sys.exit(f"{path}: no samples")
    return total, by_crate, by_asker, by_work


def table(title, names, mine, theirs):
    """Rows of (name, webproxy µs, pipeline µs), printed with their difference."""
    print(f"\n{title}")
    print(f"  {'':<40} {'webproxy':>9} {'pipeline':>9} {'beyond':>9}")
    rows = [(name, mine(name), theirs(name)) for name in names]
    rows.sort(key=lambda row: row[2] - row[1])
    for name, a, b in rows:
        print(f"  {name:<40} {a:>9.1f} {b:>9.1f} {a - b:>+9.1f}")


def additive(title, webproxy, pipeline):
    """A table whose rows add up: each of (counter, samples, µs) by name, the names
    under 1% of both taken together so that the table stays readable."""
    (w_counter, w_total, w_us), (p_counter, p_total, p_us) = webproxy, pipeline
    names = sorted(set(w_counter) | set(p_counter))
    big = [n for n in names if max(w_counter[n] / w_total, p_counter[n] / p_total) >= 0.01]
    rest = "(the rest, each under 1%)"
    small = [n for n in names if n not in big]
    w_rest = sum(w_counter[n] for n in small)
    p_rest = sum(p_counter[n] for n in small)
    table(
        title,
        big + [rest],
        lambda n: w_us * (w_rest if n == rest else w_counter[n]) / w_total,
        lambda n: p_us * (p_rest if n == rest else p_counter[n]) / p_total,
    )


def flat_samples(path):
    """The sampled function of each line of `perf script -F ip,sym`."""
    with open(path, errors="replace") as lines:
        for line in lines:
            parts = line.split(None, 1)
            if parts:
                yield re.sub(r"\+0x[0-9a-f]+$", "", parts[1].strip()) if len(parts) > 1 else "[unknown]"


def nats_kind(function):
    if function.startswith("runtime."):
        return "Go runtime (scheduler, GC, memory)"
    if "nats-server" in function:
        return "nats-server's own code"
    if function.startswith(("syscall.", "internal/poll.", "net.", "os.")):
        return "Go syscalls and network"
    if function.startswith("[unknown]"):
        return "unknown"
    if re.match(r"^[a-z_0-9]+$", function) or function.startswith("__"):
        return "kernel"
    return "other Go packages"


def nats_main(webproxy_path, webproxy_us, pipeline_path, pipeline_us):
    w = Counter(flat_samples(webproxy_path))
    p = Counter(flat_samples(pipeline_path))
    w_total, p_total = sum(w.values()), sum(p.values())
    if not (w_total and p_total):
        sys.exit("no nats-server samples")
    print(
        f"nats-server CPU per conversation at 256 outstanding, in µs: webproxy's "
        f"{webproxy_us:.1f} ({w_total} samples), the pipeline's {pipeline_us:.1f} "
        f"({p_total} samples), beyond {webproxy_us - pipeline_us:+.1f}"
    )
    kinds = lambda counter: Counter({k: sum(v for f, v in counter.items() if nats_kind(f) == k) for k in map(nats_kind, counter)})
    additive("by kind, µs per conversation:", (kinds(w), w_total, webproxy_us), (kinds(p), p_total, pipeline_us))
    names = set(w) | set(p)
    diff = lambda n: webproxy_us * w[n] / w_total - pipeline_us * p[n] / p_total
    largest = sorted(names, key=lambda n: -abs(diff(n)))[:20]
    table(
        "the 20 functions that differ most, µs per conversation:",
        largest,
        lambda n: webproxy_us * w[n] / w_total,
        lambda n: pipeline_us * p[n] / p_total,
    )


def main():
    if len(sys.argv) == 6 and sys.argv[1] == "--nats":
        _, _, a, a_us, b, b_us = sys.argv
        return nats_main(a, float(a_us), b, float(b_us))
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    webproxy_path, webproxy_us, pipeline_path, pipeline_us = sys.argv[1:]
    webproxy_us, pipeline_us = float(webproxy_us), float(pipeline_us)
    w_total, w_crate, w_asker, w_work = summarize(webproxy_path)
    p_total, p_crate, p_asker, p_work = summarize(pipeline_path)
    print(
        f"CPU per conversation at 256 outstanding, in µs: webproxy {webproxy_us:.1f} "
        f"({w_total} samples), pipeline {pipeline_us:.1f} ({p_total} samples), "
        f"beyond {webproxy_us - pipeline_us:+.1f}"
    )
    per = lambda counter, total, us: lambda name: us * counter[name] / total
    additive(
        "self time by crate, µs per conversation (adds up to the total):",
        (w_crate, w_total, webproxy_us),
        (p_crate, p_total, pipeline_us),
    )
    additive(
        "by the code that asked for it, µs per conversation (adds up to the total):",
        (w_asker, w_total, webproxy_us),
        (p_asker, p_total, pipeline_us),
    )
    table(
        "inclusive, by kind of work, µs per conversation (rows overlap; lower bounds):",
        [name for name, _ in WORK],
        per(w_work, w_total, webproxy_us),
        per(p_work, p_total, pipeline_us),
    )


if __name__ == "__main__":
    main()
