"""``weights.transport``: one setting selects every weight path (relax_hpc/weights/transport/__init__.py). ``auto``
follows the mode and engine; the three deprecated keys still steer it, translated with a warning; a transport the mode
or engine cannot use, or an old key beside an explicit transport, is refused in one line."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest

from relax_hpc.config.load import validate_dict
from relax_hpc.errors import ConfigError
from relax_hpc.weights.transport import resolve

BASE: dict[str, Any] = {"data": {"task": {"name": "reverse_digits"}}, "model": {"path": "tiny"}}


def cfg(**sections: Any) -> Any:
    return validate_dict({**BASE, **sections})


def quiet(c: Any) -> Any:
    """``resolve(c)``, failing on any warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return resolve(c)


@pytest.mark.parametrize(("sections", "want"), [
    ({}, {"kind": "memory"}),  # colocate
    ({"rollout": {"engine": "vllm"}}, {"kind": "files"}),  # colocate: the server loads each version's files
    ({"rollout": {"engine": "sglang"}, "weights": {"transport": {"kind": "files"}}}, {"kind": "files"}),
    ({"mode": "fully_async"}, {"kind": "process_group", "backend": "auto", "files_every_s": 10.0}),
    ({"mode": "fully_async", "rollout": {"engine": "sglang"}}, {"kind": "files"}),
    ({"mode": "fully_async", "rollout": {"engine": "vllm"}}, {"kind": "files"}),
    ({"mode": "fully_async", "weights": {"transport": {"kind": "files"}}}, {"kind": "files"}),
    ({"mode": "fully_async", "rollout": {"engine": "sglang"}, "weights": {"transport": {"kind": "server"}}},
     {"kind": "server"}),
    ({"mode": "fully_async", "weights": {"transport": {"kind": "process_group", "backend": "gloo",
                                                       "files_every_s": 0}}},
     {"kind": "process_group", "backend": "gloo", "files_every_s": 0.0}),
])
def test_auto_and_explicit_transports(sections: dict[str, Any], want: dict[str, Any]) -> None:
    assert quiet(cfg(**sections)).model_dump() == want


@pytest.mark.parametrize(("sections", "old", "want"), [
    ({"weights": {"fast_path": "off"}}, "weights.fast_path", {"kind": "files"}),
    ({"weights": {"fast_path": False}}, "weights.fast_path", {"kind": "files"}),  # YAML's bare `off`
    ({"weights": {"fast_path": "gloo", "files_every_s": 0}}, "weights.fast_path, weights.files_every_s",
     {"kind": "process_group", "backend": "gloo", "files_every_s": 0.0}),
    ({"rollout": {"engine": "sglang", "server": {"weight_sync": "distributed"}}}, "rollout.server.weight_sync",
     {"kind": "server"}),
])
def test_deprecated_keys_are_translated_with_a_warning(sections: dict[str, Any], old: str,
                                                       want: dict[str, Any]) -> None:
    c = cfg(mode="fully_async", **sections)
    with pytest.warns(FutureWarning, match="deprecated, use weights.transport") as got:
        t = resolve(c)
    assert t.model_dump() == want
    assert str(got[0].message).startswith(f"{old}: deprecated") and f"kind={want['kind']}" in str(got[0].message)


def test_old_keys_at_their_defaults_change_nothing() -> None:
    """A run dir's config.json holds every key: at their defaults the old keys are no warning and no conflict."""
    from relax_hpc.config.load import config_to_json

    for sections in ({"mode": "fully_async", "weights": {"transport": {"kind": "files"}}},
                     {"mode": "fully_async", "rollout": {"engine": "vllm", "server": {"weight_sync": "files"}}},
                     {"weights": {"fast_path": "auto", "files_every_s": 10}}):
        c = cfg(**sections)
        again = validate_dict(config_to_json(c))
        assert quiet(again) == quiet(c)


def test_deprecated_keys_do_not_change_colocate() -> None:
    with pytest.warns(FutureWarning):
        assert resolve(cfg(weights={"fast_path": "off"})).kind == "memory"


@pytest.mark.parametrize(("sections", "message"), [
    ({"mode": "colocate", "weights": {"transport": {"kind": "process_group"}}},
     "weights.transport.kind=process_group: not a transport of mode colocate (use auto or memory or files)"),
    ({"mode": "colocate", "rollout": {"engine": "vllm"}, "weights": {"transport": {"kind": "memory"}}},
     "weights.transport.kind=memory: rollout.engine=vllm generates in its own server process; in colocate it loads "
     "each version's files (use files or auto)"),
    ({"mode": "colocate", "weights": {"transport": {"kind": "files"}}},
     "weights.transport.kind=files: in colocate the hf engine generates with the trainer's own weights (use memory "
     "or auto)"),
    ({"mode": "fully_async", "weights": {"transport": {"kind": "memory"}}},
     "weights.transport.kind=memory: not a transport of mode fully_async"),
    ({"mode": "fully_async", "rollout": {"engine": "vllm"}, "weights": {"transport": {"kind": "process_group"}}},
     "weights.transport.kind=process_group: rollout.engine=vllm is a server engine; use server or files"),
    ({"mode": "fully_async", "weights": {"transport": {"kind": "server"}}},
     "weights.transport.kind=server: rollout.engine=hf has no server; use process_group or files"),
    ({"mode": "fully_async", "weights": {"transport": {"kind": "files"}, "fast_path": "off"}},
     "weights.fast_path: deprecated and not allowed beside weights.transport.kind=files"),
])
def test_a_transport_the_run_cannot_use_is_refused(sections: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="^" + re.escape(message)) as got:
        resolve(cfg(**sections))
    assert "\n" not in str(got.value)


def test_unknown_kind_and_options_of_another_kind_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"weights\.transport") as got:
        cfg(weights={"transport": {"kind": "carrier_pigeon"}})
    assert "carrier_pigeon" in str(got.value)
    with pytest.raises(ConfigError, match="backend"):  # process_group's option under files
        cfg(weights={"transport": {"kind": "files", "backend": "gloo"}})


def test_cli_refuses_an_unknown_transport_in_one_line(tmp_path: Path) -> None:
    from tests.helpers.runutil import DEMO, cli

    proc = cli("validate", str(DEMO), "--set", "weights.transport.kind=carrier_pigeon", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error:") and "Traceback" not in proc.stderr, proc.stderr


def test_cli_refuses_a_transport_the_mode_cannot_use_and_warns_of_old_keys() -> None:
    from tests.helpers.runutil import DEMO, cli

    proc = cli("validate", str(DEMO), "--no-preflight", "--set", "weights.transport.kind=process_group", timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: weights.transport.kind=process_group: not a transport of mode colocate "
                                   "(use auto or memory or files)"), proc.stderr
    proc = cli("validate", str(DEMO), "--no-preflight", "--set", "mode=fully_async", "--set",
               "weights.fast_path=off", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == ("warning: weights.fast_path: deprecated, use weights.transport (this recipe: "
                                   "weights.transport.kind=files); see docs/protocol.md, Weight transport"), proc.stderr
