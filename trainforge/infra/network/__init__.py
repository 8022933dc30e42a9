"""Per-job network isolation on hosts: sandboxes (a network namespace per job per host) and the packet filter
that lets only a job's own workers reach each other (sandbox.py: pure; netns.py: the commands)."""
