"""Startup recovery (``docs/architecture.md``, "Recovery"): gather -> plan (pure) -> apply.

Recovery decides about hardware it did not just create, after a crash, with nothing but durable
records, pod annotations and what NVML shows. The decision is one pure function over plain values
(``plan.plan``), so every rule is testable on plain data and *nothing* is modified unless the whole
picture was read and verified.

The rest: ``docs/architecture.md``, "Module notes", ``sidecar.model.recovery``.
"""
