# etcd for docker/docker-compose.yml where quay.io/coreos/etcd cannot be pulled: Debian's
# etcd-server (3.4) on a Debian base, with etcd and etcdctl where the upstream image has them.
# scripts/image.sh builds it as kvmesh-etcd:local; compose uses it with KVMESH_ETCD_IMAGE.
ARG BASE=debian:bookworm-slim
# hadolint ignore=DL3006
FROM ${BASE}
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends etcd-server etcd-client \
 && rm -rf /var/lib/apt/lists/* \
 && ln -s /usr/bin/etcd /usr/local/bin/etcd \
 && ln -s /usr/bin/etcdctl /usr/local/bin/etcdctl
ENV ETCDCTL_API=3
EXPOSE 2379 2380
ENTRYPOINT []
CMD ["/usr/local/bin/etcd"]
