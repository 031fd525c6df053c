"""``python -m engine.frontend TEXT``: the front end's language, segments and their token counts."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from engine.frontend import describe, prepare
from engine.frontend.language import use_lid_model
from engine.text import TextTokenizer, write_tiny_tokenizer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m engine.frontend",
        description="Show what the model will be asked to say: the detected (or given) language, the "
        "cleaned, normalized segments and their token counts.",
    )
    ap.add_argument("text", help="text to speak ('-' reads stdin)")
    ap.add_argument("--language", help="language or dialect name (default: detect it)")
    ap.add_argument("--checkpoint", type=Path, help="count tokens with this checkpoint's text_tokenizer "
                    "(default: the built-in tiny tokenizer, whose counts are much higher)")  # fmt: skip
    ap.add_argument("--split-tokens", type=int, default=80, help="segment length (0: one segment); default 80")
    ap.add_argument("--max-patches", type=int, default=400, help="per-segment length limit; default 400")
    ap.add_argument("--no-normalize", dest="normalize", action="store_false", help="skip text normalization")
    ap.add_argument("--lid-model", help="fastText language-id model for detection (default: by script)")
    args = ap.parse_args(argv)
    text = sys.stdin.read() if args.text == "-" else args.text
    try:
        if args.checkpoint:
            tok = TextTokenizer.from_dir(args.checkpoint / "text_tokenizer")
        else:
            with tempfile.TemporaryDirectory() as tmp:
                write_tiny_tokenizer(tmp)
                tok = TextTokenizer.from_dir(tmp)
        if args.lid_model:
            use_lid_model(args.lid_model)

        def count(t: str) -> int:
            return len(tok.encode(t))

        prepared = prepare(text, args.language, count, args.split_tokens, args.normalize, args.max_patches)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(describe(prepared, count))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
