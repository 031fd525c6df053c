"""serving.security.auth without a server: the internal key, the admin key and issued stream ids."""

from __future__ import annotations

import json

import pytest

from serving.security.auth import Keys, Refused


def test_the_internal_key_is_recognized_and_stripped():
    keys = Keys("k" * 64)
    given, trusted = keys.split(json.dumps({"internal_key": "k" * 64, "steps": 4}))
    assert trusted and given == {"steps": 4}
    for raw in ({"internal_key": "wrong", "steps": 4}, {"steps": 4}, {"internal_key": 5}, None, ""):
        given, trusted = keys.split(raw)
        assert not trusted and "internal_key" not in given


@pytest.mark.parametrize("raw", ["{", "[1, 2]", '"text"'])
def test_malformed_parameters_are_a_value_error(raw):
    with pytest.raises(ValueError, match="request parameters"):
        Keys("k").split(raw)


def test_key_less_requests_are_refused_unless_the_ensemble_is_served():
    Keys("k", public=True).admit(False, "generator")
    Keys("k", public=False).admit(True, "generator")
    with pytest.raises(Refused, match="generator is internal"):
        Keys("k", public=False).admit(False, "generator")


def test_admin_key():
    keys = Keys("k", Keys.digest("open sesame"))
    assert keys.admin_refusal({"admin_key": "open sesame"}, "this") is None
    assert keys.admin_refusal({"admin_key": "open sesame "}, "this") is not None
    assert keys.admin_refusal({}, "this") is not None
    assert keys.admin_refusal({"admin_key": 1}, "this") is not None


def test_a_missing_and_a_wrong_admin_key_are_told_apart_and_say_how_to_send_it():
    keys = Keys("k", Keys.digest("open sesame"))
    assert keys.admin_refusal({"admin_key": "open sesame"}, "add") is None
    for missing in ({}, {"admin_key": ""}):
        told = keys.admin_refusal(missing, "add")
        assert told.startswith("add needs the admin key") and "--admin-key" in told and "$TTS_ADMIN_KEY" in told
    wrong = keys.admin_refusal({"admin_key": "open sesame "}, "remove")
    assert wrong.startswith("remove: the admin key is wrong") and "admin_key file" in wrong and "Bearer" in wrong
    assert Keys("k").admin_refusal({}, "add") is None  # no key configured: anyone may


def test_issued_stream_ids_are_random_63_bit_and_never_0():
    ids = {Keys.new_stream_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(0 < i < 2**63 for i in ids)


def test_without_a_key_everyone_is_trusted():
    keys = Keys()
    assert keys.split({"steps": 4}) == ({"steps": 4}, True)
    assert keys.admin_refusal({}, "this") is None
