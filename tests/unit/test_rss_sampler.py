"""loadtest/rss_sampler.py: labels, a sample of a real process tree and its shm regions, the report."""

import csv
import os
import signal
import subprocess
import sys
import time

from loadtest import rss_sampler


def test_labels_name_stubs_by_model_and_python_modules(tmp_path):
    sleeper = "import time; time.sleep(30)\n"
    repo = tmp_path / "model_repository"
    models = [repo / "vocoder/1/model.py", repo / ("generator-" + "ab" * 16) / "1/model.py"]
    for model in models:
        model.parent.mkdir(parents=True)
        model.write_text(sleeper)
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake/gateway.py").write_text(sleeper)
    # the stub's command line: <backend dir>/triton_python_backend_stub <repository>/<model>/1/model.py ...
    stub = str(tmp_path / "backends/python/triton_python_backend_stub")
    procs = [subprocess.Popen([stub, str(model), "shm-region"], executable=sys.executable) for model in models]
    procs.append(subprocess.Popen([sys.executable, "-m", "fake.gateway"], cwd=tmp_path))
    try:
        time.sleep(0.3)
        labels = [rss_sampler.label(p.pid, launcher=os.getpid()) for p in procs]
        # the generator by its plain name, never its secret one
        assert labels == ["stub:vocoder", "stub:generator", "gateway"]
        assert rss_sampler.label(os.getpid(), launcher=os.getpid()) == "launcher"
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_sample_holds_every_process_of_the_tree_and_the_shm_regions(tmp_path):
    child = subprocess.Popen(["sleep", "30"])
    launcher = os.getpid()
    (tmp_path / f"tts{launcher}_1234_a").write_bytes(b"x" * 2**20)
    (tmp_path / f"tts{launcher}_1234_b").write_bytes(b"x" * 2**20)
    (tmp_path / "tts1_1234_other").write_bytes(b"x" * 2**20)  # another server's region
    try:
        rows = rss_sampler.sample(launcher, shm_dir=tmp_path)
    finally:
        child.kill()
        child.wait()
    by_pid = {row[1]: row for row in rows if row[0] != "shm"}
    assert by_pid[launcher][0] == "launcher" and by_pid[launcher][2] > 1  # MB
    assert 0 < by_pid[launcher][6] <= by_pid[launcher][2] + 1  # PSS: at most the RSS
    assert by_pid[child.pid][0] == "sleep"
    shm = next(row for row in rows if row[0] == "shm")
    assert shm[1] == 2 and shm[2] == 2.0  # regions, allocated MB


def test_sampling_stops_on_sigterm_with_a_last_sample(tmp_path):
    out = tmp_path / "rss.csv"
    sampler = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "loadtest.rss_sampler",
            "sample",
            "--launcher",
            str(os.getpid()),
            "--csv",
            str(out),
            "--every",
            "0.5",
        ],
    )
    time.sleep(1.6)
    sampler.send_signal(signal.SIGTERM)
    assert sampler.wait(timeout=10) == 0
    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert {r["label"] for r in rows} >= {"launcher", "shm"}
    assert len({r["seconds"] for r in rows}) >= 2


def test_report_takes_quarters_sums_the_server_and_starts_where_asked(tmp_path):
    out = tmp_path / "rss.csv"
    with out.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(rss_sampler.FIELDS)
        for t in range(0, 1201, 60):
            w.writerow([t, "tritonserver", 1, 100 if t < 120 else 200, 0, 0, 0, 80])
            w.writerow([t, "stub:tts", 2, 50, 0, 0, 0, 40])
            w.writerow([t, "gateway", 3, 10 + t // 60, 0, 0, 0, 0])
    text = rss_sampler.report(out)
    server = next(line for line in text.splitlines() if "tritonserver + stubs" in line).split()
    assert server[3] == "150" and server[7] == "250" and server[-2:] == ["(+67", "%)"]
    assert "0:00" in text and "5:00" in text and "20:00" in text
    gateway = next(line for line in text.splitlines() if line.strip().startswith("gateway")).split()
    assert gateway[1:6] == ["10", "15", "20", "25", "30"]
    pss = next(line for line in text.splitlines() if "stubs, PSS" in line).split()
    assert pss[4:9] == ["120"] * 5  # the gateway's is not in it
    text = rss_sampler.report(out, start_at=300)
    server = next(line for line in text.splitlines() if "tritonserver + stubs" in line).split()
    # the sample at ready first, then the window from 5:00; the change from the start, then from ready
    assert server[3:9] == ["150", "250", "250", "250", "250", "250"]
    assert server[9:] == ["+0", "(+0", "%)", "+100", "(+67", "%)"] and "start 5:00 in" in text
