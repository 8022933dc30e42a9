"""Pure renderers of Kubernetes manifests for a job's gang (JobSet + Kueue), and their offline validation.

No I/O and no `kubernetes` import here: `trainforge.infra.backends.kubernetes` applies what these produce.
"""
