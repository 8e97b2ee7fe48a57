"""Prompts with media reach the inference servers as their own media fields (``relax_hpc/rollout/server/media.py``):

* the encoding: paths, bytes and decoded audio become ``data:`` URLs that decode back to the same media;
* SGLang (the stand-in of ``tests/helpers/sglang_standin.py``: SGLang cannot run on these machines): ``/generate`` with
  ``image_data`` / ``audio_data`` / ``video_data`` passes its schema check, which decodes every item (images with
  PIL), and the server gets the compact prompt ids (one placeholder per item); malformed media are answered 400;
* vLLM: the engine's ``/inference/v1/generate`` body (``token_ids`` + ``content_parts``) validates against vLLM
  0.32's own request model, run in the vLLM venv (the tiny CPU model is text-only, so no server decodes an image
  here); ``tests/integration/test_engine_vllm.py`` sends that endpoint a text prompt on a real server.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from relax_hpc.rollout.engine import GenerateRequest, SamplingParams
from relax_hpc.rollout.server.media import data_url, sglang_fields, vllm_content_parts
from relax_hpc.rundir import RunDir
from tests.helpers.server_util import recipe

STANDIN = Path(__file__).parents[1] / "helpers" / "sglang_standin.py"


def _png(color: tuple[int, int, int] = (255, 0, 0)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 6), color).save(buf, format="PNG")
    return buf.getvalue()


def _decode(url: str) -> tuple[str, bytes]:
    head, b64 = url.split(";base64,", 1)
    return head[len("data:"):], base64.b64decode(b64)


def test_data_urls_round_trip(tmp_path: Path) -> None:
    import soundfile

    png = _png()
    path = tmp_path / "red.png"
    path.write_bytes(png)
    assert _decode(data_url(path, "image")) == ("image/png", png)
    assert _decode(data_url(png, "image")) == ("image/png", png)
    jpeg = io.BytesIO()
    from PIL import Image

    Image.new("RGB", (4, 4)).save(jpeg, format="JPEG")
    assert _decode(data_url(jpeg.getvalue(), "image"))[0] == "image/jpeg"
    tone = (np.sin(np.arange(1600) / 5).astype(np.float32) * 0.5, 16000)
    mime, wav = _decode(data_url(tone, "audio"))
    back, rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    assert mime == "audio/wav" and rate == 16000 and np.abs(back - tone[0]).max() < 1e-4
    media = {"image": [png, path], "audio": [tone]}
    fields = sglang_fields(media)
    assert sorted(fields) == ["audio_data", "image_data"] and len(fields["image_data"]) == 2
    parts = vllm_content_parts(media)
    assert [p["type"] for p in parts] == ["image_url", "image_url", "audio_url"]
    assert sglang_fields(None) == {} and vllm_content_parts({}) == []
    with pytest.raises(ValueError, match="unknown media kinds"):
        sglang_fields({"pointcloud": [b"x"]})


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory):
    from relax_hpc.models.tiny import build_digits_tokenizer
    from relax_hpc.rollout.server import make_server_engine

    rd = RunDir.create(tmp_path_factory.mktemp("media") / "run")
    # strict: an unknown field is a 400 (SGLang would ignore it); deterministic: the requests below are seeded
    cfg = recipe("sglang", rd.root, command=f"{sys.executable} {STANDIN}",
                 env={"PYTHONPATH": os.getcwd(), "SGLANG_STANDIN_STRICT": "1"})
    cfg.rollout.sglang.server_args = {"enable_deterministic_inference": True}
    engine = make_server_engine(cfg, run_dir=rd, proc="rollout-0", device="cpu", seed=0,
                                tokenizer=build_digits_tokenizer())
    asyncio.run(engine.ensure_started())
    yield engine, rd
    asyncio.run(engine.close())


@pytest.mark.integration
def test_sglang_media_fields_pass_the_standin_schema(standin, tmp_path: Path) -> None:
    engine, rd = standin
    img = tmp_path / "blue.png"
    img.write_bytes(_png((0, 0, 255)))
    tone = (np.zeros(800, np.float32), 8000)
    expanded = [1, 5, 9, 9, 9, 9, 6, 17]  # what the trainer sees: the image placeholder expanded (4 tokens here)
    compact = [1, 5, 9, 6, 17]  # what the server gets: one placeholder per item
    req = GenerateRequest(request_id="mm", prompt_ids=expanded, engine_prompt_ids=compact,
                          media={"image": [img, _png()], "audio": [tone]},
                          sampling=SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=1))
    res = asyncio.run(engine.generate(req))
    assert [len(s.token_ids) for s in res.samples] == [len(s.logprobs) for s in res.samples]
    assert all(len(s.token_ids) > 0 for s in res.samples)
    log = rd.server_log("rollout-0-0").read_text()
    lines = [x for x in log.splitlines() if x.startswith("media of mm.")]
    assert len(lines) == 2, log[-2000:]  # one request per sample
    assert all("image image/png" in x and "audio audio/wav" in x and f"prompt ids {compact}" in x for x in lines)
    # a text prompt sends no media fields and its own ids
    text = asyncio.run(engine.generate(GenerateRequest("txt", [1, 5, 6, 17], SamplingParams(max_new_tokens=3))))
    assert len(text.samples[0].token_ids) > 0


@pytest.mark.integration
def test_standin_rejects_malformed_media(standin) -> None:
    engine, _ = standin
    base = engine.generate_body("bad", [1, 5, 17], {"max_new_tokens": 2}, None)
    bad = [{"image_data": ["/not/a/data/url.png"]}, {"image_data": ["data:image/png;base64,AAAA"]},
           {"audio_data": ["data:image/png;base64," + base64.b64encode(_png()).decode()]}]
    with httpx.Client(trust_env=False, timeout=30) as c:
        for extra in bad:
            r = c.post(engine.url + "/generate", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
        ok = {**base, **engine.generate_body("ok", [1, 5, 17], {"max_new_tokens": 2}, {"image": [_png()]})}
        assert c.post(engine.url + "/generate", json=ok).status_code == 200


@pytest.mark.slow
def test_vllm_media_body_is_what_vllm_accepts(tmp_path: Path) -> None:
    """The body validates against ``GenerateRequest`` of vLLM's token-in/token-out endpoint (vLLM's own pydantic
    model, in the vLLM venv), its content parts name the image/audio/video URL types vLLM parses into the prompt's
    ``multi_modal_data``, and its sampling params build vLLM's ``SamplingParams``."""
    from relax_hpc.config.load import validate_dict
    from relax_hpc.rollout.server.base import ServerSetup
    from relax_hpc.rollout.server.vllm import VLLMEngine, vllm_venv_python

    py = vllm_venv_python()
    if py is None:
        if os.environ.get("RELAX_REQUIRE_VLLM") == "1":
            pytest.fail("RELAX_REQUIRE_VLLM=1 but the vLLM venv is missing: bash tools/install.sh --vllm")
        pytest.skip("no vLLM venv (bash tools/install.sh --vllm)")
    cfg = validate_dict({"rollout": {"engine": "vllm"}, "data": {"task": {"name": "reverse_digits"}}}).rollout.server
    engine = VLLMEngine(cfg, ServerSetup(name="x-0", model_dir=tmp_path, record=tmp_path / "r.json",
                                         log=tmp_path / "x.log", device="cpu"))
    media = {"image": [_png()], "audio": [(np.zeros(400, np.float32), 8000)], "video": [b"\x00\x00\x00\x18ftypmp42"]}
    body = engine.media_body("mm-1", [1, 5, 9, 9, 17], SamplingParams(temperature=0.7, top_k=5, seed=3,
                                                                      stop_token_ids=(2,)), 16, 4, media)
    (tmp_path / "body.json").write_text(json.dumps(body))
    check = (
        "import json, sys\n"
        "from pydantic import ValidationError\n"
        "from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest\n"
        "body = json.load(open(sys.argv[1]))\n"
        "req = GenerateRequest.model_validate(body)\n"
        "sp = req.sampling_params\n"
        "try:\n"
        "    GenerateRequest.model_validate({k: v for k, v in body.items() if k != 'token_ids'})\n"
        "    refused = False\n"
        "except ValidationError:\n"
        "    refused = True\n"
        "print(json.dumps({'n': sp.n, 'max_tokens': sp.max_tokens, 'logprobs': sp.logprobs, 'top_k': sp.top_k,\n"
        "                  'seed': sp.seed, 'detokenize': sp.detokenize, 'stop_token_ids': list(sp.stop_token_ids),\n"
        "                  'parts': [p['type'] for p in req.content_parts], 'ids': req.token_ids,\n"
        "                  'mode': req.output_mode, 'refused_without_ids': refused}))\n")
    res = subprocess.run([str(py), "-c", check, str(tmp_path / "body.json")], capture_output=True, text=True,
                         timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"n": 4, "max_tokens": 16, "logprobs": 0, "top_k": 5, "seed": 3, "detokenize": False,
                   "stop_token_ids": [2], "parts": ["image_url", "audio_url", "video_url"],
                   "ids": [1, 5, 9, 9, 17], "mode": "tokens", "refused_without_ids": True}
    # the media decode back to what the prompt named
    urls = [p["url"] for p in body["content_parts"]]
    assert _decode(urls[0]) == ("image/png", _png()) and _decode(urls[2])[0] == "video/mp4"
