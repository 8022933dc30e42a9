"""The collective-communication environment of a worker pod, from the node group's network link (pure).

One variant per inter-node link of `trainforge.plan.cluster.Link`:
- `infiniband` (on-prem, NVIDIA network operator): NCCL over IB verbs on the mlx5 HCAs; the bootstrap and the
  torch store use the pod network (`eth0`).
- `efa` (AWS p4d/p5): NCCL through the aws-ofi-nccl plugin on libfabric's EFA provider, GPUDirect RDMA on.
- `gpudirect-tcpx` (GCP A3): NCCL's GPUDirectTCPX net plugin on the four data NICs (eth1-4), with the
  `tcpgpudmarxd` receive-datapath daemon as a sidecar (see `render.py`).
- `ethernet`: plain NCCL sockets; `loopback` (CPU nodes): gloo, no NCCL variables at all.
Timeouts: a hung collective becomes a failure (torch's NCCL watchdog), which the segment retry recovers from
the last committed checkpoint, instead of a job that sits idle on 2,048 GPUs.
"""

from __future__ import annotations

from dataclasses import dataclass

# torch's watchdog: abort the communicator and tear the process down on a timeout or async error.
_COMMON = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
    "NCCL_DEBUG": "WARN",
}

TCPX_DATA_NICS = "eth1,eth2,eth3,eth4"
TCPX_SOCKET_DIR = "/run/tcpx"


@dataclass(frozen=True, slots=True, kw_only=True)
class NcclConfig:
    link: str
    """The node group's inter-node link (`infiniband`, `efa`, `gpudirect-tcpx`, `ethernet`, `loopback`)."""
    collective_timeout_s: float = 600.0
    """Seconds before a collective that made no progress aborts the job (watchdog heartbeat)."""
    socket_ifname: str = "eth0"
    """Interface of the pod network: NCCL's bootstrap and the torch store."""
    ib_hca: str = "mlx5"
    """`NCCL_IB_HCA`: HCA name prefix (or an explicit `=mlx5_0,mlx5_1` list) of the RDMA NICs."""
    ib_timeout: int = 22
    """`NCCL_IB_TIMEOUT`: the IB verbs timeout exponent (4.096 us * 2^x); 22 is ~17 s, NCCL's default is 20."""


def nccl_environment(cfg: NcclConfig) -> dict[str, str]:
    """Variables for every worker container of the gang; empty for CPU (gloo) nodes."""
    if cfg.link in ("loopback", "nvlink", "nvswitch", "pcie"):
        return {}
    env = dict(_COMMON)
    env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] = str(int(cfg.collective_timeout_s))
    env["TRAINFORGE_COLLECTIVE_TIMEOUT_S"] = str(int(cfg.collective_timeout_s))
    env["NCCL_SOCKET_IFNAME"] = cfg.socket_ifname
    if cfg.link == "infiniband":
        env.update({"NCCL_IB_HCA": cfg.ib_hca, "NCCL_IB_TIMEOUT": str(cfg.ib_timeout), "NCCL_IB_RETRY_CNT": "7",
                    "NCCL_NET_GDR_LEVEL": "PHB"})
    elif cfg.link == "efa":
        env.update({"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
                    "NCCL_PROTO": "simple"})
    elif cfg.link == "gpudirect-tcpx":
        env.update({
            "NCCL_NET": "GPUDirectTCPX_v7",
            "NCCL_GPUDIRECTTCPX_SOCKET_IFNAME": TCPX_DATA_NICS,
            "NCCL_GPUDIRECTTCPX_CTRL_DEV": cfg.socket_ifname,
            "NCCL_GPUDIRECTTCPX_UNIX_CLIENT_PREFIX": TCPX_SOCKET_DIR,
            "NCCL_GPUDIRECTTCPX_FORCE_ACK": "0",
            "NCCL_CROSS_NIC": "0",
            "NCCL_ALGO": "Ring",
            "NCCL_PROTO": "Simple",
            "NCCL_NSOCKS_PERTHREAD": "4",
            "NCCL_SOCKET_NTHREADS": "1",
            "NCCL_DYNAMIC_CHUNK_SIZE": "524288",
            "NCCL_P2P_NET_CHUNKSIZE": "524288",
            "NCCL_P2P_PCI_CHUNKSIZE": "524288",
            "NCCL_P2P_NVL_CHUNKSIZE": "1048576",
            "LD_LIBRARY_PATH": "/usr/local/nvidia/lib64",
        })
    elif cfg.link != "ethernet":
        raise ValueError(f"no NCCL settings for inter-node link {cfg.link!r}: use infiniband, efa, "
                         "gpudirect-tcpx, ethernet or loopback")
    return env
