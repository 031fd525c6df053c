"""Running tritonserver and keeping it alive: finding and starting it, the launcher's supervisor and its rules, and the stubs' side of the run folder (heartbeats out, flags in)."""
