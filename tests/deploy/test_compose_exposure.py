"""compose/: what faces the network.  The gateway's plain HTTP port is published on loopback, and
behind the TLS front (docker-compose.tls.yml) the gateway refuses anything else; the public proxy
(Caddy) sends the gateway only the client API, checked in the Caddyfile and through a real Caddy,
and gives up an idle connection to the gateway before the gateway closes it; multi-host workers
bind the host's cluster address; the metrics proxy answers only Prometheus's token; each service
gets only the secrets it uses.  Renderings: ``tests/support/compose_render.py``.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import yaml

from common.cluster.http_limits import DEFAULTS as HTTP_DEFAULTS
from tests.support.compose_render import entrypoint_module, COMPOSE, STACKS, WORKER_SERVICES, compose_cli, env_values, load_stack, profile_sets, \
    published_addresses, render_cli, renderings, seconds
from tests.support.compose_render import env_files as make_env_files

pytestmark = pytest.mark.slow(seconds=10)  # a long file: scheduled by its length (tests/conftest.py)


@pytest.fixture(scope="module")
def env_files():
    return make_env_files()


@pytest.fixture(scope="module")
def rendered():
    return renderings()


def test_the_gateways_plain_http_port_is_published_on_loopback_only(rendered):
    for (stack, profiles), doc in rendered.items():
        if "gateway" not in doc["services"]:
            continue
        assert published_addresses(doc["services"]["gateway"]) == ["127.0.0.1"], (stack, profiles)
        if "tls" in profiles:  # the gateway's entrypoint checks the same setting the port uses
            env = doc["services"]["gateway"]["environment"]
            assert env["PDSERVE_TLS_FRONT"] == "1" and env["PDSERVE_GATEWAY_BIND"] == "127.0.0.1"


def run_service_script(spec: dict, env: dict[str, str], bin_dir, replace: dict[str, str] | None = None):
    """Run a service's ``sh -c`` entrypoint here, with stand-in tools in ``bin_dir``."""
    assert spec["entrypoint"][:2] == ["sh", "-c"]
    script = spec["entrypoint"][2]
    for old, new in (replace or {}).items():
        script = script.replace(old, new)
    return subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=30,
                          env={"PATH": f"{bin_dir}:/usr/bin:/bin", **env})


def stand_in(bin_dir, name: str):
    """An executable ``name`` in ``bin_dir`` that prints its name and arguments and exits 0."""
    bin_dir.mkdir(exist_ok=True)
    tool = bin_dir / name
    tool.write_text(f'#!/bin/sh\necho "{name} ran: $*"\n')
    tool.chmod(0o755)
    return tool


@pytest.fixture(scope="module")
def entrypoint():
    return entrypoint_module()


def render_with(stack: str, env_files, tmp_path, profiles, cli: bool = True, **settings) -> dict:
    """``stack`` as compose renders it with ``settings`` added to its env file (the CLI's rendering
    when ``cli`` and a CLI exists, else ours)."""
    values = {**env_values(env_files, stack), **settings}
    if not cli or compose_cli() is None:
        return load_stack(stack, values, profiles)
    env_file = tmp_path / f"{stack}-{'-'.join(profiles) or 'plain'}.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    result = render_cli(stack, env_file, profiles)
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.parametrize("stack", [stack for stack in STACKS if "tls" in STACKS[stack][2]])
def test_behind_the_tls_front_the_gateway_refuses_a_plain_port_beyond_loopback(stack, env_files, entrypoint, tmp_path,
                                                                               monkeypatch):
    """With PDSERVE_GATEWAY_BIND beyond loopback, compose publishes the gateway's plain port there;
    with the TLS front the gateway's own entrypoint then refuses to start (exit 78), so nothing
    answers plain HTTP there (the TLS front could only refuse itself).  Without the TLS front that
    bind is the operator's choice."""
    monkeypatch.setattr(entrypoint, "RUNTIME_FILE", tmp_path / "runtime.json")
    for bind in ("0.0.0.0", "10.0.0.5", "127.0.0.2"):
        for profiles in ((), ("tls",)):
            # The CLI renders one bind (a second or more each time); our structural rendering the others.
            gateway = render_with(stack, env_files, tmp_path, profiles, cli=bind == "0.0.0.0",
                                  PDSERVE_GATEWAY_BIND=bind)["services"]["gateway"]
            assert published_addresses(gateway) == [bind]
            env = {k: str(v) for k, v in gateway["environment"].items() if v is not None}
            if profiles and not bind.startswith("127."):
                with pytest.raises(entrypoint.Refusal, match=rf"published on {re.escape(bind)} \(PDSERVE_GATEWAY_BIND\)"):
                    entrypoint.prepare("gateway", env)
            else:
                entrypoint.prepare("gateway", env)


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_the_tls_front_refuses_to_serve_without_the_api_key(env_files, tmp_path):
    tls = load_stack("gpu", env_values(env_files, "gpu"), ("tls",))["services"]["tls"]
    stand_in(tmp_path / "bin", "caddy")
    ok = run_service_script(tls, tls["environment"], tmp_path / "bin")
    assert ok.returncode == 0 and "caddy ran: run --config /etc/caddy/Caddyfile" in ok.stdout, ok.stderr
    refused = run_service_script(tls, {**tls["environment"], "PDSERVE_ALLOW_NO_API_KEY": "1"}, tmp_path / "bin")
    assert refused.returncode == 78 and "requires the gateway API key" in refused.stderr and "caddy ran" not in refused.stdout


# The paths the gateway serves to clients, and paths that must never reach it from the public
# proxy, in the spellings a client can send (traversal, escapes, case, doubled slashes).
CLIENT_PATHS = ["/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/openapi.json"]
PRIVATE_PATHS = ["/admin/pools", "/admin", "/admin/", "/ADMIN/pools", "//admin/pools", "/admin/workers/w1/drain",
                 "/v1/../admin/pools", "/v1/%2e%2e/admin/pools", "/v1/%2E%2E/admin/pools", "/v1/..%2fadmin/pools",
                 "/v1%2f..%2fadmin/pools", "/%61dmin/pools", "/v1/./../admin/pools", "/health/../admin/pools",
                 "/openapi.json/../admin/pools", "/metrics", "/v1/../metrics", "/Metrics"]


def caddyfile_blocks(text: str) -> list[tuple[list[str], list]]:
    """The Caddyfile as nested (tokens of a line, child blocks) -- enough to see which directives
    sit inside which ``handle``."""
    root: list = []
    stack = [root]
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line == "}":
            stack.pop()
            continue
        opens = line.endswith("{")
        node = (line.rstrip("{").split(), [])
        stack[-1].append(node)
        if opens:
            stack.append(node[1])
    assert len(stack) == 1, "unbalanced braces"
    return root


def test_the_public_proxy_routes_only_the_client_api():
    """Structural check of compose/tls/Caddyfile (the end-to-end test below runs Caddy itself)."""
    (site,) = caddyfile_blocks((COMPOSE / "tls" / "Caddyfile").read_text())
    directives = site[1]
    matchers = {tokens[0]: tokens[1:] for tokens, _ in directives if tokens[0].startswith("@")}
    handles = [(tokens[1:], body) for tokens, body in directives if tokens[0] == "handle"]
    assert not any(tokens[0] == "reverse_proxy" for tokens, _ in directives), "a site-wide reverse_proxy"
    proxied = [m for m, body in handles if any(t[0] == "reverse_proxy" for t, _ in body)]
    assert len(proxied) == 1 and len(proxied[0]) == 1
    matcher = matchers[proxied[0][0]]
    assert matcher[0] == "path" and set(matcher[1:]) == {"/v1/*", "/health", "/openapi.json"}
    fallback = [body for m, body in handles if not m]
    assert fallback and fallback[0][0][0] == ["respond", "404"]


def test_the_public_proxy_gives_up_an_idle_gateway_connection_before_the_gateway_does(rendered):
    """Caddy's idle upstream connections (2 minutes by default) must close before the gateway's
    --keepalive-timeout does, else a request sent on a connection the gateway has just closed
    comes back 502."""
    (site,) = caddyfile_blocks((COMPOSE / "tls" / "Caddyfile").read_text())

    def find(blocks, *path):
        for tokens, body in blocks:
            if tokens[:len(path[0])] == path[0]:
                return body if len(path) == 1 else find(body, *path[1:])
        return None

    proxy = next(find(body, ["reverse_proxy"]) for tokens, body in site[1] if tokens[0] == "handle"
                 and find(body, ["reverse_proxy"]) is not None)
    transport = find(proxy, ["transport", "http"])
    keepalive = [tokens[1] for tokens, _ in transport or [] if tokens[0] == "keepalive"]
    assert keepalive, "no keepalive in the reverse proxy's transport http block"
    for (stack, profiles), doc in rendered.items():
        if "tls" in profiles:  # the gateway's keep-alive in the TLS stacks is the default one
            assert "PDSERVE_KEEPALIVE_TIMEOUT" not in doc["services"]["gateway"]["environment"], stack
    assert seconds(keepalive[0]) < HTTP_DEFAULTS.keepalive_timeout


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(shutil.which("caddy") is None, reason="no caddy binary (Debian: apt-get install caddy)")
def test_caddy_sends_only_client_api_paths_to_the_gateway(tmp_path):
    """The real Caddy, with the Caddyfile as compose mounts it (TLS swapped for plain HTTP on a local
    port), in front of a stand-in gateway that records every path it receives."""
    import http.client
    import http.server
    import socket
    import threading
    import time

    received: list[str] = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def _answer(self):
            received.append(self.path)
            self.send_response(200)
            self.send_header("Content-Length", "8")
            self.end_headers()
            self.wfile.write(b"gateway\n")

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    caddy, port = None, None
    try:
        env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "XDG_DATA_HOME": str(tmp_path / "data"),
               "XDG_CONFIG_HOME": str(tmp_path / "config"), "PDSERVE_TLS_DOMAIN": "pdserve.test",
               "PDSERVE_TLS_ISSUER": "internal"}
        adapted = subprocess.run(["caddy", "adapt", "--config", str(COMPOSE / "tls" / "Caddyfile"), "--adapter",
                                  "caddyfile"], capture_output=True, text=True, env=env, timeout=60)
        assert adapted.returncode == 0, adapted.stderr
        config = json.loads(adapted.stdout)
        idle = re.findall(r'"keep_alive":\{[^}]*"idle_timeout":(\d+)', adapted.stdout)
        assert idle and all(int(ns) / 1e9 < HTTP_DEFAULTS.keepalive_timeout for ns in idle), idle
        config["admin"] = {"disabled": True}
        config["apps"].pop("tls", None)
        (server,) = config["apps"]["http"]["servers"].values()
        server["automatic_https"] = {"disable": True}
        for _attempt in range(3):  # a free port can be taken before Caddy binds it: then another one
            port = free_port()
            server["listen"] = [f"127.0.0.1:{port}"]
            text = json.dumps(config).replace('"gateway:8000"', f'"127.0.0.1:{upstream.server_address[1]}"')
            (tmp_path / "caddy.json").write_text(text)
            with open(tmp_path / "caddy.log", "w") as log:  # a file: a pipe nobody reads could fill and block it
                caddy = subprocess.Popen(["caddy", "run", "--config", str(tmp_path / "caddy.json")], env=env,
                                         stdout=log, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + 30
            while caddy.poll() is None:  # a child's readiness is not awaitable: poll its port until the deadline
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "caddy did not listen"
                    time.sleep(0.05)
            if caddy.poll() is None:
                break
        assert caddy.poll() is None, (tmp_path / "caddy.log").read_text()

        def request(path: str) -> int:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            try:
                conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)  # the path as written
                conn.putheader("Host", "pdserve.test")
                conn.endheaders()
                return conn.getresponse().status
            finally:
                conn.close()

        for path in PRIVATE_PATHS:
            received.clear()
            status = request(path)
            assert status in (400, 404) and received == [], (path, status, received)
        for path in CLIENT_PATHS:
            received.clear()
            assert request(path) == 200 and received == [path], (path, received)
    finally:
        if caddy is not None:
            caddy.terminate()
            caddy.wait(timeout=10)
        upstream.shutdown()
        upstream.server_close()


def test_multi_host_workers_listen_on_the_host_address_only(rendered):
    for profiles in profile_sets("workers"):
        services = rendered["workers", profiles]["services"]
        for service in WORKER_SERVICES:
            env = services[service]["environment"]
            assert env["PDSERVE_HOST"] == env["PDSERVE_ADVERTISE_HOST"] == "10.0.0.2", (service, env.get("PDSERVE_HOST"))
            assert not env.get("PDSERVE_KV_HOST")  # KV binds --host too
        if "dcgm-exporter" in services:
            assert services["dcgm-exporter"]["command"] == ["-a", "10.0.0.2:9400"]


def test_the_metrics_proxy_answers_only_prometheus(rendered, env_files, tmp_path):
    prometheus_config = yaml.safe_load((COMPOSE / "monitoring" / "prometheus.yml").read_text())
    token_file = None
    for (stack, profiles), doc in rendered.items():
        if "metrics-sd" not in doc["services"]:
            continue
        services = doc["services"]
        token = env_values(env_files, stack)["PDSERVE_METRICS_TOKEN"]
        assert services["metrics-sd"]["environment"]["PDSERVE_METRICS_TOKEN"] == token
        assert services["prometheus"]["environment"]["PDSERVE_METRICS_TOKEN"] == token
        script = " ".join(services["prometheus"]["entrypoint"])
        token_file = re.search(r"> (/\S+) && exec", script).group(1)
        assert token not in script  # in a file, not on the command line
    assert token_file
    for job in prometheus_config["scrape_configs"]:
        for sd in job.get("http_sd_configs", []):
            if "metrics-sd" in sd["url"]:
                assert sd["authorization"]["credentials_file"] == token_file, job["job_name"]
        if any(sd["url"].endswith("/targets/workers") for sd in job.get("http_sd_configs", [])):
            assert job["authorization"]["credentials_file"] == token_file  # the relayed scrapes too
        if job["job_name"] == "dcgm":
            assert "authorization" not in job  # the exporters themselves get no token


@pytest.mark.skipif(shutil.which("sh") is None, reason="needs /bin/sh")
def test_prometheus_refuses_a_short_metrics_token_and_keeps_it_off_its_command_line(env_files, tmp_path):
    prometheus = load_stack("gpu", env_values(env_files, "gpu"), ("monitoring",))["services"]["prometheus"]
    fake = stand_in(tmp_path / "bin", "prometheus")
    paths = {"/bin/prometheus": str(fake), "/tmp/metrics-token": str(tmp_path / "token")}
    token = prometheus["environment"]["PDSERVE_METRICS_TOKEN"]
    ran = run_service_script(prometheus, {"PDSERVE_METRICS_TOKEN": token}, tmp_path / "bin", paths)
    assert ran.returncode == 0 and "prometheus ran: --config.file=" in ran.stdout and token not in ran.stdout
    assert (tmp_path / "token").read_text() == token
    assert oct((tmp_path / "token").stat().st_mode & 0o777) == "0o600"
    for weak in ("", "short"):
        refused = run_service_script(prometheus, {"PDSERVE_METRICS_TOKEN": weak}, tmp_path / "bin", paths)
        assert refused.returncode == 78 and "set PDSERVE_METRICS_TOKEN" in refused.stderr


def test_each_service_gets_only_the_secrets_it_uses(rendered):
    """Workers take no admin token (the gateway signs its admin calls) and no API key; the metrics
    proxy's token goes to it and Prometheus only; the TLS front holds no secret of the gateway."""
    uses = {"gateway": {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_API_KEY", "REDIS_URL"},
            "prefill": {"PDSERVE_CLUSTER_SECRET", "REDIS_URL"}, "decode": {"PDSERVE_CLUSTER_SECRET", "REDIS_URL"},
            "metrics-sd": {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_METRICS_TOKEN"},
            "prometheus": {"PDSERVE_METRICS_TOKEN"}, "tls": set(), "grafana": set(), "dcgm-exporter": set(),
            "redis": {"REDIS_PASSWORD", "REDISCLI_AUTH"}}
    secrets = {"PDSERVE_CLUSTER_SECRET", "PDSERVE_ADMIN_TOKEN", "PDSERVE_API_KEY", "PDSERVE_METRICS_TOKEN", "REDIS_URL",
               "REDIS_PASSWORD", "REDISCLI_AUTH"}
    for (stack, profiles), doc in rendered.items():
        for service, spec in doc["services"].items():
            given = set(spec.get("environment") or {}) & secrets
            assert given <= uses[service], (stack, service, sorted(given - uses[service]))
