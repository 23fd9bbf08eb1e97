"""The Kubernetes manifests (deploy/k8s) as a cluster would take them, checked offline.

Every manifest against the Kubernetes API's own schemas (kubernetes-validate, strict: an unknown field is
an error), the kustomize output rendered by `kubectl kustomize` where kubectl is installed, the references
between the manifests, the commands the pods run (parsed by streamgrpo's own parser, their config loaded),
and what Prometheus scrapes there: its relabelling applied to every pod's ports gives the `job` labels the
alert rules and the dashboard select, and the NetworkPolicies let it reach each of those ports. The
generators' shards after `kubectl scale`, the evaluator, the model cache volume, the images set in one
place, no Secret in the manifests, docs/deploy.md.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from streamgrpo.commands import k8s_generator
from tests.paths import REPO
from tests.unit.repo.test_deploy import (
    DASHBOARD,
    DS_DIR,
    PROM_DIR,
    assert_parses,
    dashboard_exprs,
    exported_names,
    metric_names,
    promtool,
    rule_exprs,
    streamgrpo_argv,
)

K8S_DIR = REPO / "deploy" / "k8s"
KUSTOMIZATION = K8S_DIR / "kustomization.yaml"
DEPLOY_MD = REPO / "docs" / "deploy.md"
MIN_K8S = "1.28"  # the pod-index label, NetworkPolicy endPort (docs/deploy.md)
STREAMGRPO_IMAGES = ("streamgrpo-learner", "streamgrpo-generator")


# ===================================================================================== helpers
def manifest_files() -> list[Path]:
    """The files `kubectl apply -k deploy/k8s` applies (kustomization.yaml's resources; every yaml file of
    deploy/k8s when there is no kustomization)."""
    if KUSTOMIZATION.exists():
        return [K8S_DIR / r for r in yaml.safe_load(KUSTOMIZATION.read_text())["resources"]]
    return sorted(K8S_DIR.glob("*.yaml"))


def k8s_docs() -> list[tuple[str, dict]]:
    out = []
    for f in manifest_files():
        for doc in yaml.safe_load_all(f.read_text()):
            if doc:
                out.append((f.name, doc))
    return out


def by_kind(docs) -> dict[str, dict[str, dict]]:
    out: dict[str, dict[str, dict]] = {}
    for _, d in docs:
        out.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    return out


def _pod_specs(docs):
    for fname, d in docs:
        if d["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            yield fname, d, d["spec"]["template"]["spec"]


def pod_labels(d: dict, ordinal: int = 0) -> dict[str, str]:
    """The labels of one pod of a workload as Kubernetes sets them (StatefulSet pods: pod name and index)."""
    labels = dict(d["spec"]["template"]["metadata"]["labels"])
    if d["kind"] == "StatefulSet":
        labels["statefulset.kubernetes.io/pod-name"] = f"{d['metadata']['name']}-{ordinal}"
        labels["apps.kubernetes.io/pod-index"] = str(ordinal)
    return labels


def component(d: dict) -> str:
    return d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component", "")


def _expand_k8s_vars(arg: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def pod_env(c: dict, d: dict, ordinal: int) -> dict[str, str]:
    """A container's environment with the downward API resolved for pod ``ordinal`` (secrets as '0')."""
    labels = pod_labels(d, ordinal)
    env = {}
    for e in c.get("env", []):
        ref = (e.get("valueFrom") or {}).get("fieldRef", {}).get("fieldPath", "")
        if ref == "metadata.name":
            env[e["name"]] = f"{d['metadata']['name']}-{ordinal}"
        elif ref.startswith("metadata.labels["):
            env[e["name"]] = labels.get(ref[len("metadata.labels['"):-2], "")
        else:
            env[e["name"]] = e.get("value", "0")
    return env


def pod_streamgrpo_argv(c: dict, d: dict, ordinal: int = 0, replicas: int | None = None) -> list[str]:
    """The streamgrpo argv pod ``ordinal`` of ``d`` runs when the workload has ``replicas`` (its own when None):
    through streamgrpo.commands.k8s_generator (which reads the replicas from the API) when that is the command."""
    replicas = d["spec"].get("replicas", 1) if replicas is None else replicas
    env = pod_env(c, d, ordinal)
    argv = [_expand_k8s_vars(a, env) for a in c.get("command", []) + c.get("args", [])]
    if argv[1:3] == ["-m", "streamgrpo.commands.k8s_generator"]:
        _opts, rest = k8s_generator.build_parser().parse_known_args(argv[3:])
        name, got = k8s_generator.pod_identity(env["POD_NAME"])
        assert (name, got) == (d["metadata"]["name"], ordinal)
        return k8s_generator.generator_argv(rest, got, replicas)
    return streamgrpo_argv(argv)


def streamgrpo_containers(docs):
    for fname, d, spec in _pod_specs(docs):
        for c in spec["containers"]:
            if c["image"].split(":")[0] in STREAMGRPO_IMAGES:
                yield fname, d, spec, c


def selector_matches(selector: dict, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels, matchExpressions; {} selects everything)."""
    if not all(labels.get(k) == v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def ingress_allowed(docs, src: dict[str, str], dst: dict[str, str], port: int, port_name: str) -> bool:
    """Whether the NetworkPolicies let a pod labelled ``src`` open TCP ``port`` (named ``port_name``) on a pod
    labelled ``dst`` in the same namespace: allowed when no policy selects ``dst`` for ingress, else when a rule
    of one of them allows it (a port, a port range with endPort, or the port's name)."""
    policies = [d for _, d in docs if d["kind"] == "NetworkPolicy" and selector_matches(d["spec"]["podSelector"], dst)
                and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])]
    if not policies:
        return True
    for p in policies:
        for rule in p["spec"].get("ingress") or []:
            peers = rule.get("from")
            from_ok = not peers or any("podSelector" in peer and selector_matches(peer["podSelector"], src)
                                       for peer in peers)
            ports = rule.get("ports")
            port_ok = not ports or any(
                pp.get("protocol", "TCP") == "TCP"
                and (pp.get("port") is None or pp["port"] == port_name or pp["port"] == port
                     or (isinstance(pp["port"], int) and pp.get("endPort") and pp["port"] <= port <= pp["endPort"]))
                for pp in ports)
            if from_ok and port_ok:
                return True
    return False


def _relabel(labels: dict[str, str], configs: list[dict]) -> dict[str, str] | None:
    """Prometheus' relabel_configs (keep, drop, replace) over a target's labels; None: dropped."""
    labels = dict(labels)
    for rc in configs:
        action = rc.get("action", "replace")
        value = rc.get("separator", ";").join(labels.get(s, "") for s in rc.get("source_labels", []))
        m = re.fullmatch(rc.get("regex", "(.*)"), value)
        if action == "keep" and not m:
            return None
        if action == "drop" and m:
            return None
        if action == "replace" and m:
            template = re.sub(r"\$\{?(\d+)\}?", r"\\g<\1>", rc.get("replacement", "$1"))  # $1 -> \g<1>
            labels[rc["target_label"]] = m.expand(template)
        assert action in ("keep", "drop", "replace"), f"relabel action {action} not simulated here"
    return labels


def prometheus_config(docs) -> dict:
    cm = by_kind(docs)["ConfigMap"]["streamgrpo-prometheus"]
    return yaml.safe_load(cm["data"]["prometheus.yml"])


def scrape_targets(docs) -> list[tuple[str, dict, dict[str, str], dict]]:
    """What the in-cluster Prometheus scrapes: (job, workload, pod labels, container port) for every port of
    every pod its Kubernetes discovery finds, after its relabel_configs, for pods 0 and 1 of each workload."""
    out = []
    for job in prometheus_config(docs)["scrape_configs"]:
        for sd in job.get("kubernetes_sd_configs", []):
            assert sd["role"] == "pod" and sd["namespaces"]["names"] == ["streamgrpo"]
            wanted = [s["label"].split("=", 1) for s in sd.get("selectors", []) if "label" in s]
            for _, d, spec in _pod_specs(docs):
                for ordinal in range(min(2, d["spec"].get("replicas", 1))):
                    labels = pod_labels(d, ordinal)
                    if not all(labels.get(k) == v for k, v in wanted):
                        continue
                    for c in spec["containers"]:
                        for p in c.get("ports", []):
                            meta = {f"__meta_kubernetes_pod_label_{re.sub(r'[^A-Za-z0-9_]', '_', k)}": v
                                    for k, v in labels.items()}
                            meta.update({"job": job["job_name"], "__address__": f"10.0.0.{ordinal + 1}:{p['containerPort']}",
                                         "__meta_kubernetes_pod_name": f"{d['metadata']['name']}-{ordinal}",
                                         "__meta_kubernetes_pod_container_port_name": p.get("name", ""),
                                         "__meta_kubernetes_pod_container_port_number": str(p["containerPort"])})
                            target = _relabel(meta, job.get("relabel_configs", []))
                            if target is not None:
                                out.append((target["job"], d, labels, p))
    return out


def selected_jobs(exprs) -> set[str]:
    """The `job` values PromQL expressions select (job="x", job=~"a|b")."""
    jobs = set()
    for _, expr in exprs:
        for op, value in re.findall(r'\bjob\s*(=~|=)\s*"([^"]*)"', expr):
            jobs |= set(value.split("|")) if op == "=~" else {value}
    return jobs


def docs_secrets() -> dict[str, set[str]]:
    """The Secrets docs/deploy.md tells the user to create: name -> keys (``kubectl create secret generic``)."""
    out: dict[str, set[str]] = {}
    text = DEPLOY_MD.read_text() if DEPLOY_MD.exists() else ""
    for m in re.finditer(r"kubectl -n streamgrpo create secret generic (\S+)((?: +--from-literal=[A-Za-z0-9_.-]+=\S+)+)",
                         text):
        out[m.group(1)] = set(re.findall(r"--from-literal=([A-Za-z0-9_.-]+)=", m.group(2)))
    return out


def config_file(tmp_path, docs) -> Path:
    path = tmp_path / "config.yaml"  # as the pods see it: a file with ${REDIS_PASSWORD} from the Secret
    path.write_text(by_kind(docs)["ConfigMap"]["streamgrpo-config"]["data"]["config.yaml"])
    return path


# ================================================================================ schema validation
def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    """kubernetes-validate's bundled schemas (offline), strict: on the oldest Kubernetes the docs allow and the newest."""
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')")
    docs = k8s_docs()
    assert len(docs) >= 20
    for version in (MIN_K8S, kv.latest_version()):
        for fname, d in docs:
            try:
                kv.validate(d, version, strict=True)
            except kv.ValidationError as exc:
                raise AssertionError(f"{fname} {d['kind']}/{d['metadata']['name']} on Kubernetes {version}: "
                                     f"{exc.message} at {'/'.join(map(str, exc.path))}") from None
    with pytest.raises(kv.ValidationError):  # the validator does refuse: a misspelt field (strict)
        kv.validate({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
                     "spec": {"ports": [{"port": 1, "portt": 2}]}}, MIN_K8S, strict=True)


def test_kustomize_renders_and_the_output_validates():
    """`kubectl kustomize deploy/k8s` (what `kubectl apply -k` applies): every object validates and every
    streamgrpo image is the one kustomization.yaml names."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the kustomize output is not rendered (each file is validated)")
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install -e '.[dev]')")
    out = subprocess.run([kubectl, "kustomize", str(K8S_DIR)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert sorted((d["kind"], d["metadata"]["name"]) for d in rendered) == sorted(
        (d["kind"], d["metadata"]["name"]) for _, d in k8s_docs())
    images = {i["name"]: f"{i['newName']}:{i['newTag']}" for i in yaml.safe_load(KUSTOMIZATION.read_text())["images"]}
    seen = set()
    for d in rendered:
        kv.validate(d, MIN_K8S, strict=True)
        if d["kind"] in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                assert not c["image"].startswith("streamgrpo-"), f"{d['metadata']['name']}: {c['image']} not rewritten"
                seen |= {name for name, image in images.items() if c["image"] == image}
    assert seen == set(STREAMGRPO_IMAGES)


# ============================================================================ the defects of issue 61
def test_images_are_set_in_one_place():
    """kustomization.yaml's `images:` names each streamgrpo image (a registry, a tag that is not latest);
    the manifests name them bare, so nothing else is to edit."""
    assert KUSTOMIZATION.exists(), "deploy/k8s/kustomization.yaml: the one place the images are set"
    kust = yaml.safe_load(KUSTOMIZATION.read_text())
    listed = {Path(r).name for r in kust["resources"]}
    assert listed == {p.name for p in K8S_DIR.glob("*.yaml")} - {"kustomization.yaml"}, "every manifest applied"
    images = {i["name"]: i for i in kust["images"]}
    assert set(images) == set(STREAMGRPO_IMAGES)
    for name, i in images.items():
        assert "/" in i["newName"] and i["newName"].endswith("/" + name), i
        assert i["newTag"] and i["newTag"] != "latest", i
    used = {c["image"] for _, _, _, c in streamgrpo_containers(k8s_docs())}
    assert used == set(STREAMGRPO_IMAGES), f"bare names, no tag (kustomize sets it): {used}"
    text = DEPLOY_MD.read_text() if DEPLOY_MD.exists() else ""
    assert "kubectl apply -k deploy/k8s" in text and "kustomize edit set image" in text


def test_no_secret_in_the_manifests_and_the_docs_create_it():
    """Applying never overwrites the password the user made: no manifest carries a Secret, and docs/deploy.md
    creates every Secret a pod reads, with the keys the pods read, before `kubectl apply -k`."""
    docs = k8s_docs()
    assert "Secret" not in by_kind(docs), "a Secret in the manifests overwrites the one the user created"
    created = docs_secrets()
    for _, d, spec in _pod_specs(docs):
        for c in spec["containers"]:
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in created.get(ref["name"], set()), \
                        f"{d['metadata']['name']} reads Secret {ref['name']}/{ref['key']}, which docs/deploy.md does not create"
    text = DEPLOY_MD.read_text()
    assert text.index("create secret generic streamgrpo-redis") < text.index("\nkubectl apply -k deploy/k8s\n"), \
        "the Secret is created before the command that applies the manifests"


def test_prometheus_reaches_every_port_it_scrapes():
    """Every target of the k8s scrape config (each learner rank's port: metrics.port + local rank, for the ranks
    a pod runs) is open to the Prometheus pod under the NetworkPolicies."""
    docs = k8s_docs()
    prom = next(d for _, d, _ in _pod_specs(docs) if component(d) == "prometheus")
    targets = scrape_targets(docs)
    learner = by_kind(docs)["StatefulSet"]["streamgrpo-learner"]
    c = learner["spec"]["template"]["spec"]["containers"][0]
    ranks = int(pod_env(c, learner, 0)["NPROC_PER_NODE"])
    learner_ports = sorted({p["containerPort"] for job, d, _, p in targets if job == "learner"})
    assert learner_ports == [9100 + r for r in range(ranks)], "one target per local rank"
    for job, d, labels, p in targets:
        assert ingress_allowed(docs, pod_labels(prom), labels, p["containerPort"], p["name"]), \
            f"NetworkPolicy: Prometheus cannot reach {d['metadata']['name']}:{p['containerPort']} ({job})"
    # the check itself: a port no rule opens is refused
    assert not ingress_allowed(docs, pod_labels(prom), pod_labels(learner), 5555, "weights-pub")


def test_deploy_md_exists_and_is_linked():
    """Every docs/ file the manifests name exists; docs/cluster.md's Kubernetes part and the README link docs/deploy.md."""
    for f in sorted(K8S_DIR.glob("*.yaml")):
        for ref in re.findall(r"docs/[A-Za-z0-9_.-]+\.md", f.read_text()):
            assert (REPO / ref).is_file(), f"{f.name} names {ref}, which does not exist"
    assert DEPLOY_MD.is_file()
    cluster = (REPO / "docs" / "cluster.md").read_text()
    k8s_part = cluster[cluster.index("## Kubernetes"):]
    assert "(deploy.md)" in k8s_part.split("\n## ")[0], "docs/cluster.md's Kubernetes part links deploy.md"
    assert "docs/deploy.md" in (REPO / "README.md").read_text()
    text = DEPLOY_MD.read_text()
    for needle in ("kubectl apply -k deploy/k8s", "create secret generic", "storageClassName", "ReadWriteMany",
                   "scale statefulset/streamgrpo-generator", "streamgrpo-evaluator", "eval.jsonl", "HF_HOME",
                   "streamgrpo-prometheus", "deploy/grafana/dashboards/streamgrpo.json"):
        assert needle in text, f"docs/deploy.md says nothing of {needle!r}"


@pytest.mark.parametrize("replicas", [4, 6, 2])
def test_scaled_generators_each_run_their_own_shard(tmp_path, monkeypatch, replicas):
    """`kubectl scale statefulset/streamgrpo-generator --replicas=N`, nothing else edited: pod K runs shard K of
    N, which the generator accepts, and together the pods cover the N shards once; the pods may read their
    StatefulSet's replicas through the API."""
    from streamgrpo.config import load_config

    docs = k8s_docs()
    path = config_file(tmp_path, docs)
    monkeypatch.setenv("REDIS_PASSWORD", "0123abcd")
    gen = by_kind(docs)["StatefulSet"]["streamgrpo-generator"]
    c = gen["spec"]["template"]["spec"]["containers"][0]
    shards = []
    for ordinal in range(replicas):
        argv = pod_streamgrpo_argv(c, gen, ordinal, replicas)
        args = assert_parses(argv, f"generator pod {ordinal}")
        cfg = load_config(path, args.overrides)
        assert 0 <= args.id < cfg.rollout.num_generators, \
            f"pod {ordinal} of {replicas}: --id {args.id} is outside 0..{cfg.rollout.num_generators - 1}"
        shards.append((args.id, cfg.rollout.num_generators))
    assert shards == [(k, replicas) for k in range(replicas)]
    # RBAC: the pods' service account may get this StatefulSet (and nothing more)
    kinds = by_kind(docs)
    sa = gen["spec"]["template"]["spec"].get("serviceAccountName")
    assert sa in kinds.get("ServiceAccount", {}), "the generator pods need a service account to read their replicas"
    roles = [kinds["Role"][rb["roleRef"]["name"]] for rb in kinds.get("RoleBinding", {}).values()
             if any(s["kind"] == "ServiceAccount" and s["name"] == sa for s in rb["subjects"])]
    rules = [r for role in roles for r in role["rules"]]
    assert any("apps" in r["apiGroups"] and "statefulsets" in r["resources"] and "get" in r["verbs"]
               and gen["metadata"]["name"] in r.get("resourceNames", []) for r in rules)
    assert all(set(r["verbs"]) <= {"get"} for r in rules), "the generators' service account only reads"
    env = pod_env(c, gen, 3)
    assert k8s_generator.pod_identity(env["POD_NAME"]) == (gen["metadata"]["name"], 3)
    # the generator image has this `python` first on PATH (its virtual environment)
    assert "PATH=/opt/venv/bin:$PATH" in (REPO / "services" / "generator" / "Dockerfile").read_text()


def test_evaluator_gets_weights_over_tcp_and_writes_eval_jsonl(tmp_path, monkeypatch):
    """An evaluator pod: `streamgrpo evaluator` on one GPU, its held-out set on the data volume, the weights
    from the learner's Service over TCP (another pod: no ipc/shm), open to it under the NetworkPolicies, and
    <run_dir>/eval.jsonl on the runs volume that every node can mount."""
    from streamgrpo.config import load_config
    from streamgrpo.transport.weights.factory import ipc_dir_of

    docs = k8s_docs()
    kinds = by_kind(docs)
    path = config_file(tmp_path, docs)
    evaluators = [(d, c) for _, d, _, c in streamgrpo_containers(docs)
                  if assert_parses(pod_streamgrpo_argv(c, d), d["metadata"]["name"]).command == "evaluator"]
    assert len(evaluators) == 1, "no evaluator manifest"
    d, c = evaluators[0]
    assert d["spec"].get("replicas", 1) == 1 and c["resources"]["limits"]["nvidia.com/gpu"] == 1
    args = assert_parses(pod_streamgrpo_argv(c, d), "evaluator")
    cfg = load_config(path, args.overrides)
    w = cfg.weights
    assert w.transport == "tcp" and not w.relay and ipc_dir_of(w, cfg.run_dir) is None
    weights_svc = kinds["Service"][w.connect_host]
    learner = kinds["StatefulSet"]["streamgrpo-learner"]
    assert selector_matches({"matchLabels": weights_svc["spec"]["selector"]}, pod_labels(learner, 0))
    svc_ports = {p["port"] for p in weights_svc["spec"]["ports"]}
    assert {w.pub_port, w.snapshot_port} <= svc_ports
    lc = learner["spec"]["template"]["spec"]["containers"][0]
    named = {p["containerPort"]: p["name"] for p in lc["ports"]}
    for port in (w.pub_port, w.snapshot_port):
        assert ingress_allowed(docs, pod_labels(d), pod_labels(learner, 0), port, named[port]), \
            f"NetworkPolicy: the evaluator cannot reach the learner's weight port {port}"
    assert cfg.data.eval_path and Path(cfg.data.eval_path).is_relative_to(_mount_of(d, c, "streamgrpo-data"))
    runs = _mount_of(d, c, "streamgrpo-runs")
    assert Path(cfg.run_dir).is_relative_to(runs), "eval.jsonl goes to <run_dir>, on the runs volume"
    assert "ReadWriteMany" in kinds["PersistentVolumeClaim"]["streamgrpo-runs"]["spec"]["accessModes"], \
        "the learner and the evaluator mount the runs volume from different nodes"
    assert ("evaluator", d) in [(job, t) for job, t, _, _ in scrape_targets(docs)], "Prometheus scrapes the evaluator"


def _mount_of(d: dict, c: dict, claim: str) -> str:
    vols = {v["name"]: v for v in d["spec"]["template"]["spec"]["volumes"]}
    for m in c["volumeMounts"]:
        if vols[m["name"]].get("persistentVolumeClaim", {}).get("claimName") == claim:
            return m["mountPath"]
    raise AssertionError(f"{d['metadata']['name']} does not mount {claim}")


def test_every_pod_keeps_the_model_in_one_cache_volume():
    """HF_HOME of every streamgrpo container is on one ReadWriteMany PVC: downloaded once, kept across restarts."""
    docs = k8s_docs()
    pvcs = by_kind(docs)["PersistentVolumeClaim"]
    claims = set()
    for _, d, spec, c in streamgrpo_containers(docs):
        hf_home = pod_env(c, d, 0).get("HF_HOME")
        assert hf_home, f"{d['metadata']['name']}: no HF_HOME"
        vols = {v["name"]: v for v in spec["volumes"]}
        mount = next((m for m in c["volumeMounts"] if m["mountPath"] == hf_home), None)
        assert mount, f"{d['metadata']['name']}: HF_HOME {hf_home} is no mount"
        vol = vols[mount["name"]]
        assert "persistentVolumeClaim" in vol, f"{d['metadata']['name']}: HF_HOME on {vol} is lost at every restart"
        claims.add(vol["persistentVolumeClaim"]["claimName"])
    assert len(claims) == 1
    assert pvcs[claims.pop()]["spec"]["accessModes"] == ["ReadWriteMany"]


# ============================================================================ references, commands
def test_k8s_manifests_cross_reference():  # noqa: C901 - one walk over every reference between the manifests
    docs = k8s_docs()
    assert docs
    kinds: dict[str, dict[str, dict]] = {}
    for fname, d in docs:
        assert d.get("apiVersion") and d.get("kind") and d["metadata"].get("name"), fname
        if d["kind"] != "Namespace":
            assert d["metadata"]["namespace"] == "streamgrpo", (fname, d["metadata"]["name"])
        kinds.setdefault(d["kind"], {})[d["metadata"]["name"]] = d
    secrets = {name: {"data": dict.fromkeys(keys)} for name, keys in docs_secrets().items()} | kinds.get("Secret", {})
    configmaps = kinds.get("ConfigMap", {})
    pvcs, services = kinds.get("PersistentVolumeClaim", {}), kinds.get("Service", {})
    workloads = list(_pod_specs(docs))
    assert {d["metadata"]["name"] for _, d, _ in workloads} >= {
        "streamgrpo-redis", "streamgrpo-learner", "streamgrpo-generator", "streamgrpo-evaluator", "streamgrpo-prometheus"}
    pods = []
    for _, d, spec in workloads:
        labels = pod_labels(d)
        sel = d["spec"]["selector"]["matchLabels"]
        assert all(labels.get(k) == v for k, v in sel.items()), f"{d['metadata']['name']}: selector misses its pods"
        if d["kind"] == "StatefulSet":
            assert d["spec"]["serviceName"] in services, d["metadata"]["name"]
        ports = {p["name"] for c in spec["containers"] for p in c.get("ports", [])}
        pods.append((labels, ports))
    for _, d, spec in workloads:
        name = d["metadata"]["name"]
        for c in spec["containers"] + spec.get("initContainers", []):
            for e in c.get("env", []):
                ref = (e.get("valueFrom") or {})
                if "secretKeyRef" in ref:
                    s = ref["secretKeyRef"]
                    assert s["name"] in secrets, f"{name}: Secret {s['name']} missing"
                    assert s["key"] in secrets[s["name"]].get("stringData", {}) | secrets[s["name"]].get("data", {})
                if "configMapKeyRef" in ref:
                    assert ref["configMapKeyRef"]["name"] in configmaps, name
            vols = {v["name"] for v in spec.get("volumes", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in vols, f"{name}: volumeMount {m['name']} has no volume"
            for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                port = ((c.get(probe) or {}).get("httpGet") or {}).get("port")
                if isinstance(port, str):
                    assert port in {p["name"] for p in c.get("ports", [])}, f"{name}: {probe} port {port}"
        for v in spec.get("volumes", []):
            if "configMap" in v:
                assert v["configMap"]["name"] in configmaps, name
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in pvcs, name
        if spec.get("serviceAccountName"):
            assert spec["serviceAccountName"] in kinds.get("ServiceAccount", {}), name
    for sname, svc in services.items():
        sel = svc["spec"]["selector"]
        matching = [ports for labels, ports in pods if all(labels.get(k) == v for k, v in sel.items())]
        assert matching, f"Service {sname} selects no pod"
        for p in svc["spec"]["ports"]:
            if isinstance(p.get("targetPort"), str):
                assert all(p["targetPort"] in ports for ports in matching), f"Service {sname}: port {p['targetPort']}"
    for rb in kinds.get("RoleBinding", {}).values():
        assert rb["roleRef"]["name"] in kinds.get("Role", {})
        for s in rb["subjects"]:
            assert s["name"] in kinds.get("ServiceAccount", {})


def test_k8s_commands_and_config(tmp_path, monkeypatch):
    from streamgrpo.config import load_config

    docs = k8s_docs()
    services = {d["metadata"]["name"] for _, d in docs if d["kind"] == "Service"}
    path = config_file(tmp_path, docs)
    monkeypatch.setenv("REDIS_PASSWORD", "0123abcd")
    cfg = load_config(path)
    host = re.match(r"rediss?://(?::[^@]*@)?([^:/]+)", cfg.queue.url).group(1)
    assert host in services and cfg.queue.url.startswith("redis://:0123abcd@")
    assert cfg.weights.connect_host in services and cfg.weights.bind_host == "0.0.0.0"
    assert cfg.learner.deepspeed_config in {p.stem for p in DS_DIR.glob("*.json")}  # shipped in the package
    ran = set()
    for _, d, _, c in streamgrpo_containers(docs):
        env = pod_env(c, d, 0)
        argv = pod_streamgrpo_argv(c, d)
        args = assert_parses(argv, f"k8s {d['metadata']['name']}")
        ran.add(args.command)
        pod_cfg = load_config(path, args.overrides)  # Prometheus scrapes the `metrics` port from another pod
        assert pod_cfg.metrics.host == "0.0.0.0", d["metadata"]["name"]
        assert {"name": "metrics", "containerPort": pod_cfg.metrics.port} in c["ports"], d["metadata"]["name"]
        mounts = {m["mountPath"] for m in c["volumeMounts"]}
        assert str(Path(args.config).parent) in mounts, "the config comes from the ConfigMap mount"
        if args.command == "learner":
            full = [_expand_k8s_vars(a, env) for a in c["command"] + c["args"]]
            assert full[0] == "torchrun" and "--resume" in argv
            assert env["MASTER_ADDR"].split(".")[1] in services
            assert int(env["NNODES"]) == d["spec"]["replicas"]
            ranks = int(env["NPROC_PER_NODE"])
            assert ranks == c["resources"]["limits"]["nvidia.com/gpu"]
            # local rank r serves metrics.port + r: each declared, so Prometheus finds it
            assert {(p["name"], p["containerPort"]) for p in c["ports"] if p["name"].startswith("metrics")} == {
                ("metrics" if r == 0 else f"metrics-{r}", pod_cfg.metrics.port + r) for r in range(ranks)}
    assert ran == {"learner", "generator", "evaluator"}


# ============================================================================ Prometheus in k8s
def test_k8s_jobs_are_the_ones_the_rules_and_dashboard_select():
    """The `job` labels deploy/prometheus/rules.yml and the Grafana dashboard select are ones the k8s scrape
    config gives (from the pods' component label), and the ones it gives are learner, generator, evaluator."""
    docs = k8s_docs()
    produced = {job for job, *_ in scrape_targets(docs)}
    assert produced == {"learner", "generator", "evaluator"}
    used = selected_jobs(rule_exprs()) | selected_jobs(dashboard_exprs())
    assert used and used <= produced, f"selected but never scraped in k8s: {sorted(used - produced)}"
    ours = {"role", "fn", "event", "reason", "side", "stat", "kind"}  # streamgrpo's own metric labels
    for job in prometheus_config(docs)["scrape_configs"]:
        for rc in job.get("relabel_configs", []):
            assert rc.get("target_label") not in ours, job["job_name"]
    assert DASHBOARD.exists()


def test_k8s_rules_are_the_shipped_rules_with_exported_metrics():
    cm = by_kind(k8s_docs())["ConfigMap"]["streamgrpo-prometheus"]
    assert cm["data"]["rules.yml"] == (PROM_DIR / "rules.yml").read_text(), \
        "30-prometheus.yaml must carry a verbatim copy of deploy/prometheus/rules.yml"
    exported = exported_names() | {"up"}
    for group in yaml.safe_load(cm["data"]["rules.yml"])["groups"]:
        for r in group["rules"]:
            unknown = metric_names(r["expr"]) - exported
            assert not unknown, f"{r.get('alert')}: {sorted(unknown)} not exported by streamgrpo/metrics.py"


@pytest.mark.prometheus
def test_k8s_prometheus_config(tmp_path):
    tool = promtool()
    cm = by_kind(k8s_docs())["ConfigMap"]["streamgrpo-prometheus"]
    for key in ("prometheus.yml", "rules.yml"):
        (tmp_path / key).write_text(cm["data"][key])
    out = subprocess.run([tool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    doc = yaml.safe_load(cm["data"]["prometheus.yml"])
    if out.returncode != 0 and "field kubernetes_sd_configs not found" in out.stdout + out.stderr:
        # Debian's prometheus is built without Kubernetes discovery (the prom/prometheus image has it):
        # check everything else with the discovery block swapped for a static target.
        stripped = yaml.safe_load(cm["data"]["prometheus.yml"])
        for job in stripped["scrape_configs"]:
            if job.pop("kubernetes_sd_configs", None) is not None:
                job["static_configs"] = [{"targets": ["10.0.0.1:9100"]}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(stripped))
        out = subprocess.run([tool, "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr
    assert doc["scrape_configs"][0]["kubernetes_sd_configs"][0]["role"] == "pod"
