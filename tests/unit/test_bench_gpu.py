"""bench/gpu.py's smoke mode: the whole script on the tiny preset, on CPU, in seconds."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import gpu


def test_smoke_run_prints_one_table(capsys):
    assert gpu.main(["--smoke", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| sdpa |")]
    assert [r.split("|")[2].strip() for r in rows] == ["1", "2"]
    assert "failed" not in out
    # the agreement check ran (on CPU it compares a copy with itself, so its numbers prove nothing here)
    assert "agreement, tiny preset, cpu" in out and "agreement check failed" not in out
    assert "FlashInfer not timed: no_cuda" in out and "KV cache:" in out


def test_snr_against_values_worked_by_hand():
    ones = torch.ones(100)
    assert gpu.snr_db(ones, ones * 1.1) == pytest.approx(20.0)  # error power 1/100 of the signal's
    assert gpu.snr_db(ones, ones * 1.01) == pytest.approx(40.0)
    assert gpu.snr_db(ones, -ones) == pytest.approx(10 * math.log10(1 / 4))  # an inverted copy: -6 dB
    assert gpu.snr_db(ones, ones.clone()) == float("inf")


def test_a_failing_point_is_reported_and_the_run_goes_on(monkeypatch, capsys):
    real = gpu.time_steps

    def flaky(model, n, *a, **k):
        if n == 2:
            raise RuntimeError("CUDA out of memory")
        return real(model, n, *a, **k)

    monkeypatch.setattr(gpu, "time_steps", flaky)
    assert gpu.main(["--smoke", "--device", "cpu", "--streams", "2,1"]) == 1
    out = capsys.readouterr().out
    assert "| sdpa | 2 | | | | | | | failed: RuntimeError: CUDA out of memory |" in out
    assert any(line.startswith("| sdpa | 1 | ") and "ran sdpa" in line for line in out.splitlines())


def test_random_models_follow_the_precision_policy():
    model = gpu.random_model("tiny", "cpu", dtype={"backbone": torch.bfloat16})
    assert model.core.backbone_llm.norm.weight.dtype == torch.bfloat16
    assert model.core.dit_head.weight.dtype == torch.float32 and model.dtype == torch.bfloat16
    assert model.core.stop_head.bias.item() == -30.0  # utterances run their full length


def test_the_shell_wrapper_runs_the_smoke_mode():
    r = subprocess.run(["bash", "bench/gpu.sh", "--smoke", "--device", "cpu", "--streams", "1"], check=False,
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2],
                       env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})  # fmt: skip
    if r.returncode != 0 and "needs >= 2.11" in r.stderr:
        pytest.skip(r.stderr.strip())
    assert r.returncode == 0, r.stderr
    assert "| sdpa | 1 |" in r.stdout


def test_precision_benchmark_reports_each_variant(capsys):
    from bench import precision

    assert precision.main(["--preset", "tiny", "--patches", "2"]) == 0
    rows = {line.split("|")[1].strip(): line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")}
    assert set(precision.VARIANTS) <= set(rows)
    # bfloat16 only where a variant puts it: the networks left in float32 reproduce float32 exactly
    enc = [c.strip() for c in rows["encoder bf16"].split("|")[2:-1]]
    assert enc[0] != "inf" and enc[1:] == ["inf"] * 4
    assert rows["backbone bf16"].split("|")[2].strip() == "inf"


def test_sync_count_runs_without_a_gpu_on_the_meta_device(capsys):
    """``bench/gpu.sh --syncs-only`` on CPU: the preset on meta in the CUDA policy, one sync per step."""
    assert gpu.main(["--syncs-only", "--device", "cpu", "--preset", "tiny", "--streams", "2"]) == 0
    out = capsys.readouterr().out
    assert "host syncs per generator step (2 streams, sdpa, meta, the CUDA precision policy; " in out
    assert "the first step prefills): 1, 1, 1 (budget 1" in out and "OVER BUDGET" not in out


def test_the_triton_ceiling_command_parses():
    """--triton's command is one bench.ceiling takes: the real networks of the full preset, open loop."""
    from bench import ceiling

    for device, smoke, preset in (("cuda", False, "full"), ("cpu", True, "tiny")):
        cmd = gpu.ceiling_command(device, smoke)
        assert cmd[1:4] == ["-m", "bench.ceiling", "--real"]
        args = ceiling.parse_args(cmd[3:])
        assert (args.real, args.device, args.preset, args.synthetic_step) == (True, device, preset, "")
        assert args.rate_start is not None  # open loop
        assert args.first_audio_rule is not smoke  # the headline's rule on the GPU; the smoke run checks the path
    with pytest.raises(SystemExit):  # --synthetic-step times the synthetic generator only
        ceiling.parse_args(["--real", "--synthetic-step", "h100"])
    with pytest.raises(SystemExit):  # the first-audio rule judges rates
        ceiling.parse_args(["--first-audio-rule"])
