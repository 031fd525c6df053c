"""Jobs for long text (docs/longform.md): a text of up to a chapter spoken part by part in the background
(:mod:`gateway.jobs.runner`), its state in SQLite (:mod:`gateway.jobs.store`) and its audio on disk, behind
routes that poll, stream progress, cancel, download and delete (:mod:`gateway.jobs.routes`)."""
