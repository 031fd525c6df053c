"""Everything Triton-facing: the contract between the models (contract.py), the launcher (serve.py) and one sub-package per concern (docs/development.md, Layout)."""
