"""Prefect tasks: thin wrappers over the capabilities in datasets/, registry/, infra/ and plan/."""
