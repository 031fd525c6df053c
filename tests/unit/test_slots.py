import pytest

from engine.slots import SlotTable, StaleHandle


def test_allocate_release_reuse_fifo():
    t = SlotTable(2)
    a, b = t.allocate("a"), t.allocate("b")
    assert {a.slot, b.slot} == {0, 1} and len(t) == 2
    with pytest.raises(RuntimeError, match="in use"):
        t.allocate("c")
    t.release(a)
    c = t.allocate("c")
    assert c.slot == a.slot and c.epoch != a.epoch
    assert len(t) == 2 and "a" not in t and "c" in t


def test_stale_handle_cannot_free_new_owner():
    t = SlotTable(1)
    a = t.allocate(1)
    t.release(a)
    b = t.allocate(2)
    with pytest.raises(StaleHandle):
        t.release(a)
    with pytest.raises(StaleHandle):
        t.check(a)
    t.check(b)
    t.release(b)
    assert len(t) == 0


def test_double_allocate_and_double_release():
    t = SlotTable(3)
    h = t.allocate(7)
    with pytest.raises(ValueError):
        t.allocate(7)
    t.release(h)
    with pytest.raises(StaleHandle):
        t.release(h)
