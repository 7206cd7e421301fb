"""Hooks that run autossd's kernels inside other libraries' models (each imported on its own:
`autossd.integrations.transformers` needs transformers installed; importing this package does not)."""
