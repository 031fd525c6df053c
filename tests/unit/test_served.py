"""--models and what tts refuses before any work: a request for a model the server does not run."""

import pytest

from serving.intake.requests import ServedModels, parse_models


def test_parse_models():
    assert parse_models("") == ()
    assert parse_models("instruct, base") == ("base", "instruct")  # the layout's order
    with pytest.raises(ValueError, match="unknown turbo"):
        parse_models("base,turbo")


def test_default_is_what_the_folder_holds(tmp_path):
    (tmp_path / "fireredtts3_instruct").mkdir()
    (tmp_path / "fireredtts3_instruct" / "config.json").write_text("{}")
    assert ServedModels.of(tmp_path, "").models == ("instruct",)
    assert ServedModels.of(tmp_path, "base").models == ("base",)  # the option wins (the generator then fails)


def test_a_request_for_a_model_not_served_names_it():
    base_only, instruct_only = ServedModels(("base",)), ServedModels(("instruct",))
    base_only.check("")
    instruct_only.check("design")
    with pytest.raises(ValueError, match="TASK design needs FireRedTTS3-Instruct.*--models base,instruct"):
        base_only.check("design")
    with pytest.raises(ValueError, match="needs FireRedTTS3-Base.*fireredtts3_base/"):
        instruct_only.check("")
