"""LoRA adapters served beside the base model, as vLLM serves them (`--enable-lora`).

- `--lora-modules a,b=/path/b` serves adapters from the start; `POST /v1/load_lora_adapter`
  (`{"lora_name", "lora_path"}`) and `POST /v1/unload_lora_adapter` (`{"lora_name"}`) add and
  drop them at run time, with vLLM's answers (vLLM needs VLLM_ALLOW_RUNTIME_LORA_UPDATING).
- `GET /v1/models` lists each adapter as its own model, `parent` naming the base model.
- A request names the adapter as its `model`; its KV blocks are keyed apart from the base
  model's and from every other adapter's (vLLM puts the adapter's name in every block's extra
  keys), and its KV events name the adapter (`lora_name`, `lora_id`).
"""

from __future__ import annotations

from typing import Any

import xxhash

from proxy.sim.errors import HTTPError


def parse_modules(text: str, base: str) -> dict[str, str]:
    """`name[=path],...` -> {name: path}; ValueError for an empty, repeated or base name."""
    out: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, _, path = item.partition("=")
        name = name.strip()
        if not name or name == base or name in out:
            raise ValueError(f"lora_modules: bad or repeated adapter name {name!r}")
        out[name] = path.strip() or f"/adapters/{name}"
    return out


class Adapters:
    """The adapters an engine serves now, with the id vLLM numbers each load by."""

    def __init__(self, base: str, modules: str = "") -> None:
        self.base = base
        self._ids: dict[str, int] = {}
        self._paths: dict[str, str] = {}
        self._next = 1
        for name, path in parse_modules(modules, base).items():
            self._add(name, path)

    def _add(self, name: str, path: str) -> None:
        self._paths[name] = path
        self._ids[name] = self._next
        self._next += 1

    def __contains__(self, name: object) -> bool:
        return name in self._paths

    def id_of(self, name: str) -> int:
        return self._ids[name]

    def load(self, body: Any) -> str:
        if not isinstance(body, dict):
            raise HTTPError(400, "expected a JSON object with lora_name and lora_path")
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise HTTPError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self._paths or name == self.base:
            raise HTTPError(400, f"The lora adapter '{name}' has already been loaded.")
        self._add(name, path)
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, body: Any) -> str:
        name = body.get("lora_name") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            raise HTTPError(400, "'lora_name' needs to be provided to unload a LoRA adapter.")
        if name not in self._paths:
            raise HTTPError(404, f"The lora adapter '{name}' cannot be found.")
        del self._paths[name], self._ids[name]
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, created: int) -> list[dict[str, Any]]:
        """The adapters' entries of /v1/models (vLLM's ModelCard: `parent` is the base)."""
        return [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": path,
                "parent": self.base,
                "max_model_len": None,
            }
            for name, path in self._paths.items()
        ]


def keyed_salt(adapter: str, salt: int) -> int:
    """The seed of an adapter request's block chain: its name with the request's cache salt."""
    return xxhash.xxh64_intdigest(f"lora\0{adapter}\0{salt}".encode())
