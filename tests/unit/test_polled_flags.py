"""serving.flow.side_channel: what every running request of a stub polls (the launcher's flags, is_cancelled())
is asked at a bounded rate however many requests run; the flags carry the launcher's messages."""

from serving.flow.side_channel import SideChannel
from serving.supervision.run_folder import BROKEN, DRAINING, RunFlags


class Flags(SideChannel):
    """A side channel that counts its reads of the launcher's flag files."""

    def __init__(self, tmp_path):
        super().__init__(tmp_path / "marks", run_dir=tmp_path)
        self.reads = 0

    def _read_flag(self, name):
        self.reads += 1
        return super()._read_flag(name)


def test_many_polls_within_the_interval_read_the_flag_once(tmp_path):
    flags = Flags(tmp_path)
    RunFlags(tmp_path).set(BROKEN, "unavailable: restarting")
    assert [flags.flag("broken", 3600) for _ in range(256)] == ["unavailable: restarting"] * 256
    assert flags.reads == 1


def test_a_flag_set_later_is_seen_once_the_interval_is_over(tmp_path):
    flags = Flags(tmp_path)
    assert flags.flag("broken", 0) is None  # every poll is past the interval
    RunFlags(tmp_path).set(BROKEN, "unavailable: restarting")
    assert flags.flag("broken", 0) == "unavailable: restarting"
    assert flags.reads == 2


def test_run_flags_carry_their_messages(tmp_path):
    launcher, flags = RunFlags(tmp_path), SideChannel(tmp_path / "marks", run_dir=tmp_path)
    assert flags.refusal() is None
    launcher.set(DRAINING)
    assert flags.flag("draining", 0) == flags.refusal() == "unavailable: server is shutting down"
    launcher.set(BROKEN, "unavailable: generator backend died; the server is restarting, retry shortly")
    assert flags.refusal().startswith("unavailable: generator")  # broken wins: running requests fail too
    launcher.clear()
    assert flags.refusal() is None and SideChannel(tmp_path / "marks").refusal() is None


def test_an_empty_flag_file_says_the_default_message(tmp_path):
    flags = SideChannel(tmp_path / "marks", run_dir=tmp_path)
    for name in ("broken", "draining", "dead.voices"):
        (tmp_path / name).touch()
    assert flags.flag("broken", 0) == "unavailable: the server is restarting; retry shortly"
    assert flags.flag("draining", 0) == "unavailable: server is shutting down"
    assert flags.flag("dead.voices", 0) == "unavailable: voices backend died; retry shortly"


def test_cancellation_polls_stay_within_their_budget_at_any_concurrency():
    from engine.lifetime import CANCEL_CHECKS_PER_SECOND, CANCEL_POLL_SECONDS, cancel_poll_seconds

    assert cancel_poll_seconds(1) == CANCEL_POLL_SECONDS  # a few streams: as often as ever
    for watching in (1, 8, 50, 51, 256, 1024):
        assert watching / cancel_poll_seconds(watching) <= CANCEL_CHECKS_PER_SECOND * (1 + 1e-9)
