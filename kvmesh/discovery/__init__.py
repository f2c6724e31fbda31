"""Service discovery through etcd: the key layout (pure) and the etcd adapter."""
