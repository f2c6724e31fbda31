"""Trace replay in virtual time: request streams (``traces``: the Mooncake trace; ``agentic``:
generated coding-agent sessions) replayed against simulated workers (``driver``) under a
pluggable routing policy (``policies``). See docs/simulator.md."""
