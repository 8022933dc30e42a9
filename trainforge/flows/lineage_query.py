"""The `lineage-query` flow: the legal team's questions, run from the Prefect UI or API (a deployment form).

  query="datasets-of"  target="models:/nlp.chat/3"          which datasets and licenses a model depends on
  query="trained-on"   dataset="web@0ea82e" file="/raw/x"   what was trained on a dataset version / file
  query="license"      license="non-commercial"             every run that used a license class
  query="withdraw"     dataset="web@0ea82e" why="..." quarantine=True   the removal workflow
Returns JSON (also stored as a Prefect markdown artifact, a table a reviewer reads in the UI).
"""

from __future__ import annotations

from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE

Query = Literal["datasets-of", "trained-on", "license", "withdraw"]


@task(name="query-lineage", cache_policy=NO_CACHE)
def query_lineage(query: Query, target: str, dataset: str, file: str | None, license: str, why: str,
                  quarantine: bool, who: str | None) -> dict[str, Any]:
    from trainforge.registry.lineage import LineageStore, node_table

    store = LineageStore()
    name, _, version = dataset.partition("@")
    if query == "datasets-of":
        result = {"datasets": store.datasets_of(target)}
    elif query == "trained-on":
        result = store.trained_on(name or None, version or None, file)
    elif query == "license":
        result = store.runs_by_license(license)
    elif query == "withdraw":  # the rows of the trained-on report, the MLflow tags set (lineage_withdrawal.py)
        from trainforge.registry.lineage_withdrawal import withdraw

        done = withdraw(name, version, who=who, why=why, quarantine=quarantine, store=store)
        if done["tag_errors"]:
            raise RuntimeError("the withdrawal is recorded, but some MLflow tags could not be set (run the query "
                               "again to retry): " + "; ".join(done["tag_errors"]))
        return {"datasets": done["datasets"], "affected": done["affected"]}
    else:
        raise ValueError(f"unknown query {query!r}")
    return {k: node_table(v) for k, v in result.items()}


def _markdown(query: str, result: dict[str, list[dict[str, Any]]]) -> str:
    lines = [f"# lineage: {query}"]
    for section, rows in result.items():
        lines += [f"## {section} ({len(rows)})", "", "| kind | name | version | license | status |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['name']} | {r['version']} | {r['license']} | {r['status']} |" for r in rows]
    return "\n".join(lines)


@flow(name="lineage-query", log_prints=False)
def lineage_query(query: Query, target: str = "", dataset: str = "", file: str | None = None,
                  license: str = "", why: str = "", quarantine: bool = False, who: str | None = None
                  ) -> dict[str, Any]:
    """Answer one lineage question; see the module docstring for the parameters each query uses."""
    from prefect.artifacts import create_markdown_artifact

    result = query_lineage(query, target, dataset, file, license, why, quarantine, who)
    counts = {k: len(v) for k, v in result.items()}
    get_run_logger().info("lineage %s: %s", query, counts)
    create_markdown_artifact(_markdown(query, result), key="lineage-query", description=f"lineage {query}")
    return result
