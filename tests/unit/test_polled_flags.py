"""serving.stub.bls: what every running request of a stub polls (the launcher's flag, is_cancelled()) is
asked at a bounded rate however many requests run."""

from serving.stub.bls import PolledFlags


class Flags:
    def __init__(self):
        self.reads, self.message = 0, None

    def broken(self):
        self.reads += 1
        return self.message


def test_many_polls_within_the_interval_read_the_flag_once():
    flags = Flags()
    polled = PolledFlags(flags, seconds=3600)
    flags.message = "unavailable: restarting"
    assert [polled.broken() for _ in range(256)] == ["unavailable: restarting"] * 256
    assert flags.reads == 1


def test_a_flag_set_later_is_seen_once_the_interval_is_over():
    flags = Flags()
    polled = PolledFlags(flags, seconds=0)  # every poll is past the interval
    assert polled.broken() is None
    flags.message = "unavailable: restarting"
    assert polled.broken() == "unavailable: restarting"
    assert flags.reads == 2


def test_cancellation_polls_stay_within_their_budget_at_any_concurrency():
    from engine.lifetime import CANCEL_CHECKS_PER_SECOND, CANCEL_POLL_SECONDS, cancel_poll_seconds

    assert cancel_poll_seconds(1) == CANCEL_POLL_SECONDS  # a few streams: as often as ever
    for watching in (1, 8, 50, 51, 256, 1024):
        assert watching / cancel_poll_seconds(watching) <= CANCEL_CHECKS_PER_SECOND * (1 + 1e-9)
