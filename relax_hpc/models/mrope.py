"""3-D rotary positions (M-RoPE) of Qwen-VL and Qwen-Omni models, per sample, for packed micro-batches.

These models place text on one axis and each image/video patch at (t, h, w) (video ``t`` scaled by seconds per grid;
Omni thinkers also interleave audio, and with ``use_audio_in_video`` a video's audio inside it, chunk by chunk: decided
per sample from its tokens, :meth:`MRope.audio_in_video`). A packed row holds several samples, so the model
cannot compute these positions itself; :class:`MRope` computes each sample's ``[3, L]`` positions with the model's own
``get_rope_index`` (as ``generate`` does, one sample at a time), and the micro-batch passes ``position_ids`` of shape
``[4, R, W]``: row 0 the text positions that restart at every sequence (the models build the block-diagonal mask from
it), rows 1-3 the (t, h, w) positions. The media tensors of a micro-batch's samples are concatenated in the order the
samples appear in the flattened rows, which is the order the model scatters encoder outputs into placeholder tokens.

Encoders that a micro-batch does not use still run once on a dummy input whose output is added with weight 0
(:meth:`MRope.unused_encoders`): every rank of a sharded (FSDP) run then executes the same modules in every
micro-batch, so none waits forever on the others' parameter gathers.
"""

from __future__ import annotations

from typing import Any

VL_TYPES = {"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"}
OMNI_TYPES = {"qwen2_5_omni_thinker", "qwen3_omni_moe_thinker"}
_CAT = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts",
        "input_features", "feature_attention_mask")


def _family(model: Any) -> str | None:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    return "vl" if mt in VL_TYPES else "omni" if mt in OMNI_TYPES else None


class MRope:
    """Per-sample 3-D positions and packed model inputs for a VL or Omni model (``MRope.of(model)``; None for
    other models)."""

    def __init__(self, model: Any, family: str, *, use_audio_in_video: bool = False):
        self.model = model
        self.family = family
        self.use_audio_in_video = use_audio_in_video
        cfg = model.config
        self.image_token_id = getattr(cfg, "image_token_id", None) or getattr(cfg, "image_token_index", None)
        self.video_token_id = getattr(cfg, "video_token_id", None) or getattr(cfg, "video_token_index", None)
        self.audio_token_id = getattr(cfg, "audio_token_id", None) or getattr(cfg, "audio_token_index", None)
        self.placeholder_ids = [t for t in (self.image_token_id, self.video_token_id, self.audio_token_id)
                                if t is not None]
        self.vision_start_id = getattr(cfg, "vision_start_token_id", None)
        self.audio_start_id = getattr(cfg, "audio_start_token_id", None)

    def audio_in_video(self, ids: Any) -> bool:
        """Whether a sample's videos carry their audio interleaved (``use_audio_in_video``): the Omni processors
        then open each video with ``<vision_start><audio_start>`` and alternate video and audio tokens chunk by
        chunk. Decided per sample from its tokens (or always, with ``use_audio_in_video=True``)."""
        if self.use_audio_in_video:
            return True
        if self.family != "omni" or self.vision_start_id is None or self.audio_start_id is None or len(ids) < 2:
            return False
        return bool(((ids[:-1] == self.vision_start_id) & (ids[1:] == self.audio_start_id)).any())

    @classmethod
    def of(cls, model: Any) -> MRope | None:
        fam = _family(model)
        return None if fam is None else cls(model, fam)

    def _rope_owner(self) -> Any:
        m = self.model
        return m if hasattr(m, "get_rope_index") else m.model

    def positions(self, ids: Any, mm: dict[str, Any]) -> Any:
        """[3, L] positions of one sample (``ids`` [L] long) with its media tensors ``mm`` (torch)."""
        import torch

        ids2 = ids.view(1, -1)
        owner = self._rope_owner()
        with torch.no_grad():
            if self.family == "vl":
                types = torch.zeros_like(ids2, dtype=torch.int32)
                types[ids2 == self.image_token_id] = 1
                types[ids2 == self.video_token_id] = 2
                kw = {"second_per_grid_ts": mm["second_per_grid_ts"]} if "second_per_grid_ts" in mm else {}
                pos, _ = owner.get_rope_index(ids2, mm_token_type_ids=types, image_grid_thw=mm.get("image_grid_thw"),
                                              video_grid_thw=mm.get("video_grid_thw"), **kw)
            else:
                fam = mm.get("feature_attention_mask")
                pos, _ = owner.get_rope_index(ids2, image_grid_thw=mm.get("image_grid_thw"),
                                              video_grid_thw=mm.get("video_grid_thw"),
                                              attention_mask=torch.ones_like(ids2),
                                              use_audio_in_video=self.audio_in_video(ids),
                                              audio_seqlens=None if fam is None else fam.sum(-1),
                                              second_per_grids=mm.get("second_per_grid_ts"))
        return pos[:, 0]

    def model_kwargs(self, mms: list[dict[str, Any]]) -> dict[str, Any]:
        """The forward keyword arguments of samples' media, concatenated in sample order (names as the model
        takes them)."""
        import torch

        out: dict[str, Any] = {}
        for k in _CAT:
            parts = [mm[k] for mm in mms if k in mm]
            if parts:
                out[k] = torch.cat([torch.as_tensor(p) for p in parts])
        if self.family == "omni" and "second_per_grid_ts" in out:
            out["video_second_per_grid"] = out.pop("second_per_grid_ts")
        if self.family == "vl" and "second_per_grid_ts" in out and _family_type(self.model) != "qwen2_5_vl":
            out.pop("second_per_grid_ts")  # only Qwen2.5-VL's forward takes it
        return out

    # ------------------------------------------------------------------------------------------ dummy encoders
    def unused_encoders(self, used: set[str]) -> Any:
        """0 x (sum of the outputs of the encoders not in ``used``) on tiny dummy inputs: a scalar to add to the
        loss so every encoder runs in every micro-batch (``used``: subset of {"vision", "audio"})."""
        import torch

        inner = self.model.model if hasattr(self.model, "model") else self.model
        total: Any = None
        visual = getattr(inner, "visual", None)
        if visual is not None and "vision" not in used:
            vc = visual.config
            tp = getattr(vc, "temporal_patch_size", 2)
            m = getattr(vc, "spatial_merge_size", 2)
            dim = getattr(vc, "in_channels", 3) * tp * vc.patch_size**2
            param = next(visual.parameters())
            grid = torch.tensor([[1, m, m]], device=param.device)
            out = visual(torch.zeros(m * m, dim, dtype=param.dtype, device=param.device), grid_thw=grid)
            total = _sum_all(out)
        audio = getattr(inner, "audio_tower", None)
        if audio is not None and "audio" not in used:
            param = next(audio.parameters())
            n = 2 * getattr(audio.config, "n_window", 50)
            feats = torch.zeros(audio.config.num_mel_bins, n, dtype=param.dtype, device=param.device)
            out = audio(feats, feature_lens=torch.tensor([n], device=param.device))
            s = _sum_all(out)
            total = s if total is None else total + s
        return None if total is None else total * 0.0


def _family_type(model: Any) -> str:
    return str(getattr(model.config, "model_type", ""))


def _sum_all(out: Any) -> Any:
    """Sum of every floating tensor in an encoder output (a tensor, a tuple, or a ModelOutput)."""
    import torch

    if isinstance(out, torch.Tensor):
        return out.float().sum() if out.is_floating_point() else out.new_zeros((), dtype=torch.float32)
    vals = out.values() if hasattr(out, "values") else out
    total = None
    for v in vals:
        if isinstance(v, (torch.Tensor, tuple, list)) or hasattr(v, "values"):
            s = _sum_all(v)
            total = s if total is None else total + s
    return total if total is not None else torch.zeros(())


def used_encoders(mm: dict[str, Any]) -> set[str]:
    """Which encoders a sample's media tensors feed."""
    used = set()
    if "pixel_values" in mm or "pixel_values_videos" in mm:
        used.add("vision")
    if "input_features" in mm:
        used.add("audio")
    return used


def packed_inputs(model: Any, mb: Any) -> tuple[Any, dict[str, Any]]:
    """(position_ids, model kwargs) for micro-batch ``mb`` on ``model``: for a VL/Omni model, ``[4, R, W]``
    positions (see the module docstring), its samples' media concatenated in layout order, and the unused encoders'
    zero-weighted dummy output as ``"_encoder_dummy"``; for other models, ``mb``'s own.

    Only prompt tokens are media placeholders: a response may contain a placeholder token (a policy can sample any
    token), which generation embedded as the plain token and positioned as text. Such tokens are hidden from the
    model's placeholder matching (``"_input_ids"`` has them replaced) while a one-shot hook on the input embeddings
    puts their own embedding back, so the trainer computes what the engine computed."""
    import torch

    rope = MRope.of(model)
    if rope is None:
        return mb.position_ids, mb.model_kwargs
    R, W = mb.input_ids.shape
    flat_ids = mb.input_ids.reshape(-1)
    text = mb.position_ids.reshape(-1)
    pos3 = text.view(1, -1).repeat(3, 1)
    in_prompt = torch.zeros_like(flat_ids, dtype=torch.bool)
    mms = [it.sample.model_inputs() for it in mb.items]
    order = sorted(range(len(mb.items)), key=lambda i: int(mb.seq_starts[i]))
    used: set[str] = set()
    for i in order:
        st, n_prompt, n = int(mb.seq_starts[i]), len(mb.items[i].sample.prompt_ids), mb.items[i].num_tokens
        in_prompt[st:st + n_prompt] = True
        if not mms[i]:
            continue
        mms[i] = {k: torch.as_tensor(v).to(flat_ids.device) for k, v in mms[i].items()}
        prompt_pos = rope.positions(flat_ids[st:st + n_prompt], mms[i]).to(pos3.dtype)
        pos3[:, st:st + n_prompt] = prompt_pos
        pos3[:, st + n_prompt:st + n] = prompt_pos.max() + 1 + torch.arange(n - n_prompt, device=pos3.device)
        used |= used_encoders(mms[i])
    kwargs = rope.model_kwargs([mms[i] for i in order if mms[i]])
    stray = torch.isin(flat_ids, torch.tensor(rope.placeholder_ids, device=flat_ids.device)) & ~in_prompt
    if bool(stray.any()):
        kwargs["_input_ids"] = _hide_stray_placeholders(model, mb.input_ids, stray.view(R, W))
    dummy = rope.unused_encoders(used)
    if dummy is not None:
        kwargs["_encoder_dummy"] = dummy
    return torch.cat([text.view(1, R, W), pos3.view(3, R, W)]), kwargs


def _hide_stray_placeholders(model: Any, ids: Any, stray: Any) -> Any:
    """``ids`` with the ``stray`` placeholder tokens replaced by a text token, plus a hook on the input embeddings
    that restores their own embedding in the next forward (and removes itself)."""
    emb = model.get_input_embeddings()
    old = getattr(emb, "_relax_stray_hook", None)
    if old is not None:
        old.remove()
    substitute = int(getattr(model.config, "pad_token_id", None) or 0)
    hidden = ids.masked_fill(stray, substitute)

    def restore(module: Any, args: Any, out: Any) -> Any:
        handle.remove()
        module._relax_stray_hook = None
        if out.shape[:2] != ids.shape:
            return out
        return out.where(~stray[..., None], module.weight[ids].to(out.dtype))

    handle = emb.register_forward_hook(restore)
    emb._relax_stray_hook = handle
    return hidden


def generate_kwargs(model: Any, mm: dict[str, Any]) -> dict[str, Any]:
    """One prompt's media tensors named as ``model.generate`` takes them (Omni thinkers: ``video_second_per_grid``;
    Qwen2-VL and Qwen3-VL take no seconds per grid); other models get ``mm`` unchanged."""
    fam = _family(model)
    out = dict(mm)
    if "second_per_grid_ts" in out and (fam == "omni" or (fam == "vl" and _family_type(model) != "qwen2_5_vl")):
        value = out.pop("second_per_grid_ts")
        if fam == "omni":
            out["video_second_per_grid"] = value
    return out
