"""deploy/: the systemd units pass ``systemd-analyze verify``; the compose file parses and every
service's command line (the entry point's mapping of its environment) is accepted by its CLI; the
files the Dockerfile copies build a complete package; and the container's entry point, run outside
any container (these machines have no container daemon), starts a bootstrap node, a real server,
the gateway and the dashboard on 127.0.0.1 that serve a generation.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from swarm import lifeline
from swarm.local import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
ENTRYPOINT = DEPLOY / "entrypoint.sh"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
ROLE_MODULES = {role: f"swarm.{role}" for role in ("server", "bootstrap", "dashboard", "api")}
# every variable entrypoint.sh reads: cleared from the inherited environment before each run
MAPPED = [
    "SPECSWARM_INITIAL_PEERS",
    "SPECSWARM_INITIAL_PEERS_FILE",
    "SPECSWARM_WAIT_SECONDS",
    "MODEL",
    "NUM_BLOCKS",
    "BLOCKS",
    "HOST",
    "PORT",
    "ANNOUNCE_MADDRS",
    "PUBLIC_NAME",
    "DEVICE",
    "DTYPE",
    "QUANT",
    "CACHE_TOKENS",
    "IDENTITY_PATH",
    "API_KEY_FILE",
    "LOG_LEVEL",
    "EXTRA_ARGS",
    "PYTHON",
    "ENTRYPOINT_DRY_RUN",
]
FAKE_PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmXx6SxkRJPqhDZFaL5H56jgPxHzDTXgEwhF9gEGW9WWYU"


def clean_env(**variables: str) -> dict[str, str]:
    env = {k: v for k, v in lifeline.child_env().items() if k not in MAPPED}
    env["PYTHON"] = sys.executable  # the interpreter the tests run under stands in for the image's
    env.update(variables)
    return env


def dry_run(args: list[str], env: dict[str, str]) -> list[str]:
    """The command entrypoint.sh would exec, one argument per list item."""
    done = subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        env=clean_env(ENTRYPOINT_DRY_RUN="1", **env),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def accepted_by_cli(command: list[str]) -> tuple[str, object]:
    """Parse ``python -m MODULE ARGS`` with that CLI's own parser; returns (module, namespace)."""
    import importlib

    assert command[0] == sys.executable and command[1] == "-m", command
    module = command[2]
    cli = importlib.import_module(f"{module}.__main__" if module in ("swarm.dashboard", "swarm.api") else module)
    args = cli.build_parser().parse_args(command[3:])  # exits (SystemExit) on anything it rejects
    if module == "swarm.dashboard":
        cli.check_args(args)
    return module, args


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=value lines, as systemd's EnvironmentFile= and docker's --env-file read ours (no quotes)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            assert not value.startswith(('"', "'")), f"{path.name}: docker would keep the quotes of {key}"
            values[key.strip()] = value.strip()
    return values


def test_entrypoint_maps_the_environment_to_the_server_cli():
    command = dry_run(
        ["--update-period", "10"],
        dict(
            MODEL="smollm2-135m",
            NUM_BLOCKS="15",
            PUBLIC_NAME="my box",
            EXTRA_ARGS="--torch-threads 2",
            ANNOUNCE_MADDRS="/ip4/203.0.113.9/tcp/31330",
            SPECSWARM_INITIAL_PEERS=FAKE_PEER,
        ),
    )
    module, args = accepted_by_cli(command)
    assert module == "swarm.server" and command[-2:] == ["--update-period", "10"]  # the command's own arguments last
    assert (args.model, args.num_blocks, args.public_name) == ("smollm2-135m", 15, "my box")
    assert (args.torch_threads, args.port, args.host) == (2, 31330, "0.0.0.0")
    assert args.announce_maddrs == ["/ip4/203.0.113.9/tcp/31330"] and args.initial_peers == []  # read from the env
    assert (args.device, args.dtype, args.quant) == ("auto", "auto", "auto")
    env = clean_env(ENTRYPOINT_DRY_RUN="1")
    done = subprocess.run(["sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True)
    assert done.returncode == 2 and "set MODEL" in done.stderr
    done = subprocess.run(["sh", str(ENTRYPOINT), "echo", "any command"], env=env, capture_output=True, text=True)
    assert done.stdout == "any command\n"


# --- systemd -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def systemd_root(tmp_path_factory) -> Path:
    """A root for ``systemd-analyze verify --root``: the system's own unit directory (targets the
    units depend on), the entry point where the units expect it, and our units."""
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed (`make test` installs Debian's systemd package)")
    system_units = next((p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()), None)
    if system_units is None:
        pytest.skip("no systemd unit directory on this machine")
    root = tmp_path_factory.mktemp("systemd-root")
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    (root / "opt/specswarm/bin").mkdir(parents=True)
    shutil.copy(ENTRYPOINT, root / "opt/specswarm/bin/specswarm-entrypoint")
    (root / "etc/systemd/system").mkdir(parents=True)
    for unit in UNITS:
        shutil.copy(unit, root / "etc/systemd/system" / unit.name)
    return root


def test_there_is_a_unit_for_each_service():
    names = ("bootstrap", "dashboard", "gateway", "server")
    assert [u.name for u in UNITS] == [f"specswarm-{name}.service" for name in names]


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_passes_systemd_analyze_verify(unit, systemd_root):
    done = subprocess.run(
        ["systemd-analyze", "verify", f"--root={systemd_root}", unit.name], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0 and not (done.stdout + done.stderr).strip(), done.stdout + done.stderr


def test_verify_catches_a_broken_unit(systemd_root):
    """The check above has teeth: a misspelt key (only a warning to systemd) is output."""
    broken = systemd_root / "etc/systemd/system/specswarm-broken.service"
    broken.write_text((DEPLOY / "systemd/specswarm-server.service").read_text().replace("Restart=", "Restrat="))
    done = subprocess.run(
        ["systemd-analyze", "verify", f"--root={systemd_root}", broken.name], capture_output=True, text=True, timeout=60
    )
    assert "Unknown key" in done.stdout + done.stderr


def unit_settings(unit: Path) -> tuple[dict[str, str], list[str], list[str]]:
    """(Environment= values, EnvironmentFile= paths, ExecStart argv) of a unit, %S as /var/lib."""
    env, files, exec_start = {}, [], []
    for line in unit.read_text().replace("%S", "/var/lib").splitlines():
        key, _, value = line.partition("=")
        if key == "Environment":
            name, _, setting = value.partition("=")
            env[name] = setting
        elif key == "EnvironmentFile":
            files.append(value.removeprefix("-"))
        elif key == "ExecStart":
            exec_start = shlex.split(value)
    return env, files, exec_start


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_unit_command_line_is_accepted_by_its_cli(unit):
    """The unit's ExecStart with its Environment= lines and the example environment file
    (deploy/NAME.env.example for /etc/specswarm/NAME.env, whose values override) gives a command
    line its CLI accepts."""
    env, files, exec_start = unit_settings(unit)
    assert exec_start[0] == "/opt/specswarm/bin/specswarm-entrypoint", exec_start
    role = exec_start[1]
    assert files and all(f.startswith("/etc/specswarm/") for f in files)
    for name in files:
        env.update(read_env_file(DEPLOY / (Path(name).stem + ".env.example")))
    env.pop("PATH")  # the unit's venv; here the test's interpreter stands in for it (PYTHON)
    module, args = accepted_by_cli(dry_run(exec_start[1:], env))
    assert module == ROLE_MODULES[role]
    if role in ("dashboard", "api"):
        assert args.host == "127.0.0.1"  # the public face is a reverse proxy (deploy/README.md)
    if role in ("server", "bootstrap"):
        assert args.identity_path.startswith("/var/lib/specswarm-")  # kept in the unit's StateDirectory


# --- compose ---------------------------------------------------------------------------------------


def interpolate(value, variables: dict[str, str]):
    """Compose's ${VAR}, ${VAR:-default}, ${VAR-default}, $VAR and $$ in every string of ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, variables) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, variables) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group("braced") or match.group("plain")
        op, default = match.group("op"), match.group("default") or ""
        if op == ":-":
            return variables.get(name) or default
        if op == "-":
            return variables.get(name, default)
        return variables.get(name, "")

    pattern = r"\$\$|\$\{(?P<braced>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}|\$(?P<plain>\w+)"
    return re.sub(pattern, one, value)


def dockerfile_env() -> dict[str, str]:
    return dict(
        line.removeprefix("ENV ").split("=", 1)
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("ENV ")
    )


def test_compose_services_are_accepted_by_their_clis(tmp_path):
    import yaml

    compose = interpolate(yaml.safe_load((DEPLOY / "compose.yaml").read_text()), {})
    gpu = yaml.safe_load((DEPLOY / "compose.gpu.yaml").read_text())
    services = compose["services"]
    assert set(gpu["services"]) <= set(services)
    roles = {}
    peers_file = tmp_path / "initial_peers"
    peers_file.write_text(f"{FAKE_PEER}\n")
    for name, service in services.items():
        assert service["build"]["dockerfile"] == "deploy/Dockerfile"
        assert (DEPLOY / service["build"]["context"]).resolve() == ROOT  # relative to the compose file
        named_volumes = [v.split(":")[0] for v in service.get("volumes", [])]
        assert set(named_volumes) <= set(compose["volumes"]), name
        env = {**dockerfile_env(), **{k: str(v) for k, v in service.get("environment", {}).items()}}
        assert env.pop("PYTHON") == "python3"
        assert env.get("SPECSWARM_INITIAL_PEERS_FILE") == "/shared/initial_peers" and "shared" in named_volumes
        env["SPECSWARM_INITIAL_PEERS_FILE"] = str(peers_file)  # the shared volume, as the bootstrap node fills it
        command = dry_run(service["command"], env)
        module, args = accepted_by_cli(command)
        roles[name] = module
        if module in ("swarm.server", "swarm.bootstrap"):  # an identity that survives `down`/`up`
            assert args.identity_path == "/data/identity.key" and f"{name}-data" in named_volumes, name
        if module in ("swarm.dashboard", "swarm.api"):
            assert args.initial_peers == [FAKE_PEER] and args.host == "0.0.0.0"
    assert sorted(roles.values()) == ["swarm.api", "swarm.bootstrap", "swarm.dashboard", "swarm.server", "swarm.server"]
    assert services["bootstrap"]["environment"]["ANNOUNCE_MADDRS"] == "/dns4/bootstrap/tcp/31337"


def test_the_files_the_image_copies_build_a_complete_package(tmp_path):
    """The Dockerfile's COPY lines (before `pip install .`) hold everything the wheel needs."""
    src = tmp_path / "src"
    src.mkdir()
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY ") and "entrypoint" not in line:
            *sources, target = line.split()[1:]
            for source in sources:
                dest = src / (source if target.endswith("/") else target)
                if (ROOT / source).is_dir():
                    shutil.copytree(ROOT / source, dest, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy(ROOT / source, dest)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path / "wheel"),
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    names = zipfile.ZipFile(next((tmp_path / "wheel").glob("specswarm-*.whl"))).namelist()
    for needed in [
        "swarm/server.py",
        "server/joining.py",
        "client/model.py",
        "protocol/messages.py",
        "swarm/dashboard/static/index.html",
        "swarm/api/__main__.py",
    ]:
        assert needed in names


# --- live: the entry point outside any container ---------------------------------------------------


class Processes:
    """Entry-point processes, each in its own process group, killed whole at the end."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str], env: dict[str, str], cwd: Path, stdout=subprocess.DEVNULL):
        log = open(self.log_dir / f"{name}.log", "w")
        proc = subprocess.Popen(
            ["sh", str(ENTRYPOINT), *args],
            env=clean_env(**env),
            cwd=cwd,
            stdout=stdout,
            stderr=log,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.procs[name] = proc
        return proc

    def kill_all(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def wait_for(condition, seconds: float, what: str, procs: Processes):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        dead = {n: p.returncode for n, p in procs.procs.items() if p.poll() is not None}
        assert not dead, f"exited while waiting for {what}: {dead} (logs in {procs.log_dir})"
        result = condition()
        if result:
            return result
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what} (logs in {procs.log_dir})")


@pytest.mark.timeout(420)
def test_entrypoint_runs_a_swarm_that_serves_a_generation(tiny_llama_path, tiny_reference, tmp_path, artifacts_dir):
    """Bootstrap, server, gateway and dashboard, each started as the container starts it: the
    entry point with the environment a container gets (the server: SPECSWARM_INITIAL_PEERS as in
    server.env; the others: the bootstrap's address file, as compose.yaml shares it)."""
    import torch

    from protocol.dht import make_dht
    from protocol.dht_records import fetch_servers
    from protocol.models import resolve_model
    from protocol.records import ServerState
    from swarm import AutoDistributedModelForCausalLM

    procs = Processes(artifacts_dir / "deploy-entrypoint")
    peers_file, data = tmp_path / "shared" / "initial_peers", tmp_path / "data"
    peers_file.parent.mkdir()
    data.mkdir()
    bootstrap_port = free_port()
    try:
        procs.start(
            "bootstrap",
            ["bootstrap"],
            dict(
                HOST="127.0.0.1",
                PORT=str(bootstrap_port),
                ANNOUNCE_MADDRS=f"/dns4/localhost/tcp/{bootstrap_port}",
                IDENTITY_PATH=str(data / "bootstrap.key"),
                SPECSWARM_INITIAL_PEERS_FILE=str(peers_file),
            ),
            data,
        )
        peers = wait_for(
            lambda: peers_file.exists() and peers_file.read_text().split(), 60, "the bootstrap's address", procs
        )
        assert peers[0].startswith(f"/dns4/localhost/tcp/{bootstrap_port}/p2p/Qm")

        server = procs.start(
            "server",
            [],
            dict(
                MODEL=str(tiny_llama_path),
                NUM_BLOCKS="6",
                HOST="127.0.0.1",
                PORT=str(free_port()),
                PUBLIC_NAME="entrypoint",
                IDENTITY_PATH=str(data / "server.key"),
                SPECSWARM_INITIAL_PEERS=" ".join(peers),
                EXTRA_ARGS="--torch-threads 1 --update-period 5 --drain-seconds 1",
                LOG_LEVEL="INFO",
            ),
            data,
        )
        for role in ("api", "dashboard"):
            env = dict(
                MODEL=str(tiny_llama_path),
                HOST="127.0.0.1",
                PORT=str(free_port()),
                SPECSWARM_INITIAL_PEERS_FILE=str(peers_file),
            )
            procs.start(role, [role], env, data, stdout=subprocess.PIPE)
        urls = {role: procs.procs[role].stdout.readline().decode().strip() for role in ("api", "dashboard")}
        assert urls["api"].startswith("http://127.0.0.1:"), urls
        assert urls["dashboard"].startswith("Dashboard: http://127.0.0.1:"), urls

        dht = make_dht(initial_peers=peers, client_mode=True)
        try:
            name = resolve_model(str(tiny_llama_path)).dht_name
            online = wait_for(
                lambda: [s for s in fetch_servers(dht, name, 6) if s.state == ServerState.ONLINE],
                240,
                "the server to announce itself online",
                procs,
            )
        finally:
            dht.shutdown()
        assert [(s.public_name, s.start_block, s.end_block) for s in online] == [("entrypoint", 0, 6)]
        assert (data / "server.key").exists() and (data / "bootstrap.key").exists()
        assert Path(f"/proc/{server.pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-m", b"swarm.server"]  # exec'd

        # the Python client, as a researcher would use it
        model = AutoDistributedModelForCausalLM.from_pretrained(str(tiny_llama_path), initial_peers=peers)
        try:
            ids = model.tokenizer("def fib(n):", return_tensors="pt")["input_ids"]
            out = model.generate(ids, max_new_tokens=6)
        finally:
            model.shutdown()
        with torch.no_grad():
            expected = tiny_reference.generate(ids, max_new_tokens=6, do_sample=False)
        assert out.tolist() == expected.tolist()

        # the gateway and the dashboard, as compose.yaml starts them
        body = json.dumps({"model": str(tiny_llama_path), "prompt": "def fib(n):", "max_tokens": 4, "temperature": 0})
        headers = {"Content-Type": "application/json"}
        request = urllib.request.Request(urls["api"] + "/completions", body.encode(), headers)
        with urllib.request.urlopen(request, timeout=120) as response:
            completion = json.load(response)
        assert completion["choices"][0]["text"] == model.tokenizer.decode(expected[0, ids.shape[1] : ids.shape[1] + 4])
        dashboard = urls["dashboard"].removeprefix("Dashboard: ")

        def dashboard_lists_the_server():
            with urllib.request.urlopen(dashboard + "api/v1/state", timeout=10) as response:
                state = json.load(response)
            return [s["public_name"] for m in state["models"] for s in m["servers"]] == ["entrypoint"]

        wait_for(dashboard_lists_the_server, 60, "the dashboard to list the server", procs)

        # SIGTERM reaches Python (the shell exec'd it): the server leaves cleanly
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=60) == 0
        assert "Server stopped" in (procs.log_dir / "server.log").read_text()
    finally:
        procs.kill_all()
