"""Discrete-event cluster simulator: replays traces through the scheduler policy and reports the metrics."""

from trainforge.infra.simulator.engine import SimConfig, Simulation
from trainforge.infra.simulator.traces import Trace, TraceJob, generate_tail, load_node_list, load_trace, mix

__all__ = ["SimConfig", "Simulation", "Trace", "TraceJob", "generate_tail", "load_node_list", "load_trace", "mix"]
