"""Cluster backends: where a gang's workers run. `local` (this host, embedded default) and `kubernetes`."""
