"""Checks of a gradfuse-view timeline file that the single-rank and the MPI tests share:
what chrome://tracing and Perfetto need of a JSON trace, and that spans nest per track."""
import collections
import json


def load_trace(path):
    """The trace object in ``path``, checked: JSON, ``traceEvents``, every event with the
    fields its phase needs (X: name, ts, dur >= 0, pid, tid as numbers; M: a name)."""
    with open(path) as f:
        trace = json.load(f)
    assert isinstance(trace, dict) and isinstance(trace["traceEvents"], list), path
    named = set()
    for e in trace["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["tid"], int), e
        if e["ph"] == "M":
            assert e["name"] in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"), e
            if e["name"] == "thread_name":
                named.add((e["pid"], e["tid"]))
            continue
        assert isinstance(e["name"], str) and e["name"], e
        assert isinstance(e["ts"], (int, float)) and e["ts"] >= 0, e
        assert isinstance(e["dur"], (int, float)) and e["dur"] >= 0, e
    used = {(e["pid"], e["tid"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert used <= named, f"tracks without a thread_name: {used - named}"
    return trace


def spans(trace):
    return [e for e in trace["traceEvents"] if e["ph"] == "X"]


def track_names(trace):
    return {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}


def assert_nested(trace, slack_us=0.002):
    """On every (pid, tid) track, any two spans are disjoint or one holds the other."""
    by_track = collections.defaultdict(list)
    for e in spans(trace):
        by_track[(e["pid"], e["tid"])].append(e)
    for track, evs in by_track.items():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack = []
        for e in evs:
            while stack and e["ts"] >= stack[-1]["ts"] + stack[-1]["dur"] - slack_us:
                stack.pop()
            if stack:
                top = stack[-1]
                assert e["ts"] + e["dur"] <= top["ts"] + top["dur"] + slack_us, \
                    f"track {track}: {e['name']} at {e['ts']} overlaps {top['name']} at {top['ts']}"
            stack.append(e)


def stage_counts(trace, pid=None):
    """{(stage, bucket): number of spans} from the spans' track names and ``bucket`` args."""
    names = track_names(trace)
    out = collections.Counter()
    for e in spans(trace):
        if pid is None or e["pid"] == pid:
            out[(names[(e["pid"], e["tid"])].split(" ")[0], e["args"].get("bucket"))] += 1
    return out
