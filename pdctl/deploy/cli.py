"""The deployment subcommands of ``pdctl``: gen-secrets, rollout, scale, metrics-proxy.

    pdctl gen-secrets [--stack S] [--env-file F] [--from F] [--set K=V]   write a compose env file (0600)
    pdctl gen-secrets --k8s FILE [--namespace NS]                        write a Kubernetes Secret (0600)
    pdctl rollout [--service S] [--k8s]             replace workers one at a time, each drained first
    pdctl scale --prefill N --decode M [--run] [--k8s]   plan (or apply) a resize that drains what it removes
    pdctl metrics-proxy --listen HOST:PORT          Prometheus discovery + signed relay of worker /metrics

Compose commands take the env file (``--env-file``, default ``compose/.env``): its
COMPOSE_PROJECT_NAME and PDSERVE_STACK say which project and files to use (``-p`` is passed
explicitly too, whatever the compose version).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys

from common.cluster.auth import AuthError, configure_auth, is_loopback, read_secret
from common.cluster.flags import EnvFlags, secret_value
from common.cluster.secret_sources import check_distinct, check_secret
from pdctl.deploy.backends import SERVICES, ComposeBackend
from pdctl.deploy.env_file import STACK_KEY, STACKS, build_env, read_env_file, write_env_file, write_private_file
from pdctl.deploy.k8s_secret import SECRET_NAME, secret_manifest
from pdctl.deploy.rollout import OperationError, Operator


def scale_command(prefill: int, decode: int, compose_file: str, compose: str = "docker compose",
                  env_file: str | None = None, project: str | None = None) -> list[str]:
    """The plain compose command that runs ``prefill`` prefill and ``decode`` decode workers
    (``pdctl scale`` drains and removes chosen replicas first when scaling down)."""
    if prefill < 0 or decode < 0 or prefill + decode < 1:
        raise ValueError(f"need at least one worker, got --prefill {prefill} --decode {decode}")
    cmd = shlex.split(compose)
    if project:
        cmd += ["-p", project]
    if env_file:
        cmd += ["--env-file", env_file]
    cmd += ["-f", compose_file]
    return cmd + ["up", "-d", "--no-recreate", "--scale", f"prefill={prefill}", "--scale", f"decode={decode}"]


def compose_backend(args) -> ComposeBackend:
    values = read_env_file(args.env_file) if os.path.exists(args.env_file) else {}
    project = args.project or values.get("COMPOSE_PROJECT_NAME")
    stack = values.get(STACK_KEY, "gpu")
    files = args.file or STACKS.get(stack, STACKS["gpu"])[1]
    if not project:
        raise ValueError(f"no compose project: {args.env_file} has no COMPOSE_PROJECT_NAME (pdctl gen-secrets "
                         f"writes one) and --project was not given")
    return ComposeBackend(project, files, args.env_file if values else None, args.compose)


K8S_OVERLAYS = {"cpu": "CPU nodes", "gpu": "GPU nodes"}  # k8s/overlays/<name>


def k8s_next_steps(path, namespace: str | None) -> list[str]:
    """What to run after writing the Secret: it and an overlay, in the Secret's namespace."""
    ns = f"-n {shlex.quote(namespace)} " if namespace else ""
    where = f"namespace {namespace}" if namespace else "kubectl's current namespace (pass --namespace to choose)"
    lines = [f"wrote {path} (mode 0600): the Secret {SECRET_NAME}, for {where}; apply it, then one overlay of k8s/:",
             f"  kubectl apply {ns}-f {shlex.quote(str(path))}"]
    lines += [f"  kubectl apply {ns}-k k8s/overlays/{name}    # {what}" for name, what in K8S_OVERLAYS.items()]
    return lines


def cmd_gen_secrets(_client, args) -> int:
    settings = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        settings[key] = value
    shared = read_env_file(args.from_file) if args.from_file else None
    values = build_env(args.stack, shared, settings)
    try:
        if args.k8s:
            path = write_private_file(args.k8s, secret_manifest(values, args.namespace), force=args.force)
            for line in k8s_next_steps(path, args.namespace):
                print(line)
            return 0
        path = write_env_file(args.env_file, values, force=args.force)
    except FileExistsError as exc:
        print(f"pdctl: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {path} (mode 0600, project {STACKS[args.stack][0]}); pass it to every compose command:")
    files = " ".join(f"-f {f}" for f in STACKS[args.stack][1])
    print(f"  docker compose --env-file {path} {files} up -d")
    return 0


def operator(client, args) -> Operator:
    # Polling a compose project runs `docker ps` and a `docker exec` per container (kubectl: an API
    # call per poll): every 2 s is plenty.
    if args.k8s:
        from pdctl.deploy.k8s_backend import KubernetesBackend

        backend = KubernetesBackend(args.namespace, args.kubectl)
    else:
        backend = compose_backend(args)
    return Operator(client, backend, drain_timeout=args.drain_timeout, ready_timeout=args.ready_timeout,
                    stop_grace_s=args.stop_grace, poll_s=2.0)


def cmd_rollout(client, args) -> int:
    try:
        op = operator(client, args)
        for old, new in op.rollout(args.service or list(SERVICES), allow_outage=args.allow_outage):
            print(f"replaced {old.name} ({old.worker_id}) by {new.name} ({new.worker_id})")
    except OperationError as exc:
        print(f"pdctl: rollout stopped: {exc}", file=sys.stderr)
        return 1
    return 0


# The compose variables that give each pool's GPUs per worker (tensor-parallel size; unset: 1).
TP_VARIABLES = {"prefill": "PDSERVE_PREFILL_TP", "decode": "PDSERVE_DECODE_TP"}


def gpus_per_worker(env_file: str | None) -> dict[str, int]:
    """Each pool's tensor-parallel size as compose resolves it: the shell's variable, else the env file's."""
    values = read_env_file(env_file) if env_file and os.path.exists(env_file) else {}
    sizes = {}
    for service, name in TP_VARIABLES.items():
        text = os.environ.get(name) or values.get(name) or "1"
        if not text.strip().isdigit() or int(text) < 1:
            raise ValueError(f"{name}={text!r}: expected a whole number of GPUs per {service} worker (>= 1)")
        sizes[service] = int(text)
    return sizes


def cmd_scale(client, args) -> int:
    if args.gpus is not None:
        tp = gpus_per_worker(args.env_file)
        need = args.prefill * tp["prefill"] + args.decode * tp["decode"]
        if need > args.gpus:
            raise ValueError(f"--prefill {args.prefill} x {tp['prefill']} GPU(s) + --decode {args.decode} x "
                             f"{tp['decode']} GPU(s) (PDSERVE_PREFILL_TP, PDSERVE_DECODE_TP) = {need} GPUs, more than "
                             f"the {args.gpus} this host has")
    if args.prefill + args.decode < 1:
        raise ValueError(f"need at least one worker, got --prefill {args.prefill} --decode {args.decode}")
    if args.decode < 1 and not args.allow_outage:  # (prefill workers compute prompts; decode workers answer)
        raise ValueError("--decode 0 leaves no worker to generate: every request would fail (pass --allow-outage "
                         "to do it anyway)")
    op = operator(client, args)
    try:
        plan = op.plan_scale({"prefill": args.prefill, "decode": args.decode})
        for line in plan.describe(op.entries()):
            print(line)
        if not args.run:
            print("dry run: add --run to drain and remove exactly these replicas, then scale")
            return 0
        op.scale(plan)
    except OperationError as exc:
        print(f"pdctl: scale stopped: {exc}", file=sys.stderr)
        return 1
    return 0


def metrics_proxy_token(args, listen_host: str, others: dict[str, str | None]) -> str | None:
    """The scrapers' bearer token: strong, unlike the ``others`` secrets, and required unless only
    this machine can reach the proxy.  Raises ValueError saying what to set."""
    token = secret_value(args, "metrics_token", "the metrics token")
    check_secret(token, "the metrics token (PDSERVE_METRICS_TOKEN)")
    if token is None and not is_loopback(listen_host):
        raise ValueError(f"metrics-proxy listens on {listen_host}, which other machines can reach, but has no scrape "
                         f"token: set PDSERVE_METRICS_TOKEN (or --metrics-token-file; pdctl gen-secrets makes one) "
                         f"and give Prometheus the same value, or listen on 127.0.0.1")
    check_distinct({**others, "the metrics token": token})
    return token


def cmd_metrics_proxy(client, args) -> int:
    from pdctl.deploy.metrics_proxy import MetricsProxy, serve

    host, _, port = args.listen.rpartition(":")
    host = host or "0.0.0.0"
    try:
        secret = read_secret(args.cluster_secret_file)
        auth = configure_auth(secret, [], "metrics-proxy")  # refuses a weak cluster secret
    except AuthError as exc:
        raise ValueError(str(exc)) from None
    token = metrics_proxy_token(args, host.strip("[]"), {"the cluster secret": secret, "the admin token": client.token})
    proxy = MetricsProxy(args.url, client.token, auth, args.public_address or f"metrics-sd:{port}", args.dcgm_targets,
                         scrape_token=token)
    serve(proxy, host, int(port))
    return 0


def _compose_options(s: argparse.ArgumentParser) -> None:
    env = os.environ.get
    s.add_argument("--env-file", default=env("PDSERVE_ENV_FILE", "compose/.env"),
                   help="the file set's env file (project name, stack, secrets)")
    s.add_argument("--file", "-f", action="append", default=None, help="compose file(s) (default: from the stack)")
    s.add_argument("--project", "-p", default=None, help="compose project (default: the env file's)")
    s.add_argument("--compose", default=env("PDSERVE_COMPOSE", "docker compose"), help="e.g. docker-compose")
    s.add_argument("--drain-timeout", type=float, default=600.0, help="seconds a worker may take to drain")
    s.add_argument("--ready-timeout", type=float, default=900.0, help="seconds a new worker may take to serve")
    s.add_argument("--stop-grace", type=float, default=150.0, help="docker stop --time for a drained worker "
                   "(--k8s: how long to wait for its pod to go)")
    s.add_argument("--k8s", action="store_true", help="the workers are pods of the k8s/ Deployments (kubectl), "
                   "not compose containers")
    s.add_argument("--namespace", default=None, help="--k8s: the namespace (default: kubectl's)")
    s.add_argument("--kubectl", default=env("PDSERVE_KUBECTL", "kubectl"), help="--k8s: the kubectl command")


def add_commands(sub) -> None:
    """Register the deployment subcommands on pdctl's subparsers."""
    s = sub.add_parser("gen-secrets", help="write a compose env file with fresh secrets (mode 0600)")
    s.add_argument("--stack", choices=sorted(STACKS), default="gpu", help="the file set (names the project)")
    s.add_argument("--env-file", default="compose/.env")
    s.add_argument("--from", dest="from_file", default=None, help="copy the shared secrets from this env file")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a host setting (repeatable)")
    s.add_argument("--force", action="store_true", help="replace an existing file (and its secrets)")
    s.add_argument("--k8s", metavar="FILE", default=None,
                   help="write a Kubernetes Secret manifest (k8s/) to FILE instead of a compose env file")
    s.add_argument("--namespace", default=None, help="--k8s: the Secret's namespace (default: kubectl's)")
    s.set_defaults(func=cmd_gen_secrets)

    s = sub.add_parser("rollout", help="replace workers one at a time: drain, recreate, wait healthy+registered")
    _compose_options(s)
    s.add_argument("--service", action="append", choices=SERVICES, help="only this service (repeatable)")
    s.add_argument("--allow-outage", action="store_true", help="also replace a pool's only worker")
    s.set_defaults(func=cmd_rollout)

    s = sub.add_parser("scale", help="resize the worker services; scale-down drains exactly what it removes")
    s.add_argument("--prefill", type=int, required=True)
    s.add_argument("--decode", type=int, required=True)
    s.add_argument("--gpus", type=int, default=None,
                   help="GPUs on the host: refuse workers needing more (each takes its pool's PDSERVE_*_TP GPUs)")
    s.add_argument("--run", action="store_true", help="do it (default: print the plan)")
    s.add_argument("--allow-outage", action="store_true", help="also scale the decode pool to 0")
    _compose_options(s)
    s.set_defaults(func=cmd_scale)

    s = sub.add_parser("metrics-proxy", help="Prometheus HTTP SD from the registry + signed relay of worker /metrics")
    flags = EnvFlags(s)  # every flag also reads PDSERVE_<FLAG> (the compose service sets the token so)
    flags.add("--listen", "0.0.0.0:9401", help="HOST:PORT")
    flags.add("--public-address", help="how Prometheus reaches this proxy (default metrics-sd:PORT)")
    flags.add("--dcgm-targets", "", help="host:port,... or workers:PORT (every host running workers)")
    flags.add_secret("--metrics-token", "the metrics token",
                     help="bearer token Prometheus presents (required unless --listen is a loopback address)")
    flags.add("--cluster-secret-file", help="file holding the cluster secret (default: PDSERVE_CLUSTER_SECRET)")
    s.set_defaults(func=cmd_metrics_proxy)
