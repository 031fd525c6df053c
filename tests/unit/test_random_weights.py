"""The launcher and the page tell a random-weight checkpoint from the real weights by its tokenizer."""

from __future__ import annotations

import json
import sys

from engine import checkpoint, random_weights


def test_the_projects_checkpoint_has_random_weights_and_a_real_vocabulary_does_not(tiny_ckpt, tmp_path):
    assert random_weights.TOKENIZER_DIR == checkpoint.TOKENIZER_DIR
    assert random_weights.has_random_weights(tiny_ckpt)
    real = tmp_path / "real" / checkpoint.TOKENIZER_DIR
    real.mkdir(parents=True)
    (real / "vocab.json").write_text(json.dumps({f"w{i}": i for i in range(151_643)}))  # Qwen's learned words
    assert not random_weights.has_random_weights(tmp_path / "real")
    assert not random_weights.has_random_weights(tmp_path / "nothing-here")


def test_it_is_light_enough_for_the_gateway():
    """The gateway imports it for the page's note; it must not pull torch into that process."""
    import subprocess

    code = "import sys, engine.random_weights, gateway.app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"
