"""A simulated inference server for tests and benchmarks at cluster scale: ``model`` (pure,
virtual time) and ``engine`` (the worker's ``Engine`` protocol over it, in real time). It
computes no tokens; see docs/simulator.md."""

from .model import SimLoad, SimRequest, SimResult, SimulatedWorker, SimWorkerConfig

__all__ = ["SimLoad", "SimRequest", "SimResult", "SimWorkerConfig", "SimulatedWorker"]
