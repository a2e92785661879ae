"""Record, from a vLLM source tree, the names minirsi must not collide with and the sampling
fields vLLM fills from the model's generation_config.json; the tests check minirsi against the
record (``tests/test_serving.py``), no vLLM needed there.

    pip download --no-deps vllm==0.33.0 -d /tmp/w && unzip -q /tmp/w/vllm-*.whl 'vllm/*.py' -d /tmp/v33
    python scale/serving/record_vllm.py /tmp/v33        # adds "0.33.0" to vllm_recorded.json

What it reads (by parsing, not importing: vLLM needs CUDA):

* ``Worker`` of ``vllm/v1/worker/gpu_worker.py`` and its base classes, followed through the
  imports of each module: every name defined in a class body (methods, properties, class
  attributes) and every ``self.NAME = ...`` in their methods. vLLM asserts at start that no
  attribute of ``--worker-extension-cls`` is already one of the first kind
  (``worker_base.py``); one of the second kind would be shadowed by the instance at run time.
* ``CompletionRequest._DEFAULT_SAMPLING_PARAMS``: the fields that, left out of a request,
  take the server's default, i.e. generation_config.json's (``get_diff_sampling_param``),
  when the server runs with ``--generation-config auto`` (its default).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

RECORD = Path(__file__).with_name("vllm_recorded.json")
WORKER = ("vllm/v1/worker/gpu_worker.py", "Worker")
COMPLETION = ("vllm/entrypoints/openai/completion/protocol.py", "vllm/entrypoints/openai/protocol.py")


def _module(root: Path, dotted: str) -> Path:
    return root / (dotted.replace(".", "/") + ".py")


def class_names(root: Path, rel: str, name: str, seen: set | None = None) -> tuple[set[str], set[str], list[str]]:
    """(class-level names, self.X names, the classes read as "file:Class") of ``name`` in
    ``root/rel`` and its bases, recursively."""
    seen = seen if seen is not None else set()
    tree = ast.parse((root / rel).read_text())
    imports = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                imports[a.asname or a.name] = (node.module, a.name)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    key = f"{rel}:{name}"
    if key in seen:
        return set(), set(), []
    seen.add(key)
    own, inst = set(), set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            own.add(node.name)
            for sub in ast.walk(node):
                targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, (ast.AnnAssign, ast.AugAssign)) else []
                for t in targets:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        inst.add(t.attr)
        elif isinstance(node, ast.Assign):
            own.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            own.add(node.target.id)
    read = [key]
    for base in cls.bases:
        if not isinstance(base, ast.Name):
            continue
        if base.id in imports:
            module, real = imports[base.id]
            path = _module(root, module)
            if path.is_file():
                o, i, r = class_names(root, str(path.relative_to(root)), real, seen)
                own, inst, read = own | o, inst | i, read + r
        elif any(isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body):
            o, i, r = class_names(root, rel, base.id, seen)
            own, inst, read = own | o, inst | i, read + r
    return own, inst, read


def sampling_defaults(root: Path) -> tuple[str, list[str]]:
    for rel in COMPLETION:
        if not (root / rel).is_file():
            continue
        tree = ast.parse((root / rel).read_text())
        cls = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CompletionRequest"), None)
        for node in cls.body if cls else []:
            target = node.target if isinstance(node, ast.AnnAssign) else (node.targets[0] if isinstance(node, ast.Assign) else None)
            if isinstance(target, ast.Name) and target.id == "_DEFAULT_SAMPLING_PARAMS":
                return f"{rel}:CompletionRequest._DEFAULT_SAMPLING_PARAMS", sorted(ast.literal_eval(node.value))
    raise SystemExit(f"{root}: no CompletionRequest._DEFAULT_SAMPLING_PARAMS in {COMPLETION}")


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__.splitlines()[0] + "\nusage: record_vllm.py VLLM_SOURCE_ROOT (the folder holding vllm/)",
              file=sys.stderr)
        return 2
    root = Path(sys.argv[1])
    found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", (root / "vllm/_version.py").read_text())
    if found is None:
        raise SystemExit(f"{root}/vllm/_version.py: no __version__ = '...' line")
    version = found.group(1)
    own, inst, read = class_names(root, *WORKER)
    where, fields = sampling_defaults(root)
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    record[version] = {"worker_classes": read, "worker_class_attributes": sorted(own),
                       "worker_instance_attributes": sorted(inst - own),
                       "completion_defaults_from": where, "completion_fields_from_generation_config": fields}
    RECORD.write_text(json.dumps(dict(sorted(record.items())), indent=1) + "\n")
    print(f"vllm {version}: {len(own)} class names, {len(inst - own)} instance names from {read}; "
          f"generation-config fields {fields}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
