"""deploy/kubernetes/*.yaml: every object validates offline against the Kubernetes schemas (kubernetes-validate
ships them; strict: unknown fields are errors), the InferencePool against the vendored CRD schema, and the
ports, probes and flags agree with tokenmill's own CLI and apps."""

import copy
import re
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tokenmill.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
CRD = DEPLOY / "vendor" / "inference.networking.k8s.io_inferencepools.yaml"
K8S_VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest we support (native preStop sleep), newest


def documents() -> list[tuple[str, dict]]:
    docs = []
    for path in sorted(DEPLOY.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                docs.append((path.name, doc))
    return docs


def by_kind(kind: str, name: str) -> dict:
    return next(d for _, d in documents() if d["kind"] == kind and d["metadata"]["name"] == name)


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


def cli_args(c: dict):
    """The container's args parsed by tokenmill's own argparse ($(VAR) expanded as the kubelet would)."""
    env = {"POD_NAMESPACE": "default"}
    argv = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    return build_parser(argv).parse_args(argv)


def ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def test_every_manifest_is_valid_against_the_kubernetes_schemas():
    docs = documents()
    assert {f for f, _ in docs} == {"worker.yaml", "router.yaml", "epp.yaml", "epp-envoy.yaml"}
    core = [(f, d) for f, d in docs if d["kind"] != "InferencePool"]
    assert len(core) == 9
    for version in K8S_VERSIONS:
        for f, doc in core:
            kubernetes_validate.validate(doc, version, strict=True)


def test_the_validation_catches_a_wrong_field():
    bad = copy.deepcopy(by_kind("Deployment", "tokenmill-worker"))
    container(bad)["readinessProbe"]["httpGet"]["port"] = [8000]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)
    bad = copy.deepcopy(by_kind("Service", "tokenmill-workers"))
    bad["spec"]["headless"] = True  # an unknown field: strict schemas reject it
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, K8S_VERSIONS[-1], strict=True)


def _strict(schema: dict) -> dict:
    """The CRD's structural schema, with unknown fields rejected (the API server prunes them silently)."""
    schema = dict(schema)
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        schema["additionalProperties"] = False
    for key in ("properties",):
        if key in schema:
            schema[key] = {k: _strict(v) for k, v in schema[key].items()}
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            schema[key] = _strict(schema[key])
    return schema


def inference_pool_validator():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "InferencePool"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = _strict(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


def test_the_inference_pool_is_valid_against_the_vendored_crd():
    pool = by_kind("InferencePool", "tokenmill")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    validator = inference_pool_validator()
    validator.validate(pool)
    ref = pool["spec"]["endpointPickerRef"]  # the CRD's CEL rule (not JSON schema): a Service needs a port
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    for broken in ({"targetPorts": []}, {"endpointPickerRef": {"name": "x", "port": {"number": 0}}},
                   {"selector": {"matchLabels": {"app": "w"}}, "targetPort": 8000}):
        bad = copy.deepcopy(pool)
        bad["spec"].update(broken)
        assert list(validator.iter_errors(bad)), broken


def test_ports_probes_and_flags_match_the_cli_and_the_apps():
    from tokenmill.router.app import create_app
    from tokenmill.router.cli import build_config
    from tokenmill.router.config import RouterConfig
    from tokenmill.router.epp import HEALTH_SERVICES
    from tokenmill.router.router import Router

    worker, headless = by_kind("Deployment", "tokenmill-worker"), by_kind("Service", "tokenmill-workers")
    wc = container(worker)
    serve = cli_args(wc)
    assert serve.command == "serve"
    assert serve.host == "0.0.0.0" and ports(wc)["http"] == serve.port
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"].items() <= worker["spec"]["template"]["metadata"]["labels"].items()
    assert headless["spec"]["ports"][0]["port"] == serve.port
    server_routes = (ROOT / "tokenmill" / "server" / "app.py").read_text()
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = wc[probe]["httpGet"]
        assert get["port"] in ports(wc) and f'add_get("{get["path"]}"' in server_routes
    pre_stop = wc["lifecycle"]["preStop"]["sleep"]["seconds"]

    router_paths = {r.resource.canonical for r in create_app(Router(RouterConfig())).router.routes()}
    for name in ("tokenmill-router", "tokenmill-epp"):
        dep, svc = by_kind("Deployment", name), by_kind("Service", name)
        c = container(dep)
        args = cli_args(c)
        cfg = build_config(args)  # every flag known to `tokenmill route` and every value valid
        assert cfg.host == "0.0.0.0" and ports(c)["http"] == cfg.port
        (target,) = cfg.worker_dns
        assert target.name.startswith(headless["metadata"]["name"] + ".") and target.port == serve.port
        assert target.kind == "tokenmill"
        # a worker leaves DNS before SIGTERM and is drained by the next discovery round
        assert pre_stop >= cfg.dns_interval_s + 5 and worker["spec"]["template"]["spec"][
            "terminationGracePeriodSeconds"] > pre_stop
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        for p in svc["spec"]["ports"]:
            assert p["targetPort"] in ports(c)
        annotations = dep["spec"]["template"]["metadata"]["annotations"]
        assert int(annotations["prometheus.io/port"]) == cfg.port and annotations["prometheus.io/path"] in router_paths
        for probe in ("readinessProbe", "livenessProbe"):
            p = c[probe]
            if "httpGet" in p:
                assert p["httpGet"]["path"] in router_paths and p["httpGet"]["port"] in ports(c)
            elif "grpc" in p:
                assert p["grpc"]["port"] == cfg.epp_port and p["grpc"]["service"] in HEALTH_SERVICES
            else:
                assert p["tcpSocket"]["port"] in ports(c)
        if name == "tokenmill-epp":
            assert ports(c)["grpc"] == cfg.epp_port
            pool = by_kind("InferencePool", "tokenmill")
            ref = pool["spec"]["endpointPickerRef"]
            (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
            assert ref["name"] == name and ports(c)[svc_port["targetPort"]] == cfg.epp_port
            assert pool["spec"]["selector"]["matchLabels"].items() <= worker["spec"]["template"]["metadata"][
                "labels"].items()
            assert [p["number"] for p in pool["spec"]["targetPorts"]] == [serve.port]
        else:
            assert cfg.epp_port is None


def envoy_bootstrap():
    """epp-envoy.yaml's Envoy config parsed into Envoy's own Bootstrap proto (xds-protos): unknown fields,
    misspelt enum values and unknown typed_config types are errors, as Envoy itself would reject them."""
    from envoy.config.bootstrap.v3 import bootstrap_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2  # noqa: F401 (typed_config types)
    from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401
    from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2  # noqa: F401
    from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401
    from google.protobuf import json_format

    text = by_kind("ConfigMap", "tokenmill-envoy")["data"]["envoy.yaml"]
    return json_format.ParseDict(yaml.safe_load(text), bootstrap_pb2.Bootstrap()), text


def test_the_envoy_gateway_config_parses_and_sends_the_picker_only_what_it_needs():
    from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
    from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2
    from google.protobuf import json_format

    from tokenmill.router.cli import build_config
    from tokenmill.router.epp import DESTINATION_HEADER

    boot, text = envoy_bootstrap()
    (listener,) = boot.static_resources.listeners
    hcm = http_connection_manager_pb2.HttpConnectionManager()
    listener.filter_chains[0].filters[0].typed_config.Unpack(hcm)
    filters = {f.name: f for f in hcm.http_filters}
    assert list(filters) == ["envoy.filters.http.ext_proc", "envoy.filters.http.router"]  # the router last
    ext = ext_proc_pb2.ExternalProcessor()
    filters["envoy.filters.http.ext_proc"].typed_config.Unpack(ext)
    mode, pm = ext.processing_mode, processing_mode_pb2.ProcessingMode
    assert (mode.request_header_mode, mode.request_body_mode, mode.request_trailer_mode) == (
        pm.SEND, pm.FULL_DUPLEX_STREAMED, pm.SEND)
    assert (mode.response_header_mode, mode.response_body_mode, mode.response_trailer_mode) == (
        pm.SEND, pm.NONE, pm.SKIP)
    assert not ext.failure_mode_allow
    clusters = {c.name: c for c in boot.static_resources.clusters}
    workers = clusters[hcm.route_config.virtual_hosts[0].routes[0].route.cluster]
    assert workers.type == workers.ORIGINAL_DST and workers.original_dst_lb_config.use_http_header
    assert workers.original_dst_lb_config.http_header_name == DESTINATION_HEADER
    epp = clusters[ext.grpc_service.envoy_grpc.cluster_name]
    (address,) = [e.endpoint.address.socket_address for loc in epp.load_assignment.endpoints for e in loc.lb_endpoints]
    picker = by_kind("Deployment", "tokenmill-epp")
    svc = by_kind("Service", "tokenmill-epp")
    assert address.address.startswith(svc["metadata"]["name"] + ".")
    (svc_port,) = [p for p in svc["spec"]["ports"] if p["port"] == address.port_value]
    assert ports(container(picker))[svc_port["targetPort"]] == build_config(cli_args(container(picker))).epp_port
    # the ports the Deployment and Service expose are the ones Envoy listens on
    envoy = container(by_kind("Deployment", "tokenmill-envoy"))
    assert ports(envoy)["http"] == listener.address.socket_address.port_value
    assert ports(envoy)["admin"] == boot.admin.address.socket_address.port_value
    assert envoy["readinessProbe"]["httpGet"]["port"] == "admin"
    gateway = by_kind("Service", "tokenmill-gateway")
    assert gateway["spec"]["selector"].items() <= by_kind("Deployment", "tokenmill-envoy")["spec"]["template"][
        "metadata"]["labels"].items()
    # the parse is strict: a misspelt field or mode is an error, as Envoy would reject it
    for wrong in ("response_body_mode: NONE", "use_http_header: true"):
        with pytest.raises(json_format.ParseError):
            json_format.ParseDict(yaml.safe_load(text.replace(wrong, wrong.replace("_mode: NONE", "_mode: NOPE")
                                                              .replace("use_http_header", "use_http_headr"))),
                                  type(boot)())
