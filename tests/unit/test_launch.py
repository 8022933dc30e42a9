"""Pure launch builders: the torchrun command line and the worker environment.

Run: .venv/bin/python -m pytest tests/unit/test_launch.py
"""

import pytest

from trainforge.infra.launch import (
    GangNode,
    LaunchSpec,
    gang_launch,
    node_environment,
    torchrun_command,
    worker_environment,
)


def test_torchrun_command_uses_static_rendezvous_and_per_rank_logs():
    cmd = torchrun_command(LaunchSpec(nproc_per_node=2, master_port=29511, max_restarts=1, log_dir="/tmp/l"))
    assert cmd[1:3] == ["-m", "torch.distributed.run"]
    assert "--nproc-per-node=2" in cmd and "--max-restarts=1" in cmd and "--master-port=29511" in cmd
    assert not any(a.startswith("--rdzv-backend") or a == "--standalone" for a in cmd)  # c10d restarts hang
    assert "--log-dir=/tmp/l" in cmd and "--redirects=3" in cmd
    assert cmd[-2:] == ["-m", "trainforge.trainer.worker"]


def test_worker_environment_injects_config_threads_and_secrets():
    env = worker_environment({"PATH": "/bin"}, config_path="/j/worker-config.json", segment_attempt=2,
                             threads_per_worker=1, secrets={"HF_TOKEN": "x"})
    assert env["TRAINFORGE_JOB_CONFIG"] == "/j/worker-config.json"
    assert env["TRAINFORGE_SEGMENT_ATTEMPT"] == "2" and env["OMP_NUM_THREADS"] == "1" and env["HF_TOKEN"] == "x"


def test_platform_s3_credentials_are_replaced_by_the_jobs_own_identity():
    base = {"AWS_ACCESS_KEY_ID": "platform-admin", "AWS_SECRET_ACCESS_KEY": "admin-secret",
            "AWS_SESSION_TOKEN": "tok", "TRAINFORGE_JOB_S3_ACCESS_KEY_ID": "job-key",
            "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY": "job-secret"}
    env = worker_environment(base, config_path="c", segment_attempt=0, threads_per_worker=1)
    assert env["AWS_ACCESS_KEY_ID"] == "job-key" and env["AWS_SECRET_ACCESS_KEY"] == "job-secret"
    assert "admin-secret" not in env.values() and "AWS_SESSION_TOKEN" not in env
    # without a job identity nothing changes (the embedded default has no S3 at all)
    plain = worker_environment({"AWS_ACCESS_KEY_ID": "a"}, config_path="c", segment_attempt=0, threads_per_worker=1)
    assert plain["AWS_ACCESS_KEY_ID"] == "a"


def test_no_way_back_to_the_platforms_identity_or_other_teams_secrets():
    base = {"AWS_ACCESS_KEY_ID": "platform-admin", "AWS_SECRET_ACCESS_KEY": "admin-secret", "AWS_PROFILE": "admin",
            "AWS_SHARED_CREDENTIALS_FILE": "/etc/tf/aws", "AWS_ENDPOINT_URL": "http://10.0.0.1:8333",
            "TRAINFORGE_SECRET_VISION_HF_TOKEN": "theirs", "PATH": "/bin"}
    sts = {"TRAINFORGE_JOB_S3_ACCESS_KEY_ID": "ASIAJOB", "TRAINFORGE_JOB_S3_SECRET_ACCESS_KEY": "job-secret",
           "TRAINFORGE_JOB_S3_SESSION_TOKEN": "job-token", "HF_TOKEN": "mine"}
    env = worker_environment(base, config_path="c", segment_attempt=0, threads_per_worker=1, secrets=sts)
    assert (env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], env["AWS_SESSION_TOKEN"]) == \
        ("ASIAJOB", "job-secret", "job-token")
    assert "AWS_PROFILE" not in env and "AWS_SHARED_CREDENTIALS_FILE" not in env
    assert "theirs" not in env.values() and env["HF_TOKEN"] == "mine" and env["AWS_ENDPOINT_URL"].endswith(":8333")
    # Without a job identity the workers keep the platform's keys (the warned-about `none` mode), never others'
    # secrets; the offline evaluate/export process gets no credentials at all.
    plain = worker_environment(base, config_path="c", segment_attempt=0, threads_per_worker=1)
    assert "TRAINFORGE_SECRET_VISION_HF_TOKEN" not in plain
    from trainforge.infra.storage.credentials import without_platform_credentials

    offline = without_platform_credentials({**base, **sts})
    assert set(offline) == {"AWS_ENDPOINT_URL", "PATH", "HF_TOKEN"}


def test_allocator_environment_preloads_jemalloc_only_when_asked_and_installed():
    from trainforge.infra.launch import JEMALLOC_PATHS, allocator_environment

    installed = {JEMALLOC_PATHS[2]}
    want = {"TRAINFORGE_ALLOCATOR": "jemalloc"}
    assert allocator_environment(want, installed.__contains__) == {"LD_PRELOAD": JEMALLOC_PATHS[2]}
    assert allocator_environment({}, installed.__contains__) == {}  # the default: glibc's malloc
    assert allocator_environment({"TRAINFORGE_ALLOCATOR": "system"}, installed.__contains__) == {}
    assert allocator_environment({**want, "LD_PRELOAD": "/opt/tc.so"}, installed.__contains__) == {}  # the user's
    with pytest.raises(ValueError, match="libjemalloc2"):
        allocator_environment(want, lambda path: False)
    with pytest.raises(ValueError, match="TRAINFORGE_ALLOCATOR='tcmalloc'"):
        allocator_environment({"TRAINFORGE_ALLOCATOR": "tcmalloc"}, installed.__contains__)


# ------------------------------------------------------------------------------------- one builder, every node


def _log(rank, node):
    return f"/w/{node.name}/logs"


def test_one_node_keeps_the_static_rendezvous_and_its_command_line():
    (only,) = gang_launch([GangNode("local-0")], nproc_per_node=2, port=29511, run_id="x", max_restarts=1,
                          log_dir=lambda r, n: "/tmp/l")
    assert only.command() == torchrun_command(LaunchSpec(nproc_per_node=2, master_port=29511, max_restarts=1,
                                                         log_dir="/tmp/l"))
    assert list(only.ranks) == [0, 1] and only.env == {"TRAINFORGE_NODE": "local-0"}


def test_hosts_meet_at_a_c10d_rendezvous_hosted_by_the_first_node_only():
    nodes = [GangNode("h2", "10.0.0.2", "r0", (2, 3)), GangNode("h1", "10.0.0.1", "r0", (0, 1)),
             GangNode("h3", "10.0.0.3", "r1", (0,))]
    launches = gang_launch(nodes, nproc_per_node=2, port=29400, run_id="job-3-ab", max_restarts=0, log_dir=_log,
                           python="/opt/venv/bin/python", gpu_type="h100", interface="eth0", rendezvous="c10d",
                           base={})
    # torch numbers c10d nodes by address: the builder orders them the same way, so each node's ranks are known
    assert [x.node.name for x in launches] == ["h1", "h2", "h3"]
    assert [list(x.ranks) for x in launches] == [[0, 1], [2, 3], [4, 5]]
    first, second = launches[0].command(), launches[1].command()
    assert first == [
        "/opt/venv/bin/python", "-m", "torch.distributed.run", "--nnodes=3", "--nproc-per-node=2",
        "--rdzv-backend=c10d", "--rdzv-endpoint=10.0.0.1:29400", "--rdzv-id=job-3-ab", "--rdzv-conf=is_host=1",
        "--local-addr=10.0.0.1", "--max-restarts=0", "--monitor-interval=0.5", "--log-dir=/w/h1/logs",
        "--redirects=3", "--tee=3", "-m", "trainforge.trainer.worker"]
    assert "--rdzv-conf=is_host=0" in second and "--local-addr=10.0.0.2" in second
    assert "--rdzv-endpoint=10.0.0.1:29400" in second and not any(a.startswith("--node-rank") for a in second)
    assert launches[1].env == {"TRAINFORGE_NODE": "h2", "GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "eth0",
                               "CUDA_VISIBLE_DEVICES": "2,3"}
    assert launches[2].env["CUDA_VISIBLE_DEVICES"] == "0"


def test_a_gang_builder_refuses_what_cannot_meet():
    with pytest.raises(ValueError, match="at least one node"):
        gang_launch([], nproc_per_node=1, port=1, run_id="x", max_restarts=0, log_dir=_log)
    with pytest.raises(ValueError, match="appears twice"):
        gang_launch([GangNode("a"), GangNode("a")], nproc_per_node=1, port=1, run_id="x", max_restarts=0,
                    log_dir=_log)
    with pytest.raises(ValueError, match="two share one"):  # the order would depend on process ids
        gang_launch([GangNode("a"), GangNode("b")], nproc_per_node=1, port=1, run_id="x", max_restarts=0,
                    log_dir=_log, rendezvous="c10d")


def test_several_agents_on_this_host_keep_their_given_order_and_one_static_master():
    launches = gang_launch([GangNode("n-1"), GangNode("n-0")], nproc_per_node=2, port=4000, run_id="x",
                           max_restarts=0, log_dir=lambda r, n: f"/l/node-{r}")
    assert [x.node.name for x in launches] == ["n-1", "n-0"]
    assert "--node-rank=1" in launches[1].command() and "--master-addr=127.0.0.1" in launches[1].command()
    assert [list(x.ranks) for x in launches] == [[0, 1], [2, 3]]


def test_a_remote_node_gets_settings_and_the_jobs_secrets_never_the_flow_hosts_paths_or_devices():
    env = {"PATH": "/flow/bin", "HOME": "/root", "TRAINFORGE_HOME": "/flow/home", "TRAINFORGE_JOB_CONFIG": "/c",
           "AWS_ACCESS_KEY_ID": "job", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "0", "HF_TOKEN": "t",
           "MY_SECRET": "s", "PYTHONUNBUFFERED": "1", "VIRTUAL_ENV": "/flow/venv", "TRAINFORGE_STORAGE_URL": "s3://b",
           "TRAINFORGE_DATA_CACHE": "/flow/cache", "TRAINFORGE_REPLICA_DIR": "/dev/shm/flow", "HF_HOME": "/flow/hf",
           "TORCH_EXTENSIONS_DIR": "/flow/ext", "AWS_SHARED_CREDENTIALS_FILE": "/flow/.aws/credentials",
           "TRAINFORGE_DATASETS_URL": "s3://catalog", "TRAINFORGE_JOB_CREDENTIALS": "seaweedfs",
           "TRAINFORGE_S3_ENDPOINT": "http://10.0.0.1:8333", "AWS_PROFILE": "flow", "HF_HUB_CACHE": "/flow/hub",
           "TORCH_HOME": "/flow/torch", "AWS_WEB_IDENTITY_TOKEN_FILE": "/flow/token"}
    assert node_environment(env, {"MY_SECRET": "s"}) == {
        "AWS_ACCESS_KEY_ID": "job", "OMP_NUM_THREADS": "1", "HF_TOKEN": "t", "MY_SECRET": "s",
        "PYTHONUNBUFFERED": "1", "TRAINFORGE_STORAGE_URL": "s3://b", "TRAINFORGE_S3_ENDPOINT": "http://10.0.0.1:8333"}
