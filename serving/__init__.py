"""Everything Triton-facing: contract, model repository, launcher, request parsing, BLS, voice store."""
