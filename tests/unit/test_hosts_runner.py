"""The hosts backend's command lines (pure): how a node agent is started through a runner template.

Run: .venv/bin/python -m pytest tests/unit/test_hosts_runner.py
"""

import shlex

import pytest

from trainforge.infra.backends.hosts import agent_command, runner_command
from trainforge.infra.backends.node_agent import NodeProgram
from trainforge.plan.cluster import ClusterSpec, LauncherSpec
from trainforge.spec import SpecError


def test_ssh_gets_the_agent_as_one_quoted_word_for_the_remote_shell():
    argv = runner_command("ssh {host} {command}", "gpu-7", agent_command("/opt/my venv/bin/python"))
    assert argv == ["ssh", "gpu-7", "exec '/opt/my venv/bin/python' -m trainforge.infra.backends.node_agent"]
    # what the remote login shell makes of it: the interpreter's path with its space stays one word
    assert shlex.split(argv[2]) == ["exec", "/opt/my venv/bin/python", "-m", "trainforge.infra.backends.node_agent"]


def test_a_template_with_options_and_a_local_shell():
    argv = runner_command("ssh -o BatchMode=yes -p 2222 admin@{host} {command}", "h1", ["python", "-c", "print('a b')"])
    assert argv == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "admin@h1", "exec python -c 'print('\"'\"'a b'\"'\"')'"]
    netns = runner_command("nsenter --net=/run/netns/t-{host} sh -c {command}", "h2", ["python", "-m", "m"])
    assert netns == ["nsenter", "--net=/run/netns/t-h2", "sh", "-c", "exec python -m m"]


def test_argv_spreads_the_command_for_programs_that_take_one():
    argv = runner_command("docker exec -i node-{host} {argv}", "h3", ["/venv/bin/python", "-m", "a b"])
    assert argv == ["docker", "exec", "-i", "node-h3", "/venv/bin/python", "-m", "a b"]


def test_a_rendezvous_port_left_to_the_first_node_is_filled_in_for_the_others():
    from trainforge.infra.launch import GangNode, gang_launch, with_rendezvous_port

    first, second = gang_launch([GangNode("a", "10.0.0.1"), GangNode("b", "10.0.0.2")], nproc_per_node=1, port=0,
                                run_id="r", max_restarts=0, log_dir=lambda r, n: "/l", rendezvous="c10d")
    assert "--rdzv-endpoint=10.0.0.1:0" in second.command()
    filled = with_rendezvous_port(second.command(), 41234)
    assert "--rdzv-endpoint=10.0.0.1:41234" in filled and len(filled) == len(second.command())
    assert with_rendezvous_port(filled, 5) == filled  # a port already set is kept


def test_braces_elsewhere_in_a_template_are_left_alone():
    argv = runner_command("env X={x} ssh {host} {command}", "h", ["true"])
    assert argv == ["env", "X={x}", "ssh", "h", "exec true"]


def test_the_launcher_needs_both_fields_and_hosts_for_every_group():
    for runner in ("ssh {host}", "ssh {command}", "sudo -u {host} {argv} {command}"):
        with pytest.raises(ValueError, match="needs {host} and one of"):
            LauncherSpec(runner=runner)
    doc = {"name": "c", "launcher": {"backend": "hosts"},
           "node_groups": [{"name": "g", "gpu_type": "cpu", "nodes": 1, "gpus_per_node": 2}]}
    with pytest.raises(ValueError, match="list no `hosts`"):
        ClusterSpec.model_validate(doc)
    doc["node_groups"][0]["hosts"] = [{"name": "h1", "address": "10.0.0.1"}, {"name": "h2", "address": "10.0.0.2"}]
    with pytest.raises(ValueError, match="lists 2 hosts for nodes: 1"):
        ClusterSpec.model_validate(doc)


def test_hosts_name_the_scheduler_nodes_and_their_racks():
    from trainforge.infra.scheduler.state import nodes_from_spec

    cluster = ClusterSpec.model_validate({
        "name": "rig", "launcher": {"backend": "hosts", "interface": "eth0"},
        "node_groups": [{"name": "g", "gpu_type": "cpu", "nodes": 3, "gpus_per_node": 2, "hosts": [
            {"name": "h1", "address": "10.0.0.1", "rack": "a"}, {"name": "h2", "address": "10.0.0.2", "rack": "a"},
            {"name": "h3", "address": "10.0.0.3", "rack": "b"}]}]})
    assert [(n.name, n.rack) for n in nodes_from_spec(cluster)] == [("h1", "a"), ("h2", "a"), ("h3", "b")]
    assert cluster.host("h3").address == "10.0.0.3" and cluster.host("nope") is None
    assert cluster.node_groups[0].racks == 2


def test_a_bad_host_name_is_refused_naming_the_field(tmp_path):
    from trainforge.plan.cluster import load_cluster

    path = tmp_path / "c.yaml"
    path.write_text("name: c\nnode_groups:\n- {name: g, gpu_type: cpu, nodes: 1, gpus_per_node: 1,\n"
                    "   hosts: [{name: 'h 1; rm -rf /', address: 10.0.0.1}]}\n")
    with pytest.raises(SpecError) as err:
        load_cluster(path)
    assert "hosts" in str(err.value) and "name" in str(err.value)


def test_the_node_program_round_trips_one_line():
    program = NodeProgram(node="h1", work_dir="/w", torchrun=["python", "-m", "x"], sidecar=None,
                          env={"A": "1\n2"}, config='{"a": 1}', devices=[0, 1])
    line = program.to_line()
    assert line.count("\n") == 1 and NodeProgram.from_line(line) == program


def test_the_example_cluster_of_hosts_loads_and_places_by_its_racks():
    from pathlib import Path

    from trainforge.infra.scheduler.state import nodes_from_spec
    from trainforge.plan.cluster import load_cluster

    cluster = load_cluster(Path(__file__).resolve().parents[2] / "examples/clusters/lab-hosts.yaml")
    assert cluster.launcher.backend == "hosts" and cluster.launcher.interface == "eth0"
    assert [(n.name, n.rack) for n in nodes_from_spec(cluster)] == [
        ("gpu-01", "r1"), ("gpu-02", "r1"), ("gpu-03", "r2"), ("gpu-04", "r2")]
