"""Generated gRPC stubs for package kvmesh.v1 (python -m kvmesh.protogen). Do not edit."""
