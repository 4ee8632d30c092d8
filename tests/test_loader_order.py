"""StreamOrder, the shared loader's batch stream (pure): any B consecutive batches from a segment
boundary hold every sample exactly once, whatever the round; where a late consumer may join."""

from __future__ import annotations

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from hpcstagger.errors import ConfigError
from hpcstagger.loader import StreamOrder


def _window(order: StreamOrder, g0: int) -> list[list[int]]:
    return [order.indices(g) for g in range(g0, g0 + order.batches)]


def _check_window(order: StreamOrder, g0: int) -> None:
    """The epoch of a consumer that starts at ``g0``: every sample once, whole batches but the last."""
    batches = _window(order, g0)
    flat = [i for b in batches for i in b]
    assert len(flat) == order.used == len(set(flat)), (order, g0)
    assert set(flat) <= set(range(order.n))
    if not order.drop_last:
        assert sorted(flat) == list(range(order.n))
    sizes = sorted(len(b) for b in batches)
    assert sizes[1:] == [order.batch_size] * (len(sizes) - 1)  # one partial batch at most...
    assert sizes[0] == (order.batch_size if order.drop_last else order.n - (order.batches - 1) * order.batch_size)


@st.composite
def _orders(draw):
    n = draw(st.integers(1, 300))
    batch_size = draw(st.integers(1, 40))
    drop_last = draw(st.booleans()) and n >= batch_size
    return StreamOrder(n, batch_size, seed=draw(st.integers(0, 3)), segments=draw(st.integers(1, 12)),
                       drop_last=drop_last)


@given(order=_orders(), rnd=st.integers(0, 3), which=st.integers(0, 1000))
@example(order=StreamOrder(100, 7, segments=4), rnd=1, which=2)  # crosses from round 1 into round 2
@example(order=StreamOrder(103, 10, segments=3, drop_last=True), rnd=0, which=2)  # the dropped tail varies
def test_any_epoch_from_a_segment_boundary_holds_every_sample_once(order, rnd, which):
    k = order.segment_batches
    starts = list(range(0, order.batches, k))
    g0 = rnd * order.batches + starts[which % len(starts)]
    assert order.is_boundary(g0)
    _check_window(order, g0)



@given(order=_orders(), rnd=st.integers(0, 3), which=st.integers(0, 1000))
def test_without_shuffle_every_round_is_in_dataset_order(order, rnd, which):
    plain = StreamOrder(order.n, order.batch_size, order.seed, order.segments, order.drop_last, shuffle=False)
    assert sum(_window(plain, rnd * plain.batches), []) == list(range(plain.used))
    k = plain.segment_batches
    _check_window(plain, rnd * plain.batches + list(range(0, plain.batches, k))[which % -(-plain.batches // k)])

def test_the_examples_cross_round_boundaries():
    order = StreamOrder(100, 7, segments=4)  # B = 15, k = 4: boundaries 0, 4, 8, 12
    assert (order.batches, order.segment_batches) == (15, 4)
    g0 = order.batches + 8
    assert g0 // order.batches != (g0 + order.batches - 1) // order.batches  # spans rounds 1 and 2
    _check_window(order, g0)
    # and the two rounds really differ: the window is not one round read in another order
    assert _window(order, order.batches) != _window(order, 2 * order.batches)


@given(order=_orders(), g=st.integers(0, 2000))
def test_boundary_at_or_after_is_the_next_boundary(order, g):
    b = order.boundary_at_or_after(g)
    assert g <= b < g + order.segment_batches
    assert order.is_boundary(b)
    assert not any(order.is_boundary(x) for x in range(g, b))


def test_boundaries_on_literal_cases():
    order = StreamOrder(100, 10, segments=4)  # B = 10, k = 3: boundaries 0, 3, 6, 9 of each round
    assert [order.boundary_at_or_after(g) for g in range(12)] == [0, 3, 3, 3, 6, 6, 6, 9, 9, 9, 10, 13]
    assert [g for g in range(21) if order.is_boundary(g)] == [0, 3, 6, 9, 10, 13, 16, 19, 20]
    assert StreamOrder(10, 4).batches == 3 and StreamOrder(10, 4).used == 10
    assert StreamOrder(10, 4, drop_last=True).batches == 2 and StreamOrder(10, 4, drop_last=True).used == 8
    assert len(StreamOrder(10, 4).indices(2)) == 2  # the partial batch ends the round


def test_segments_keep_their_samples_and_shuffle_within():
    order = StreamOrder(96, 4, seed=3, segments=4)  # 24 batches, 6 per segment, 24 samples per segment
    r0, r1 = (sum(_window(order, r * order.batches), []) for r in (0, 1))
    for j in range(4):
        a, b = r0[24 * j:24 * (j + 1)], r1[24 * j:24 * (j + 1)]
        assert set(a) == set(b) and a != b


def test_one_segment_is_a_full_reshuffle_every_round():
    order = StreamOrder(200, 8, seed=1, segments=1)
    assert order.segment_batches == order.batches == 25
    assert [g for g in range(60) if order.is_boundary(g)] == [0, 25, 50]
    rounds = [sum(_window(order, r * order.batches), []) for r in range(3)]
    assert all(sorted(r) == list(range(200)) for r in rounds)
    assert rounds[0] != rounds[1] != rounds[2] != rounds[0]
    # a full reshuffle: samples move across the whole epoch, not within a stretch of it
    first_quarter = set(rounds[0][:50])
    assert len(first_quarter & set(rounds[1][150:])) > 0


def test_the_order_is_a_pure_function_of_its_parameters():
    a, b = StreamOrder(50, 5, seed=7), StreamOrder(50, 5, seed=7)
    assert [a.indices(g) for g in range(30)] == [b.indices(g) for g in range(30)]
    assert [a.indices(g) for g in range(10)] != [StreamOrder(50, 5, seed=8).indices(g) for g in range(10)]
    assert a.indices(3) == a.indices(3)  # the round's cache gives equal lists every time


@pytest.mark.parametrize("kwargs", [
    dict(n=0, batch_size=1), dict(n=10, batch_size=0), dict(n=10, batch_size=2, segments=0),
    dict(n=-1, batch_size=1), dict(n=10.0, batch_size=2), dict(n=True, batch_size=1),
    dict(n=10, batch_size="2"), dict(n=3, batch_size=4, drop_last=True),
])
def test_bad_arguments_raise_config_error(kwargs):
    with pytest.raises(ConfigError, match="shared loader"):
        StreamOrder(**kwargs)


def test_drop_last_error_names_the_fix():
    with pytest.raises(ConfigError, match="smaller batch_size or drop_last=False"):
        StreamOrder(3, 4, drop_last=True)


def test_a_negative_batch_number_is_refused():
    with pytest.raises(ValueError, match="< 0"):
        StreamOrder(10, 2).indices(-1)
