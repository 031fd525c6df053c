"""Fakes of what only exists inside a running server, for unit tests (tests/fakes/pb.py)."""
