"""The configuration schema, split by area; `root.Config` is the whole of it.

The schema *is* the documentation: every option carries its default and a short doc string in the
dataclass field metadata, and `docs/config.md` is generated from it. DeepSpeed's own keys keep
DeepSpeed's code defaults; zerojax adds `mesh`, `model`, `data`, `run`, `checkpoint`, `distributed`
and `kernels`.
"""
