"""The operator's admin key kept across restarts, what the client finds on the same machine, and the
launcher's restarts of a crashing gateway."""

from __future__ import annotations

import os
import stat

import pytest

from client.voices import VoiceClient, kept_admin_key_file
from serving import serve as gateway_process
from serving.security import admin_key


def test_a_generated_key_is_kept_private_and_reused(tmp_path):
    key, made = admin_key.load_or_create(tmp_path / "state")
    path = tmp_path / "state" / "admin_key"
    assert made and path.read_text() == key + "\n" and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert admin_key.load_or_create(tmp_path / "state") == (key, False)  # a restart: the same key
    assert admin_key.main(["rotate", "--state-dir", str(tmp_path / "state")]) == 0
    new, made = admin_key.load_or_create(tmp_path / "state")
    assert new != key and not made
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and sorted(os.listdir(tmp_path / "state")) == ["admin_key"]


def test_launchers_starting_at_once_agree_on_one_whole_key(tmp_path):
    import concurrent.futures

    with concurrent.futures.ProcessPoolExecutor(4) as pool:
        got = list(pool.map(admin_key.load_or_create, [tmp_path] * 16))
    keys = {key for key, _ in got}
    assert len(keys) == 1 and sum(made for _, made in got) == 1  # one made it, every other read it whole
    assert (tmp_path / "admin_key").read_text() == keys.pop() + "\n" and os.listdir(tmp_path) == ["admin_key"]


def test_a_key_others_can_read_or_an_empty_one_is_refused(tmp_path):
    path = tmp_path / "admin_key"
    path.write_text("secret\n")
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="readable by others"):
        admin_key.load_or_create(tmp_path)
    path.chmod(0o600)
    path.write_text("\n")
    with pytest.raises(ValueError, match="holds no key"):
        admin_key.load_or_create(tmp_path)


def test_the_client_finds_the_key_a_launcher_on_this_machine_keeps(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("TTS_ADMIN_KEY", raising=False)
    assert kept_admin_key_file() == str(admin_key.default_state_dir() / admin_key.FILE)
    assert VoiceClient("127.0.0.1").admin_key == ""  # none kept yet
    key, _ = admin_key.load_or_create(admin_key.default_state_dir())
    assert VoiceClient("127.0.0.1").admin_key == key
    monkeypatch.setenv("TTS_ADMIN_KEY", "from the environment")
    assert VoiceClient("127.0.0.1").admin_key == "from the environment"
    assert VoiceClient("127.0.0.1", admin_key="given").admin_key == "given"


def test_the_path_and_rotate_commands(tmp_path, capsys):
    assert admin_key.main(["path", "--state-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "admin_key")
    assert admin_key.main(["rotate", "--state-dir", str(tmp_path)]) == 0
    told = capsys.readouterr().err
    assert (tmp_path / "admin_key").read_text().strip() and "running servers keep the old one" in told


class _Exited:
    returncode = 1

    def poll(self):
        return 1


def test_a_crashing_gateway_restarts_after_longer_and_longer_waits(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(gateway_process.time, "monotonic", lambda: clock[0])
    gateway = gateway_process.Gateway.__new__(gateway_process.Gateway)
    gateway._start = lambda: _Exited()
    gateway.proc, gateway.started = _Exited(), clock[0]
    gateway.restarts, gateway.backoff, gateway.restart_at = 0, gateway_process.BACKOFF_FIRST / 2, 0.0
    waits = []
    for _ in range(9):
        gateway.keep_up()  # notices the exit
        waits.append(gateway.backoff)
        clock[0] = gateway.restart_at - 0.01
        gateway.keep_up()
        assert gateway.proc is None  # not before its time
        clock[0] = gateway.restart_at
        gateway.keep_up()  # started again, and it exits at once
    assert waits == [0.5, 1, 2, 4, 8, 16, 30, 30, 30] and gateway.restarts == 9
    clock[0] += gateway_process.BACKOFF_RESET  # this one stayed up a minute: the next wait is short again
    gateway.keep_up()
    assert gateway.backoff == 0.5
