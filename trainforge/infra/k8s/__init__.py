"""Pure renderers of Kubernetes manifests for a job's gang (JobSet + Kueue: render.py), of the cluster's Kueue
objects (kueue.py), and their offline validation (validate.py, against the CRDs vendored in crds/).

No I/O and no `kubernetes` import here: `trainforge.infra.backends.kubernetes` applies what these produce.
"""
