"""The segment contract between the control plane and every worker (docs: ARCHITECTURE.md, docs/contract.md).

Pure and importable without torch: the typed config a worker receives (`config`), the typed events it sends
(`events`), the transport that carries both ways across machines (`channel`), the control side's pure event router
(`router`) and segment controller (`controller`). Both the trainer and the control plane import this package; it
imports neither.
"""
