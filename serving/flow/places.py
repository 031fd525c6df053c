"""The admission place of one ``tts`` request, and when a text-in stream holds it. No Triton, no files of its own.

:class:`Place` is the one owner of a request's place: it takes it from the gate (serving.flow.side_channel's
:class:`~serving.flow.admission.Admission`, shared with tts_ensemble), gives it back, and keeps the two gauges
that count places (``count(in_flight, waiting)``: held, and held with no audio sent since taken) in the same
calls, so that the gate and the gauges cannot disagree whichever way a request ends.

:class:`TextPlace` is the rule for a text-in stream (serving.intake.text_streams): it holds its place only while
it has text to speak. A piece with text (anything but whitespace) takes the place before it is queued; the place
goes back once the orchestrator reports that everything read so far has been spoken (no segment generating or
cut, no text held by the segmenter: :meth:`engine.orchestrator.Orchestrator.run_text`'s ``idle``) and no piece
with text is still unread. An open stream that says nothing holds no place, no generator slot (the orchestrator
takes one per segment) and no start place, so whitespace sent to keep a stream open refuses nobody.

A piece with text that finds the gate full fails its stream with the gate's busy message (``unavailable:``),
as a whole-text request is refused: a voice agent gets a definite answer at once and retries the turn, here or
on another replica, or says something else meanwhile. Waiting for a place instead would make the piece's
audio late by an amount the agent cannot see, and the gate already has its waiting room (``max_queue`` places
wait for a generator slot).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from engine.protocol import Unavailable


class Gate(Protocol):
    """What a place needs of the admission gate."""

    def enter(self) -> bool: ...
    def leave(self) -> None: ...
    def busy_message(self) -> str: ...


class Place:
    """One request's admission place (taken at most once at a time; ``give`` is safe to repeat)."""

    def __init__(self, gate: Gate, count: Callable[[int, int], None]):
        """``count(in_flight, waiting)``: add to the gauges (places held; held and no audio sent since)."""
        self.gate, self.count = gate, count
        self.held = self.waiting = False

    def take(self) -> bool:
        """Hold the place (True at once if held); False, nothing taken, when the gate is full."""
        if self.held:
            return True
        if not self.gate.enter():
            return False
        self.held = self.waiting = True
        self.count(1, 1)
        return True

    def audio(self) -> None:
        """Audio was sent: the request no longer waits (until the place is taken anew)."""
        if self.waiting:
            self.waiting = False
            self.count(0, -1)

    def give(self) -> None:
        """Give the place back, if held, with what the gauges count of it."""
        if self.held:
            self.gate.leave()
            self.count(-1, -1 if self.waiting else 0)
            self.held = self.waiting = False


class TextPlace:
    """The place of one text-in stream: held while it has text to speak (see the module)."""

    def __init__(self, place: Place):
        self.place = place
        self.unread = 0  # pieces with text queued and not yet read by the orchestrator

    def came(self, text: str) -> None:
        """A piece arrived, before it is queued: text takes the place; Unavailable (the gate's busy message,
        nothing taken) when the gate is full. Whitespace takes nothing."""
        if not text.strip():
            return
        if not self.place.take():
            raise Unavailable(self.place.gate.busy_message())
        self.unread += 1

    def read(self, text: str) -> None:
        """The orchestrator read a piece (it is the orchestrator's to report on from now)."""
        if text.strip():
            self.unread -= 1

    def idle(self) -> None:
        """The orchestrator has spoken everything it read: the place goes back unless a piece with text is
        still queued (it would take it anew at once)."""
        if self.unread == 0:
            self.place.give()

    def close(self) -> None:
        """The stream is over (ended, failed or cancelled): whatever it holds goes back."""
        self.place.give()
