"""A small Kustomize for the kustomizations in deploy/kubernetes, for machines without kubectl.

It implements only the fields those files use: resources (files and directories), components
(of resources only), namespace, labels (with includeSelectors), images, replicas and
configMapGenerator (files; behavior create or replace), in kustomize's order: a base is built
with its own transformations, a component's resources join the overlay's, then the overlay's
transformations apply to everything. Anything else in a kustomization is an error, not ignored.
The generated ConfigMap's name suffix is a content hash like kustomize's, but not its
algorithm; tests/test_deploy_kubernetes.py checks this renderer against `kubectl kustomize`
wherever kubectl is installed, suffixes aside.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {
    "apiVersion",
    "kind",
    "resources",
    "components",
    "namespace",
    "labels",
    "images",
    "replicas",
    "configMapGenerator",
}
CLUSTER_SCOPED = {"Namespace"}
# Where includeSelectors puts the labels besides metadata.labels (the kinds used here).
SELECTORS = {
    "Deployment": [("spec", "selector", "matchLabels"), ("spec", "template", "metadata", "labels")],
    "Service": [("spec", "selector")],
    "PodDisruptionBudget": [("spec", "selector", "matchLabels")],
    "NetworkPolicy": [("spec", "podSelector", "matchLabels")],
}


def _at(doc: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node = doc
    for key in path:
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    return node


def _build(directory: Path) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """(resources, generated ConfigMaps by their unsuffixed name) of one kustomization."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise ValueError(f"{directory}: kustomize_lite does not implement {sorted(unknown)}")
    docs: list[dict[str, Any]] = []
    generated: dict[str, dict[str, Any]] = {}
    for res in k.get("resources", []):
        path = directory / res
        if path.is_dir():
            sub_docs, sub_generated = _build(path)
            docs += sub_docs
            generated.update(sub_generated)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for comp in k.get("components", []):
        c = yaml.safe_load((directory / comp / "kustomization.yaml").read_text())
        if c.get("kind") != "Component" or set(c) - {"apiVersion", "kind", "resources"}:
            raise ValueError(f"{directory / comp}: kustomize_lite takes a Component of resources")
        for res in c.get("resources", []):
            path = directory / comp / res
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        data = {Path(f).name: (directory / f).read_text() for f in gen["files"]}
        cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": gen["name"]}}
        cm["data"] = data
        behavior = gen.get("behavior", "create")
        if behavior == "replace":
            if gen["name"] not in generated:
                raise ValueError(f"{directory}: replace of unknown ConfigMap {gen['name']}")
            cm["metadata"] = copy.deepcopy(generated[gen["name"]]["metadata"])
        elif behavior != "create":
            raise ValueError(f"{directory}: configMapGenerator behavior {behavior}")
        generated[gen["name"]] = cm
    everything = docs + list(generated.values())
    for group in k.get("labels", []):
        pairs = group["pairs"]
        for d in everything:
            _at(d, ("metadata", "labels")).update(pairs)
            if group.get("includeSelectors"):
                for path in SELECTORS.get(d["kind"], []):
                    _at(d, path).update(pairs)
    for d in everything:
        if "namespace" in k and d["kind"] not in CLUSTER_SCOPED:
            d["metadata"]["namespace"] = k["namespace"]
    for image in k.get("images", []):
        for d in docs:
            for c in d.get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
                name, _, tag = c["image"].partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for rep in k.get("replicas", []):
        for d in docs:
            if d["kind"] == "Deployment" and d["metadata"]["name"] == rep["name"]:
                d["spec"]["replicas"] = rep["count"]
    return docs, generated


def render(directory: Path) -> list[dict[str, Any]]:
    """The kustomization's output, with generated ConfigMaps hash-suffixed and referenced."""
    docs, generated = _build(directory)
    names = {}
    for name, cm in generated.items():
        digest = hashlib.sha256(json.dumps(cm["data"], sort_keys=True).encode()).hexdigest()
        cm["metadata"]["name"] = names[name] = f"{name}-{digest[:10]}"
    for d in docs:
        for vol in d.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "configMap" in vol and vol["configMap"]["name"] in names:
                vol["configMap"]["name"] = names[vol["configMap"]["name"]]
    return docs + list(generated.values())
