"""Pure launch builders: the torchrun command line and the worker environment.

Run: .venv/bin/python -m pytest tests/unit/test_launch.py
"""

import pytest

from trainforge.infra.launch import LaunchSpec, torchrun_command, worker_environment


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
