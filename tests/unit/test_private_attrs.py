"""No module sets or reads another module's underscore attributes: checked with ``ast`` over every module of
relax_hpc. An access ``x._name`` (or ``getattr``/``setattr``/``hasattr`` with a literal ``"_name"``) is fine on
``self``/``cls`` and on any object when the module itself defines ``_name`` (a method, a class attribute or
``self._name = ...``: its own class's private state, e.g. another instance of it); anything else reaches into
another module's internals. The few exceptions are listed in :data:`ALLOWED`, each with its reason."""

from __future__ import annotations

import ast
from pathlib import Path

import relax_hpc

PKG = Path(relax_hpc.__file__).resolve().parent

ALLOWED: dict[tuple[str, str], str] = {
    # Python and torch
    ("relax_hpc/cli/role.py", "_exit"): "os._exit is the documented way to end a process without cleanup",
    ("relax_hpc/trainer/megatron/dist_checkpoint.py", "_exit"): "os._exit, as above (a helper process)",
    ("relax_hpc/models/compiled.py", "_dynamo"): "torch._dynamo's error types and reset are how torch.compile "
                                                 "failures are caught (no public alias)",
    ("relax_hpc/weights/server_links.py", "_new_process_group_helper"):
        "torch: the group helper is how SGLang builds its weight-update group; both ends must build the same one",
    ("relax_hpc/weights/server_links.py", "_world"): "torch: registers the new group's ranks as the helper's "
                                                     "callers in torch.distributed do",
    ("relax_hpc/weights/fastpath.py", "_foreach_copy_"): "torch: one fused copy of many tensors (no public API)",
    ("relax_hpc/rendezvous.py", "_timeout"): "torch: a process group's backend options hold its timeout only here",
    ("relax_hpc/trainer/megatron/pipeline.py", "_timeout"): "torch: as in rendezvous.py",
    ("relax_hpc/trainer/megatron/pipeline.py", "_get_backend"): "torch: the group's backend, for its timeout",
    ("relax_hpc/trainer/megatron/dist_checkpoint.py", "_get_layout"): "torch.serialization: the tensor layout "
                                                                      "table the restricted unpickler allows",
    # transformers
    ("relax_hpc/models/load.py", "_tokenizer"): "transformers: a fast tokenizer's backend object (its vocabulary)",
    ("relax_hpc/models/load.py", "_attn_implementation"): "transformers: the attention kernel a config selects",
    ("relax_hpc/models/masks.py", "_attn_implementation"): "transformers: as in models/load.py",
    # megatron-core
    ("relax_hpc/trainer/megatron/dist_checkpoint.py", "_results_queue"): "megatron-core: the async checkpoint "
                                                                         "writer's queue, closed at exit",
    ("relax_hpc/trainer/megatron/dist_checkpoint.py", "_manager"): "megatron-core: that queue's manager process",
    ("relax_hpc/trainer/megatron/layers.py", "_get_cuda_rng_state"): "megatron-core: its RNG tracker's states",
    ("relax_hpc/trainer/megatron/layers.py", "_set_cuda_rng_state"): "megatron-core: as above",
    ("relax_hpc/trainer/megatron/optim.py", "_get_main_param_and_optimizer_states"):
        "megatron-core's distributed optimizer has no public access to its main parameters and moments",
    ("relax_hpc/trainer/megatron/optim.py", "_copy_model_params_to_main_params"): "megatron-core: as above",
    ("relax_hpc/trainer/megatron/optim.py", "_init_optimizer_states_with_dummy_values"): "megatron-core: as above",
    ("relax_hpc/trainer/megatron/optim.py", "_get_model_param_range_map"): "megatron-core: as above",
    # this project's own marker on a third-party object
    ("relax_hpc/models/mrope.py", "_relax_stray_hook"): "mrope's own hook handle, kept on the torch module it hooks "
                                                        "(set and read only by mrope.py)",
}
"""(file, attribute) -> why this access of another module's private name is allowed."""


def own_names(tree: ast.AST) -> set[str]:
    """Underscore names the module defines: functions, classes, class attributes, ``self._x = ...``."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for sub in ast.walk(t):
                    if isinstance(sub, ast.Name):
                        out.add(sub.id)
                    elif isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and \
                            sub.value.id in ("self", "cls"):
                        out.add(sub.attr)
    return {n for n in out if n.startswith("_")}


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def foreign_accesses(path: Path, pkg: Path = PKG) -> list[str]:
    """``file:line: what`` for every access of an underscore attribute the module does not own."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(pkg.parent).as_posix()
    mine = own_names(tree)
    bad = []
    for node in ast.walk(tree):
        name = None
        if isinstance(node, ast.Attribute) and private(node.attr):
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            name = node.attr
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) and \
                private(node.args[1].value):
            name = node.args[1].value
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("relax_hpc"):
            names = [a.name for a in node.names if private(a.name)]
            name = names[0] if names else None
        if name is None or (name in mine and not isinstance(node, ast.ImportFrom)) or (rel, name) in ALLOWED:
            continue
        bad.append(f"{rel}:{node.lineno}: {ast.unparse(node)[:80]}")
    return bad


def test_no_module_touches_another_modules_private_attributes() -> None:
    bad = [b for path in sorted(PKG.rglob("*.py")) for b in foreign_accesses(path)]
    assert not bad, "underscore attributes of other modules:\n" + "\n".join(bad)


def test_allowed_exceptions_are_still_used() -> None:
    """An exception whose access is gone must be removed, so the list only shrinks."""
    for rel, name in ALLOWED:
        assert name in (PKG.parent / rel).read_text(), f"{rel} no longer uses {name}: drop it from ALLOWED"


def test_the_checker_sees_side_doors(tmp_path: Path) -> None:
    pkg = tmp_path / "relax_hpc"
    pkg.mkdir()
    (pkg / "a.py").write_text(
        "class A:\n    def __init__(self):\n        self._own = 1\n    def same(self, other):\n"
        "        return other._own\n\n"
        "def f(files, trainer):\n    files._handover = 1\n    trainer._copy.wait()\n"
        "    return getattr(files, '_publish', None), files.__dict__\n\n"
        "def g():\n    from relax_hpc.b import _helper, public\n")
    found = sorted(f.split(": ", 1)[1] for f in foreign_accesses(pkg / "a.py", pkg))
    assert found == ["files._handover", "from relax_hpc.b import _helper, public", "getattr(files, '_publish', None)",
                     "trainer._copy"], found
