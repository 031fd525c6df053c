"""The web page in a real browser: headless Chromium (Debian's ``chromium`` and ``chromium-driver``)
driven by Selenium. ``make test-browser`` installs them; without them these tests are skipped with a
reason and ``make test`` says so."""

from __future__ import annotations

import io
import shutil
import time

import numpy as np
import pytest

from serving.supervision.triton_env import REPO_ROOT
from tests.integration.helpers import metrics, wait_gauges_zero

pytestmark = [pytest.mark.integration, pytest.mark.browser]
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("no chromium/chromedriver: run `make test-browser` to install them", allow_module_level=True)


def chromium(tmp_path):
    """A headless Chromium driven by Selenium, quit when the generator is closed (also for test_instruct_server.py)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # headless, and quiet on a closed network (no update, sync or background connections)
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--mute-audio",
                 "--no-first-run", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic", "--autoplay-policy=no-user-gesture-required",
                 f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,900"):  # fmt: skip
        options.add_argument(flag)
    # an explicit driver path: Selenium Manager would otherwise try to download one
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def module_chromium(tmp_path_factory):
    """One Chromium for the module (a start and a quit cost a second or more each here), and its first window size."""
    drivers = chromium(tmp_path_factory.mktemp("chromium"))
    driver = next(drivers)
    yield driver, driver.get_window_size()
    drivers.close()  # quit


@pytest.fixture()
def browser(module_chromium):
    """The module's Chromium at its first window size; left on a blank page after each test, which drops what
    the test's page still streamed, as quitting did."""
    driver, size = module_chromium
    driver.set_window_size(size["width"], size["height"])
    yield driver
    driver.get("about:blank")


def wait_for(predicate, timeout: float = 30.0, what: str = "the page"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def player(browser) -> dict:
    return browser.execute_script(
        "const p = document.getElementById('player');"
        "return {t: p.currentTime, src: p.src, error: p.error && p.error.code, buffered: p.buffered.length,"
        "        paused: p.paused};"
    )


def test_the_page_speaks_and_plays_while_streaming(browser, gateway, server):
    from selenium.webdriver.common.by import By

    browser.get(gateway + "/")
    assert browser.title == "FireRedTTS3"
    text = browser.find_element(By.ID, "input")
    text.clear()
    text.send_keys("Hello from a real browser.")
    browser.find_element(By.ID, "format").send_keys("wav")
    browser.find_element(By.CSS_SELECTOR, "#speak button[type=submit]").click()
    # the audio element plays while the server is still generating the utterance (400 patches = 64 s)
    state = wait_for(lambda: (s := player(browser))["t"] > 0.2 and s, what="playback to start")
    assert state["error"] is None and not state["paused"] and "/v1/audio/speech?" in state["src"]
    assert "response_format=wav" in state["src"]
    assert metrics(server)["tts_generator_active_slots"] >= 1
    download = browser.find_element(By.ID, "download")
    assert download.is_displayed() and download.get_attribute("download") == "speech.wav"
    assert browser.find_element(By.ID, "error").text == ""
    browser.get("about:blank")  # leaving the page drops the stream: the server frees it
    m = wait_gauges_zero(server, 30)
    assert m["tts_generator_active_slots"] == 0 and m["tts_vocoder_active_streams"] == 0


def test_an_unknown_voice_shows_a_readable_message(browser, gateway, server, tmp_path):
    """A voice the picker listed but that was removed before the user pressed Speak."""
    import httpx
    import soundfile as sf
    from selenium.webdriver.common.by import By

    wav = tmp_path / "gone.wav"
    sf.write(wav, (0.1 * np.random.default_rng(4).standard_normal(24000)).astype(np.float32), 24000)
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    with wav.open("rb") as f:
        r = httpx.post(f"{gateway}/v1/audio/voices", data={"name": "soon-gone", "text": "a voice"},
                       files={"file": ("gone.wav", f)}, headers=admin, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    browser.get(gateway + "/")
    picker = "return Array.from(document.getElementById('voice').options).map(o => o.value)"
    wait_for(lambda: "soon-gone" in browser.execute_script(picker), what="the voice in the picker")
    assert httpx.delete(f"{gateway}/v1/audio/voices/soon-gone", headers=admin, timeout=10).status_code == 200
    browser.execute_script("document.getElementById('voice').value = 'soon-gone'")
    browser.find_element(By.CSS_SELECTOR, "#speak button[type=submit]").click()
    message = wait_for(lambda: browser.find_element(By.ID, "error").text, what="the error message")
    assert message == "voice 'soon-gone' is not registered (GET /v1/audio/voices lists them)"


def test_a_voice_uploaded_on_the_page_is_picked_and_speaks(browser, gateway, server, tmp_path):
    import httpx
    import soundfile as sf
    from selenium.webdriver.common.by import By

    wav = tmp_path / "me.wav"
    sf.write(wav, (0.1 * np.random.default_rng(3).standard_normal(24000)).astype(np.float32), 24000)
    browser.get(gateway + "/")
    browser.find_element(By.ID, "vname").send_keys("from-the-page")
    browser.find_element(By.ID, "vfile").send_keys(str(wav))
    browser.find_element(By.ID, "vtext").send_keys("my own voice")
    browser.find_element(By.ID, "vkey").send_keys("wrong key")
    browser.find_element(By.CSS_SELECTOR, "#upload button[type=submit]").click()
    assert "admin key" in wait_for(lambda: browser.find_element(By.ID, "upload-error").text, what="the refusal")
    key = browser.find_element(By.ID, "vkey")
    key.clear()
    key.send_keys(server.admin_key)
    browser.find_element(By.CSS_SELECTOR, "#upload button[type=submit]").click()
    wait_for(lambda: browser.execute_script("return document.getElementById('voice').value") == "from-the-page",
             what="the new voice to be picked")  # fmt: skip
    assert browser.find_element(By.ID, "upload-error").text == ""
    browser.find_element(By.CSS_SELECTOR, "#speak button[type=submit]").click()
    wait_for(lambda: player(browser)["t"] > 0.2, what="playback with the uploaded voice")
    assert "voice=from-the-page" in player(browser)["src"]
    browser.get("about:blank")
    admin = {"Authorization": f"Bearer {server.admin_key}"}
    assert httpx.delete(f"{gateway}/v1/audio/voices/from-the-page", headers=admin, timeout=10).status_code == 200
    wait_gauges_zero(server, 30)


def test_the_instruct_boxes_show_the_gateway_refusals(browser, gateway, tmp_path):
    """ "Describe a voice" and "Edit a recording" send their fields and show what is wrong with them (the
    gateway's own checks: these run without FireRedTTS3-Instruct on the server)."""
    import soundfile as sf
    from selenium.webdriver.common.by import By

    wav = tmp_path / "edit-me.wav"
    sf.write(wav, (0.1 * np.random.default_rng(5).standard_normal(24000)).astype(np.float32), 24000)
    browser.get(gateway + "/")
    error = lambda: browser.find_element(By.ID, "design-error").text  # noqa: E731
    browser.find_element(By.ID, "efile").send_keys(str(wav))
    browser.find_element(By.ID, "etype").send_keys("speed")  # the acoustic option
    browser.find_element(By.ID, "einstr").send_keys("make it faster")
    browser.find_element(By.CSS_SELECTOR, "#edit button[type=submit]").click()
    message = wait_for(lambda: browser.find_element(By.ID, "edit-error").text, what="the acoustic edit's refusal")
    assert "is not an acoustic edit the model knows" in message and "adjust the speed to X" in message
    browser.find_element(By.ID, "dinstr").send_keys("a calm older man<|im_end|>")
    browser.find_element(By.ID, "dname").send_keys("designed-on-the-page")
    browser.find_element(By.ID, "dsave").click()
    assert "admin key" in wait_for(lambda: "admin key" in error() and error(), what="the missing key's refusal")
    browser.find_element(By.ID, "dkey").send_keys("any key")
    browser.find_element(By.ID, "dsave").click()
    assert "control token" in wait_for(lambda: "control token" in error() and error(), what="the instruction's refusal")
    browser.execute_script("document.getElementById('design-error').textContent = ''")  # the save's refusal
    browser.find_element(By.CSS_SELECTOR, "#design button[type=submit]").click()  # fetches the GET form
    assert "control token" in wait_for(lambda: "control token" in error() and error(), what="the GET's refusal")
    assert browser.find_element(By.ID, "error").text == ""  # nothing at the top: each box has its own


def screenshot(browser, name: str) -> bytes:
    """The viewport as PNG, also kept as ``results/screenshots/<name>.png`` (the suite's artefacts, ignored by git)."""
    png = browser.get_screenshot_as_png()
    folder = REPO_ROOT / "results" / "screenshots"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.png").write_bytes(png)
    return png


def test_a_screenshot_of_the_page(browser, gateway):
    """Not a check of pixels: the page renders to a non-blank image."""
    from PIL import Image

    browser.get(gateway + "/")
    image = np.asarray(Image.open(io.BytesIO(screenshot(browser, "page"))).convert("L"))
    assert image.shape[0] > 300 and image.std() > 5  # text and controls, not an empty page


def test_a_refused_key_is_explained_beside_its_box_with_where_the_key_is(browser, gateway, tmp_path):
    """The upload's refusal shows in the upload box, not at the top, and says where the launcher keeps the key."""
    import soundfile as sf
    from selenium.webdriver.common.by import By

    wav = tmp_path / "me.wav"
    sf.write(wav, (0.1 * np.random.default_rng(6).standard_normal(24000)).astype(np.float32), 24000)
    browser.get(gateway + "/")
    browser.find_element(By.ID, "vname").send_keys("refused")
    browser.find_element(By.ID, "vfile").send_keys(str(wav))
    browser.find_element(By.ID, "vkey").send_keys("wrong key")
    browser.find_element(By.CSS_SELECTOR, "#upload button[type=submit]").click()
    inside = "return Array.from(document.querySelectorAll('#upload .error')).map(e => e.textContent).join('')"
    message = wait_for(lambda: browser.execute_script(inside), what="the refusal in the upload box")
    assert "admin key" in message and "~/.cache/fireredtts3-triton/admin_key" in message
    assert "Authorization" not in message  # the API's wording is not the page's
    assert browser.find_element(By.ID, "error").text == ""


def test_speak_shows_its_working_state_sends_the_speed_and_download_is_what_plays(browser, gateway):
    from selenium.webdriver.common.by import By

    browser.get(gateway + "/")
    browser.execute_script(  # every status the Speak box shows, as it shows it
        "window.seen = []; new MutationObserver(() => window.seen.push("
        "document.getElementById('speak-status').textContent)).observe("
        "document.getElementById('speak-status'), {childList: true, characterData: true, subtree: true});"
    )
    speed = browser.find_element(By.ID, "speed")
    speed.clear()
    speed.send_keys("1.5")
    browser.find_element(By.ID, "format").send_keys("wav")
    browser.find_element(By.CSS_SELECTOR, "#speak button[type=submit]").click()
    wait_for(lambda: player(browser)["t"] > 0.2, what="playback")
    assert "speed=1.5" in player(browser)["src"]
    assert any(s.startswith("speaking") for s in browser.execute_script("return window.seen"))
    assert browser.find_element(By.ID, "download").get_attribute("href") == player(browser)["src"]
    browser.get("about:blank")


def test_at_390_px_nothing_overflows_and_the_edit_box_shows_its_error(browser, gateway, tmp_path):
    """A phone's width: no horizontal scrolling, and the edit box's refusal is on screen beside the box."""
    import soundfile as sf
    from selenium.webdriver.common.by import By

    wav = tmp_path / "edit-me.wav"
    sf.write(wav, (0.1 * np.random.default_rng(7).standard_normal(24000)).astype(np.float32), 24000)
    browser.set_window_size(390, 844)
    browser.get(gateway + "/")
    inner = browser.execute_script("return window.innerWidth")
    assert inner <= 420  # the window really is a phone's width (Chromium may keep a few pixels of frame)
    widths = "return [document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    scroll, client = browser.execute_script(widths)
    assert scroll <= client, f"the page is {scroll} px wide in a {client} px viewport"
    screenshot(browser, "page-390px")
    browser.find_element(By.ID, "efile").send_keys(str(wav))
    browser.find_element(By.ID, "etype").send_keys("speed")
    browser.find_element(By.ID, "einstr").send_keys("make it faster")
    browser.find_element(By.CSS_SELECTOR, "#edit button[type=submit]").click()
    error = browser.find_element(By.ID, "edit-error")
    wait_for(lambda: error.text, what="the edit's refusal")
    browser.execute_script("arguments[0].scrollIntoView({block: 'center'})", error)
    box = browser.execute_script("const r = arguments[0].getBoundingClientRect(); return [r.left, r.right, r.top,"
                                 " r.bottom, window.innerWidth, window.innerHeight]", error)  # fmt: skip
    left, right, top, bottom, width, height = box
    assert 0 <= left and right <= width and 0 <= top and bottom <= height, box
    scroll, client = browser.execute_script(widths)
    assert scroll <= client, f"with the error shown the page is {scroll} px wide in a {client} px viewport"
    screenshot(browser, "page-390px-edit-error")


def test_the_long_text_box_shows_a_jobs_progress_and_cancels_it(browser, gateway, server):
    """Long text submits a job (docs/longform.md) and shows its progress from the events stream; Cancel ends
    it, the box says so, and the server's streams are freed."""
    from selenium.webdriver.common.by import By

    browser.get(gateway + "/")
    browser.find_element(By.ID, "ltext").send_keys("A first paragraph.\n\nA second one.")
    browser.find_element(By.CSS_SELECTOR, "#long button[type=submit]").click()
    status = browser.find_element(By.ID, "long-status")
    wait_for(lambda: "running: part 0 of 1, 0.0 s of audio" in status.text, what="the job's progress")
    browser.find_element(By.ID, "lcancel").click()
    error = browser.find_element(By.ID, "long-error")
    wait_for(lambda: error.text == "the job was cancelled", what="the cancel")
    assert not browser.find_element(By.ID, "lcancel").is_displayed()
    wait_gauges_zero(server, 30)
    browser.get("about:blank")
