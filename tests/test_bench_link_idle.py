"""gradfuse.bench.link_idle's accounting of a step from its timeline spans: before the first post,
link idle (no exchange span open), the union of the exchange spans, after the last one, and
the verdict's two parts. Synthetic spans, in microseconds as the trace has them."""
import pytest

from gradfuse.bench import link_idle as link_idle_module


@pytest.fixture(scope="module")
def link_idle():
    return link_idle_module


def span(cat, ts, dur, **args):
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts, "dur": dur, "args": args}


def test_one_step_split_into_before_idle_exchanges_after(link_idle):
    step = [span("negotiate", 0, 100),
            span("compress", 200, 3000, bucket=0),
            span("exchange", 4000, 8000, bucket=0), span("exchange", 4000, 8000, bucket=1),   # one group
            span("verdict", 3300, 9000, part="max |x|"), span("verdict", 12300, 500, part="agree"),
            span("exchange", 15000, 5000, bucket=2),          # posted after 3 ms with nothing in flight
            span("exchange", 18000, 10000, bucket=3),         # overlaps the one before
            span("decompress", 28000, 1500, bucket=3)]
    r = link_idle.account(sorted(step, key=lambda e: e["ts"]))
    assert r["step"] == pytest.approx(29.5)
    assert r["before"] == pytest.approx(4.0)
    assert r["idle"] == pytest.approx(3.0)                    # 12 ms .. 15 ms
    assert r["exchanges"] == pytest.approx(8.0 + 13.0)        # 4-12 ms, 15-28 ms
    assert r["after"] == pytest.approx(1.5)
    assert (r["pass"], r["agree"]) == (pytest.approx(9.0), pytest.approx(0.5))


def test_steps_are_cut_at_each_negotiation(link_idle):
    events = [span("negotiate", 0, 100), span("exchange", 200, 1000),
              span("negotiate", 5000, 100), span("exchange", 5300, 2000), {"ph": "M", "name": "thread_name"}]
    steps = link_idle.split_steps(events)
    assert [len(s) for s in steps] == [2, 2]
    assert link_idle.account(steps[1])["exchanges"] == pytest.approx(2.0)


def test_a_step_without_exchanges_is_refused(link_idle):
    with pytest.raises(SystemExit, match="no exchange spans"):
        link_idle.account([span("negotiate", 0, 100), span("compress", 200, 50)])


def test_link_rates(link_idle):
    assert link_idle.link_bps("300mbit") == 300e6 and link_idle.link_bps("1gbit") == 1e9
    with pytest.raises(SystemExit, match="--link"):
        link_idle.link_bps("fast")
