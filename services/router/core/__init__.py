"""The router's transport-free core: worker set, validation and routing. No grpc, etcd or vLLM
imports here; the servicer and the discovery adapter call into it."""
