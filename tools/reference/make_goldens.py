#!/usr/bin/env python3
"""Golden outputs of Hugging Face transformers for mlaserve's parity tests.

For each checkpoint directory (HF layout: config.json + model.safetensors or sharded
model-*.safetensors with model.safetensors.index.json), this loads the model with
transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM (picked from config.json
`architectures`) in float32 on CPU, refuses to go on if any weight was missing (randomly
initialised), and writes

    <outdir>/<preset>/golden.safetensors   float32 tensors
    <outdir>/<preset>/golden.json          token ids, tensor names/shapes, versions, checks

Cases (see tools/reference/README.md for the exact definitions):
    prefill_logits [P, vocab], prefill_hidden [P, hidden]   P = 40 prompt tokens
    decode_logits  [8, vocab]       8 one-token steps on the KV cache after the prompt
    long_logits    [L, vocab]       L = 100 > rope original_max_position_embeddings
    mtp{d}_hidden, mtp{d}_logits    every MTP layer d (num_nextn_predict_layers > 0),
                                    from an independent float64 oracle written here

The float64 oracle (class Oracle) re-implements the whole model from the raw safetensors;
its agreement with transformers (whole model and layer by layer) is checked and printed,
and a transformers-built MTP block (float32) cross-checks the MTP goldens.

Usage:
    python tools/reference/make_goldens.py --out tests/golden DIR [DIR ...]
    python tools/reference/make_goldens.py --out tests/golden tiny-v3=/tmp/m/v3 tiny-v2=/tmp/m/v2
A plain DIR takes its preset name from the directory's basename; NAME=DIR names it.
"""

import argparse
import hashlib
import json
import math
import os
import platform
import re
import sys

import numpy as np
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

P_LEN = 40  # prompt length
N_DECODE = 8  # decode steps
L_LEN = 100  # long prompt (longer than original_max_position_embeddings = 64)


def prompt_ids(vocab):
    # ids 0/1 are BOS/EOS in the presets: avoid them.
    return [(i * 37 + 11) % (vocab - 2) + 2 for i in range(P_LEN)]


def decode_ids(vocab):
    return [(i * 53 + 29) % (vocab - 2) + 2 for i in range(N_DECODE)]


def long_ids(vocab):
    return [(i * 59 + 5) % (vocab - 2) + 2 for i in range(L_LEN)]


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------------------
# checkpoint reading
# --------------------------------------------------------------------------------------


def load_raw(ckpt):
    """All tensors of the checkpoint, by HF name, in their stored dtype."""
    idx = os.path.join(ckpt, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(os.path.join(ckpt, fn), framework="pt") as sf:
            for k in sf.keys():
                if k in out:
                    raise SystemExit(f"{ckpt}: tensor {k} appears in two shards")
                out[k] = sf.get_tensor(k)
    return out


def rope_params(cfg):
    """The rope dict the way transformers 5 standardises it (rope_scaling -> rope_parameters)."""
    rp = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    rp.setdefault("rope_type", rp.get("type", "default"))
    rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if rp["rope_type"] == "yarn":
        rp.setdefault("original_max_position_embeddings", cfg["max_position_embeddings"])
    return rp


# --------------------------------------------------------------------------------------
# float64 oracle
# --------------------------------------------------------------------------------------


def yarn_get_mscale(scale=1.0, mscale=1.0):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


class Oracle:
    """Hand-written float64 DeepSeek-V2/V3 forward that follows transformers' semantics."""

    def __init__(self, cfg, raw):
        self.cfg = cfg
        arch = cfg["architectures"][0]
        self.v3 = arch == "DeepseekV3ForCausalLM"
        self.w = {k: v.to(torch.float64) for k, v in raw.items()}
        c = cfg
        self.H = c["hidden_size"]
        self.nh = c["num_attention_heads"]
        self.nope = c["qk_nope_head_dim"]
        self.rope_dim = c["qk_rope_head_dim"]
        self.vdim = c["v_head_dim"]
        self.kvr = c["kv_lora_rank"]
        self.qr = c.get("q_lora_rank")
        self.eps = c.get("rms_norm_eps", 1e-6)
        self.N = c["num_hidden_layers"]
        if c.get("hidden_act", "silu") != "silu":
            raise SystemExit(f"oracle: hidden_act {c.get('hidden_act')!r} not supported")
        if (c.get("num_key_value_heads") or self.nh) != self.nh:
            raise SystemExit("oracle: num_key_value_heads != num_attention_heads not supported")
        rp = rope_params(c)
        self.rp = rp
        base = float(rp["rope_theta"])
        dim = self.rope_dim
        i2 = torch.arange(0, dim, 2, dtype=torch.float64)
        pos_freqs = base ** (i2 / dim)
        if rp["rope_type"] == "default":
            self.inv_freq = 1.0 / pos_freqs
            self.attn_factor = 1.0
        elif rp["rope_type"] == "yarn":
            factor = rp.get("factor")
            orig = rp["original_max_position_embeddings"]
            if factor is None:
                factor = c["max_position_embeddings"] / orig
            factor = float(factor)
            mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
            af = rp.get("attention_factor")
            if af is None:
                if mscale and mscale_all:
                    af = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all)
                else:
                    af = yarn_get_mscale(factor)
            self.attn_factor = float(af)
            beta_fast = rp.get("beta_fast") or 32
            beta_slow = rp.get("beta_slow") or 1

            def corr_dim(nrot):
                return (dim * math.log(orig / (nrot * 2 * math.pi))) / (2 * math.log(base))

            low, high = corr_dim(beta_fast), corr_dim(beta_slow)
            if rp.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
            extrap = 1.0 - ramp  # 1 = keep the original frequency
            self.inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
        else:
            raise SystemExit(f"oracle: rope_type {rp['rope_type']!r} not supported")
        self.scale = (self.nope + self.rope_dim) ** -0.5
        if rp["rope_type"] != "default" and rp.get("mscale_all_dim"):
            m = yarn_get_mscale(float(rp["factor"]), rp["mscale_all_dim"])
            self.scale *= m * m
        self.interleave = (not self.v3) or c.get("rope_interleave", True)
        self.margins = {}  # layer -> smallest routing gaps seen (near-ties make goldens fragile)

    def _note_margin(self, l, kind, sorted_desc, k):
        if sorted_desc.shape[-1] <= k:
            return
        gap = float((sorted_desc[:, k - 1] - sorted_desc[:, k]).min())
        m = self.margins.setdefault(f"layer{l}", {})
        m[kind] = min(m.get(kind, float("inf")), gap)

    # -- primitives ------------------------------------------------------------------
    def t(self, name):
        return self.w[name]

    @staticmethod
    def rms(x, w, eps):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    @staticmethod
    def lin(x, w):
        return x @ w.T

    def rope(self, x, pos):
        """x [..., T, r], pos [T] float64 positions. Interleaved pairs (x[2i], x[2i+1])."""
        ang = pos[:, None].to(torch.float64) * self.inv_freq[None, :]  # [T, r/2]
        cos, sin = ang.cos() * self.attn_factor, ang.sin() * self.attn_factor
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:  # rotate_half layout (V3 with rope_interleave = false)
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        # Any fixed layout works for q.k as long as q and k share it.
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def mlp(self, p, x):
        g = self.lin(x, self.t(p + "gate_proj.weight"))
        u = self.lin(x, self.t(p + "up_proj.weight"))
        return self.lin(torch.nn.functional.silu(g) * u, self.t(p + "down_proj.weight"))

    # -- attention (expanded MLA, causal over the given sequence) ---------------------
    def attn(self, l, x, pos):
        p = f"model.layers.{l}.self_attn."
        T = x.shape[0]
        qk = self.nope + self.rope_dim
        if self.qr:
            # transformers builds q_a_layernorm / kv_a_layernorm with the default eps 1e-6,
            # not config.rms_norm_eps.
            cq = self.rms(self.lin(x, self.t(p + "q_a_proj.weight")), self.t(p + "q_a_layernorm.weight"), 1e-6)
            q = self.lin(cq, self.t(p + "q_b_proj.weight"))
        else:
            q = self.lin(x, self.t(p + "q_proj.weight"))
        q = q.view(T, self.nh, qk).transpose(0, 1)  # [nh, T, qk]
        q_nope, q_pe = q[..., : self.nope], q[..., self.nope :]
        ckv = self.lin(x, self.t(p + "kv_a_proj_with_mqa.weight"))
        c, k_pe = ckv[:, : self.kvr], ckv[:, self.kvr :]
        c = self.rms(c, self.t(p + "kv_a_layernorm.weight"), 1e-6)
        kv = self.lin(c, self.t(p + "kv_b_proj.weight")).view(T, self.nh, self.nope + self.vdim).transpose(0, 1)
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        q_pe = self.rope(q_pe, pos)
        k_pe = self.rope(k_pe, pos)  # [T, r], shared by all heads
        s = (q_nope @ k_nope.transpose(-1, -2) + q_pe @ k_pe.T) * self.scale  # [nh, T, T]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        s = s.masked_fill(~causal, float("-inf"))
        o = torch.softmax(s, dim=-1) @ v  # [nh, T, v]
        o = o.transpose(0, 1).reshape(T, self.nh * self.vdim)
        return self.lin(o, self.t(p + "o_proj.weight"))

    # -- MoE --------------------------------------------------------------------------
    def route(self, l, x):
        """(weights [T, k], indices [T, k]) exactly as transformers' router."""
        c = self.cfg
        p = f"model.layers.{l}.mlp.gate."
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        logits = self.lin(x, self.t(p + "weight"))
        if self.v3:
            scores = logits.sigmoid()
            choice = scores + self.t(p + "e_score_correction_bias")
            G = c["n_group"]
            gs = choice.view(-1, G, E // G).topk(2, dim=-1).values.sum(-1)
            gidx = gs.topk(c["topk_group"], dim=-1).indices
            self._note_margin(l, "group_score_gap", gs.sort(-1, descending=True).values, c["topk_group"])
            gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
            smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
            choice = choice.masked_fill(~smask, float("-inf"))
            idx = choice.topk(k, dim=-1).indices
            self._note_margin(l, "expert_choice_gap", choice.sort(-1, descending=True).values, k)
            wts = scores.gather(1, idx)
            if c.get("norm_topk_prob", True):
                wts = wts / (wts.sum(-1, keepdim=True) + 1e-20)
            wts = wts * c["routed_scaling_factor"]
        else:
            scores = logits.softmax(-1)
            method = c.get("topk_method", "greedy")
            if method == "greedy":
                wts, idx = scores.topk(k, dim=-1)
                self._note_margin(l, "expert_choice_gap", scores.sort(-1, descending=True).values, k)
            elif method == "group_limited_greedy":
                G = c["n_group"]
                gs = scores.view(-1, G, E // G).max(dim=-1).values
                gidx = gs.topk(c["topk_group"], dim=-1).indices
                gmask = torch.zeros_like(gs).scatter_(1, gidx, 1.0)
                smask = gmask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
                self._note_margin(l, "group_score_gap", gs.sort(-1, descending=True).values, c["topk_group"])
                masked = scores.masked_fill(~smask, 0.0)
                wts, idx = masked.topk(k, dim=-1)
                self._note_margin(l, "expert_choice_gap", masked.sort(-1, descending=True).values, k)
            else:
                raise SystemExit(f"oracle: V2 topk_method {method!r} not supported by transformers")
            # transformers' V2 router never normalises (ignores norm_topk_prob).
            wts = wts * c.get("routed_scaling_factor", 1.0)
        return wts, idx

    def moe(self, l, x):
        c = self.cfg
        wts, idx = self.route(l, x)
        out = torch.zeros_like(x)
        for e in range(c["n_routed_experts"]):
            rows, slot = (idx == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = self.mlp(f"model.layers.{l}.mlp.experts.{e}.", x[rows])
            out.index_add_(0, rows, y * wts[rows, slot, None])
        if c.get("n_shared_experts"):
            out = out + self.mlp(f"model.layers.{l}.mlp.shared_experts.", x)
        return out

    def is_moe(self, l):
        c = self.cfg
        if not c.get("n_routed_experts"):
            return False
        # transformers: MoE iff layer_idx >= first_k_dense_replace (moe_layer_freq is ignored).
        return l >= c.get("first_k_dense_replace", 0)

    def block(self, l, h, pos):
        p = f"model.layers.{l}."
        h = h + self.attn(l, self.rms(h, self.t(p + "input_layernorm.weight"), self.eps), pos)
        x = self.rms(h, self.t(p + "post_attention_layernorm.weight"), self.eps)
        return h + (self.moe(l, x) if self.is_moe(l) else self.mlp(p + "mlp.", x))

    def head(self):
        if "lm_head.weight" in self.w:
            return self.t("lm_head.weight")
        return self.t("model.embed_tokens.weight")  # tie_word_embeddings

    def target(self, ids):
        """(final-normed last hidden [T, H], logits [T, V]) of the target model."""
        h = self.t("model.embed_tokens.weight")[torch.tensor(ids)]
        pos = torch.arange(len(ids), dtype=torch.float64)
        for l in range(self.N):
            h = self.block(l, h, pos)
        hn = self.rms(h, self.t("model.norm.weight"), self.eps)
        return hn, self.lin(hn, self.head())

    def mtp(self, ids, h_target):
        """[(block_out [n_d, H], logits [n_d, V])] for every MTP layer d, n_d = T - 1 - d."""
        T = len(ids)
        prev = h_target
        outs = []
        for d in range(self.cfg.get("num_nextn_predict_layers", 0) or 0):
            l = self.N + d
            p = f"model.layers.{l}."
            n = T - 1 - d
            emb_w = self.w.get(p + "embed_tokens.weight", self.t("model.embed_tokens.weight"))
            e = emb_w[torch.tensor(ids[d + 1 : d + 1 + n])].clone()
            pos = torch.arange(n, dtype=torch.float64)
            e[pos == 0] = 0.0  # vLLM: inputs_embeds[positions == 0] = 0
            x = torch.cat(
                [self.rms(e, self.t(p + "enorm.weight"), self.eps), self.rms(prev[:n], self.t(p + "hnorm.weight"), self.eps)],
                dim=-1,
            )
            x = self.lin(x, self.t(p + "eh_proj.weight"))
            out = self.block(l, x, pos)
            head = self.w.get(p + "shared_head.head.weight", self.head())
            logits = self.lin(self.rms(out, self.t(p + "shared_head.norm.weight"), self.eps), head)
            outs.append((out, logits))
            prev = out
        return outs


# --------------------------------------------------------------------------------------
# transformers side
# --------------------------------------------------------------------------------------


def load_hf(ckpt, cfg):
    arch = cfg["architectures"][0]
    if arch == "DeepseekV3ForCausalLM":
        cls = transformers.DeepseekV3ForCausalLM
    elif arch == "DeepseekV2ForCausalLM":
        cls = transformers.DeepseekV2ForCausalLM
    else:
        raise SystemExit(f"{ckpt}: unsupported architecture {arch}")
    if cfg.get("quantization_config"):
        raise SystemExit(f"{ckpt}: quantized checkpoints are not supported here (float32 reference only)")
    kw = dict(dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    try:
        model, info = cls.from_pretrained(ckpt, experts_implementation="eager", **kw)
    except TypeError:  # older transformers 5.x without experts_implementation
        model, info = cls.from_pretrained(ckpt, **kw)
    model.eval()
    N = cfg["num_hidden_layers"]
    D = cfg.get("num_nextn_predict_layers", 0) or 0
    missing = sorted(info.get("missing_keys", []))
    mismatched = sorted(str(m) for m in info.get("mismatched_keys", []))
    errors = list(info.get("error_msgs", []))
    mtp_re = re.compile(r"^model\.layers\.(\d+)\.")
    bad_unexpected, mtp_unexpected = [], []
    for k in sorted(info.get("unexpected_keys", [])):
        m = mtp_re.match(k)
        if m and N <= int(m.group(1)) < N + D:
            mtp_unexpected.append(k)
        else:
            bad_unexpected.append(k)
    if missing or mismatched or errors or bad_unexpected:
        raise SystemExit(
            f"{ckpt}: transformers did not load every weight:\n"
            f"  missing (randomly initialised!): {missing}\n  mismatched: {mismatched}\n"
            f"  unexpected (not MTP): {bad_unexpected}\n  errors: {errors}"
        )
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not torch.isfinite(t).all():
            raise SystemExit(f"{ckpt}: non-finite values in {name}")
    return model, {"missing_keys": missing, "mismatched_keys": mismatched, "unexpected_mtp_keys": len(mtp_unexpected)}


def hf_layer_io(model, ids):
    """Inputs and outputs of every target decoder layer (float32) over `ids`."""
    io = {}
    hooks = []
    for l, layer in enumerate(model.model.layers):

        def hook(mod, args, kwargs, out, l=l):
            x = args[0] if args else kwargs["hidden_states"]
            y = out[0] if isinstance(out, tuple) else out
            io[l] = (x[0].detach().clone(), y[0].detach().clone())

        hooks.append(layer.register_forward_hook(hook, with_kwargs=True))
    with torch.no_grad():
        hn = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    for h in hooks:
        h.remove()
    return io, hn


def hf_block_for(model, cfg, raw, l):
    """transformers' own decoder-layer class, float32, with layer l's checkpoint weights."""
    if cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer as Layer
    else:
        from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2DecoderLayer as Layer
    block = Layer(model.config, layer_idx=l).to(torch.float32).eval()
    p = f"model.layers.{l}."
    sd = {}
    E = cfg.get("n_routed_experts") or 0
    for k, v in raw.items():
        if not k.startswith(p):
            continue
        s = k[len(p) :]
        if s.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")) or s.startswith("mlp.experts."):
            continue
        sd[s] = v.to(torch.float32)
    if any(k.startswith(p + "mlp.experts.") for k in raw):
        g = [raw[f"{p}mlp.experts.{e}.gate_proj.weight"] for e in range(E)]
        u = [raw[f"{p}mlp.experts.{e}.up_proj.weight"] for e in range(E)]
        dn = [raw[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)]
        sd["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([a, b], 0) for a, b in zip(g, u)]).float()
        sd["mlp.experts.down_proj"] = torch.stack(dn).float()
    block.load_state_dict(sd, strict=True)
    return block


def hf_block_run(model, block, x, pos):
    """Runs a standalone transformers decoder layer causally over x [T, H] at positions pos."""
    T = x.shape[0]
    pos_ids = pos.view(1, T).long()
    pe = model.model.rotary_emb(x[None], pos_ids)
    mask = torch.full((T, T), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        y = block(x[None], attention_mask=mask, position_ids=pos_ids, position_embeddings=pe)
    return (y[0] if isinstance(y, tuple) else y)[0]


def hf_mtp_f32(model, cfg, raw, ids, h_target):
    """MTP chain with transformers' float32 decoder-layer blocks (cross-check only)."""
    N = cfg["num_hidden_layers"]
    eps = cfg.get("rms_norm_eps", 1e-6)
    T = len(ids)
    prev = h_target.float()

    def rms(x, w):
        return Oracle.rms(x, w.float(), eps)

    outs = []
    for d in range(cfg.get("num_nextn_predict_layers", 0) or 0):
        l = N + d
        p = f"model.layers.{l}."
        n = T - 1 - d
        emb_w = raw.get(p + "embed_tokens.weight", raw["model.embed_tokens.weight"]).float()
        e = emb_w[torch.tensor(ids[d + 1 : d + 1 + n])].clone()
        e[0] = 0.0
        x = torch.cat([rms(e, raw[p + "enorm.weight"]), rms(prev[:n], raw[p + "hnorm.weight"])], -1)
        x = x @ raw[p + "eh_proj.weight"].float().T
        block = hf_block_for(model, cfg, raw, l)
        out = hf_block_run(model, block, x, torch.arange(n))
        head = raw.get(p + "shared_head.head.weight")
        if head is None:
            head = raw.get("lm_head.weight", raw["model.embed_tokens.weight"])
        head = head.float()
        logits = rms(out, raw[p + "shared_head.norm.weight"]) @ head.T
        outs.append((out, logits))
        prev = out
    return outs


# --------------------------------------------------------------------------------------
# notes on transformers behaviour, per preset
# --------------------------------------------------------------------------------------


def behaviour_notes(cfg, model, oracle):
    c = cfg
    v3 = oracle.v3
    rp = oracle.rp
    notes = []
    hf_rope = model.model.rotary_emb
    notes.append(
        f"rope: type={rp['rope_type']} factor={rp.get('factor')} (used as given; only recomputed as "
        f"max_position_embeddings/original ({c['max_position_embeddings']}/{rp.get('original_max_position_embeddings')}) "
        f"when factor is null) attention_factor(cos/sin multiplier)={hf_rope.attention_scaling!r} "
        f"softmax_scale={model.model.layers[0].self_attn.scaling!r} = (qk_nope+rope)^-0.5 * mscale(factor, mscale_all_dim)^2"
    )
    notes.append(f"rope inv_freq (transformers, float32) = {[float(x) for x in hf_rope.inv_freq]}")
    if v3:
        notes.append(
            f"rope layout V3: rope_interleave={getattr(model.config, 'rope_interleave', True)}: pairs (x[2i], x[2i+1]) "
            "rotated by angle pos*inv_freq[i]; output de-interleaved [even', odd'] for q_pe and k_pe alike"
        )
        notes.append(
            "router V3: sigmoid; choice = scores + e_score_correction_bias; group score = sum of top-2 choice per "
            "group; keep topk_group groups (others -inf); top-k of choice; weights = unbiased sigmoid scores, "
            f"/ (sum + 1e-20) if norm_topk_prob (= {c.get('norm_topk_prob')}), then * routed_scaling_factor "
            f"(= {c.get('routed_scaling_factor')}); topk_method={c.get('topk_method')!r}/scoring_func="
            f"{c.get('scoring_func')!r} are ignored by transformers"
        )
    else:
        notes.append("rope layout V2: complex multiply on pairs (x[2i], x[2i+1]); output stays interleaved")
        notes.append(
            f"router V2: softmax (scoring_func={c.get('scoring_func')!r} ignored); topk_method={c.get('topk_method')!r}; "
            "group_limited_greedy: group score = max per group, masked experts filled with 0.0; "
            f"weights * routed_scaling_factor (= {c.get('routed_scaling_factor')}); norm_topk_prob "
            f"(= {c.get('norm_topk_prob')}) is IGNORED (never normalised)"
        )
        if c.get("norm_topk_prob"):
            notes.append(
                "WARNING: norm_topk_prob=true in a V2 config: transformers ignores it, DeepSeek's own V2 code "
                "normalises and then skips routed_scaling_factor; goldens follow transformers"
            )
    notes.append(
        "q_a_layernorm and kv_a_layernorm use eps=1e-6 (transformers' default), not config.rms_norm_eps "
        f"(= {c.get('rms_norm_eps')})"
    )
    notes.append(
        "MoE iff layer_idx >= first_k_dense_replace (moe_layer_freq ignored); per-expert checkpoint weights "
        "mlp.experts.{e}.{gate,up,down}_proj.weight are merged at load into mlp.experts.gate_up_proj "
        "[E, 2*I, H] (= cat(gate_e, up_e) on dim 0) and mlp.experts.down_proj [E, H, I]"
    )
    return notes


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top2_gap(logits):
    s = logits.double().sort(-1, descending=True).values
    return float((s[:, 0] - s[:, 1]).min())


def dump_json(obj):
    """Indented JSON with lists of scalars kept on one line."""
    text = json.dumps(obj, indent=1)
    return re.sub(
        r"\[\s*([-+0-9.eE]+(?:,\s*[-+0-9.eE]+)*)\s*\]",
        lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]",
        text,
    )


def maxerr(a, b):
    return float((a.double() - b.double()).abs().max())


def relerr(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def run_preset(name, ckpt, outdir, argv):
    with open(os.path.join(ckpt, "config.json")) as f:
        cfg = json.load(f)
    V, H = cfg["vocab_size"], cfg["hidden_size"]
    N = cfg["num_hidden_layers"]
    D = cfg.get("num_nextn_predict_layers", 0) or 0
    log(f"=== {name}: {ckpt} ({cfg['architectures'][0]}, {N} layers, {D} MTP layers)")
    if L_LEN <= (rope_params(cfg).get("original_max_position_embeddings") or 0):
        log(f"  note: long case ({L_LEN}) is not longer than original_max_position_embeddings")

    raw = load_raw(ckpt)
    model, loading = load_hf(ckpt, cfg)
    log(f"  loaded: no missing/mismatched keys; {loading['unexpected_mtp_keys']} unexpected keys, all MTP layers")
    oracle = Oracle(cfg, raw)

    pids, dids, lids = prompt_ids(V), decode_ids(V), long_ids(V)
    seq = pids + dids  # T = 48, for the decode consistency check and MTP
    checks = {}
    gold = {}
    with torch.no_grad():
        # 1. prefill
        hid = model.model(input_ids=torch.tensor([pids])).last_hidden_state[0]
        logits = model(input_ids=torch.tensor([pids])).logits[0]
        checks["prefill_logits_vs_lm_head(prefill_hidden)"] = maxerr(model.lm_head(hid), logits)
        gold["prefill_logits"], gold["prefill_hidden"] = logits, hid

        # 2. decode with the cache, one token per call
        out = model(input_ids=torch.tensor([pids]), use_cache=True)
        cache = out.past_key_values
        steps = []
        for t in dids:
            out = model(input_ids=torch.tensor([[t]]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[0, -1])
        gold["decode_logits"] = torch.stack(steps)
        full = model(input_ids=torch.tensor([seq])).logits[0]
        checks["decode_logits_vs_full_forward_max_abs"] = maxerr(gold["decode_logits"], full[P_LEN : P_LEN + N_DECODE])

        # 3. long prompt
        gold["long_logits"] = model(input_ids=torch.tensor([lids])).logits[0]

    # float64 oracle vs transformers, whole model
    o_hid, o_logits = oracle.target(pids)
    checks["oracle_f64_vs_hf_prefill_logits_max_abs"] = maxerr(o_logits, gold["prefill_logits"])
    checks["oracle_f64_vs_hf_prefill_hidden_max_abs"] = maxerr(o_hid, gold["prefill_hidden"])
    _, o_long = oracle.target(lids)
    checks["oracle_f64_vs_hf_long_logits_max_abs"] = maxerr(o_long, gold["long_logits"])
    s_hid, s_logits = oracle.target(seq)
    checks["oracle_f64_vs_hf_decode_logits_max_abs"] = maxerr(s_logits[P_LEN : P_LEN + N_DECODE], gold["decode_logits"])

    # float64 block vs transformers' own layers (inputs captured inside the HF forward)
    io, hf_seq_hidden = hf_layer_io(model, seq)
    pos = torch.arange(len(seq), dtype=torch.float64)
    blk = {}
    for l in range(N):
        x, y = io[l]
        mine = oracle.block(l, x.double(), pos)
        blk[f"layer{l}"] = {"max_abs": maxerr(mine, y), "max_rel": relerr(mine, y), "moe": oracle.is_moe(l)}
    checks["block_f64_vs_hf_layer"] = blk
    checks["oracle_f64_vs_hf_target_hidden_T48_max_abs"] = maxerr(s_hid, hf_seq_hidden)

    log(f"  prefill logits  f64 oracle vs transformers: max abs {checks['oracle_f64_vs_hf_prefill_logits_max_abs']:.3e}")
    log(f"  long logits     f64 oracle vs transformers: max abs {checks['oracle_f64_vs_hf_long_logits_max_abs']:.3e}")
    log(f"  decode logits   f64 oracle vs transformers: max abs {checks['oracle_f64_vs_hf_decode_logits_max_abs']:.3e}")
    log(f"  decode (cache) vs full forward, transformers: max abs {checks['decode_logits_vs_full_forward_max_abs']:.3e}")
    for k, v in blk.items():
        log(f"  f64 block vs transformers {k} ({'MoE' if v['moe'] else 'dense'}): max abs {v['max_abs']:.3e}, rel {v['max_rel']:.3e}")

    mtp_info = None
    margins = oracle.margins
    if D > 0:
        outs = oracle.mtp(seq, s_hid)
        margins = json.loads(json.dumps(oracle.margins))  # before the random-input block checks below
        mchk = {}
        # the same float64 block code on the MTP layers vs transformers' layer class with those weights
        hf_outs = hf_mtp_f32(model, cfg, raw, seq, hf_seq_hidden)
        for d, ((o_out, o_lg), (h_out, h_lg)) in enumerate(zip(outs, hf_outs)):
            gold[f"mtp{d}_hidden"] = o_out
            gold[f"mtp{d}_logits"] = o_lg
            l = N + d
            n = len(seq) - 1 - d
            # isolated block check on the MTP layer: same input for both
            x_in = torch.randn(n, H, generator=torch.Generator().manual_seed(l), dtype=torch.float64)
            y_mine = oracle.block(l, x_in, torch.arange(n, dtype=torch.float64))
            y_hf = hf_block_run(model, hf_block_for(model, cfg, raw, l), x_in.float(), torch.arange(n))
            mchk[f"mtp{d}"] = {
                "block_f64_vs_hf_layer_class_random_input_max_abs": maxerr(y_mine, y_hf),
                "hidden_f64_vs_hf_blocks_f32_max_abs": maxerr(o_out, h_out),
                "logits_f64_vs_hf_blocks_f32_max_abs": maxerr(o_lg, h_lg),
            }
            log(
                f"  mtp{d}: f64 block vs transformers layer (layer {l}, random input) max abs "
                f"{mchk[f'mtp{d}']['block_f64_vs_hf_layer_class_random_input_max_abs']:.3e}; "
                f"chain logits f64 vs transformers-blocks f32 max abs {mchk[f'mtp{d}']['logits_f64_vs_hf_blocks_f32_max_abs']:.3e}"
            )
        checks["mtp"] = mchk
        mtp_info = {
            "layers": D,
            "token_ids": "prompt_ids + decode_ids (T = 48)",
            "target_hidden": "float64: the hand-written float64 oracle's final-normed target hidden states "
            "of the 48 tokens (not the float32 transformers ones)",
            "computed_by": "float64 oracle in make_goldens.py (transformers has no DeepSeek MTP layers)",
            "convention": "layer d runs over positions j = 0..T-2-d (RoPE position j, causal over its own sequence); "
            "x_j = eh_proj(concat[enorm(embed_d(t_{j+d+1})), hnorm(h_j)]) (embedding first); embed_d = "
            "model.layers.{N+d}.embed_tokens.weight if present else model.embed_tokens.weight; the embedding is "
            "zeroed where position j == 0 (every MTP layer, as vLLM's inputs_embeds[positions == 0] = 0); "
            "h = final-normed target hidden for d = 0, previous MTP layer's block output for d > 0; "
            "mtp{d}_hidden = block output (residual added, before shared_head.norm); "
            "mtp{d}_logits = shared_head.head(shared_head.norm(mtp{d}_hidden))",
        }

    checks["routing_min_gaps_f64"] = margins
    checks["logits_min_top1_top2_gap"] = {k: top2_gap(v) for k, v in gold.items() if k.endswith("logits")}
    notes = behaviour_notes(cfg, model, oracle)
    for n_ in notes:
        log("  * " + n_)

    # write
    pdir = os.path.join(outdir, name)
    os.makedirs(pdir, exist_ok=True)
    tensors = {k: v.detach().to(torch.float32).contiguous() for k, v in gold.items()}
    save_file(tensors, os.path.join(pdir, "golden.safetensors"), metadata={"preset": name})
    os.chmod(os.path.join(pdir, "golden.safetensors"), 0o644)
    desc = {
        "prefill_logits": "transformers float32 logits at every position of prompt_ids",
        "prefill_hidden": "transformers float32 model.model(prompt_ids).last_hidden_state (after the final norm)",
        "decode_logits": "transformers float32: prefill prompt_ids with use_cache, then one forward per token of "
        "decode_ids with past_key_values; row i = logits after feeding decode_ids[i] (position 40 + i)",
        "long_logits": "transformers float32 logits at every position of long_ids",
    }
    for d in range(D):
        desc[f"mtp{d}_hidden"] = f"float64 oracle, MTP layer {d} block output, rows j = 0..{len(seq) - 2 - d}"
        desc[f"mtp{d}_logits"] = f"float64 oracle, MTP layer {d} logits, rows j = 0..{len(seq) - 2 - d}"
    meta = {
        "preset": name,
        "architecture": cfg["architectures"][0],
        "prompt_ids": pids,
        "decode_ids": decode_ids(V),
        "long_ids": lids,
        "tensors": {k: {"shape": list(v.shape), "dtype": "float32", "what": desc[k]} for k, v in tensors.items()},
        "mtp": mtp_info,
        "checks": checks,
        "transformers_settings": {"dtype": "float32", "device": "cpu", "attn_implementation": "eager",
                                  "experts_implementation": "eager", "loading": loading},
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "numpy": np.__version__,
        },
        "command": " ".join(argv),
        "checkpoint_sha256": {
            fn: sha256_file(os.path.join(ckpt, fn))
            for fn in sorted(os.listdir(ckpt))
            if fn.endswith((".safetensors", ".json"))
        },
        "config": cfg,
        "transformers_behaviour": notes,
    }
    with open(os.path.join(pdir, "golden.json"), "w") as f:
        f.write(dump_json(meta) + "\n")
    size = os.path.getsize(os.path.join(pdir, "golden.safetensors"))
    log(f"  wrote {pdir}/golden.safetensors ({size} bytes) and golden.json")
    return checks


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (one subdirectory per preset)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    ap.add_argument("--tol", type=float, default=1e-3,
                    help="fail if the float64 oracle and transformers differ by more than this (max abs, logits)")
    ap.add_argument("checkpoints", nargs="+", metavar="[NAME=]DIR")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, python {platform.python_version()}")
    failed = []
    for spec in a.checkpoints:
        name, _, d = spec.rpartition("=")
        d = os.path.abspath(d)
        name = name or os.path.basename(d.rstrip("/"))
        checks = run_preset(name, d, a.out, ["python", "tools/reference/make_goldens.py"] + sys.argv[1:])
        worst = max(
            [checks["oracle_f64_vs_hf_prefill_logits_max_abs"], checks["oracle_f64_vs_hf_long_logits_max_abs"],
             checks["oracle_f64_vs_hf_decode_logits_max_abs"], checks["decode_logits_vs_full_forward_max_abs"]]
            + [v["logits_f64_vs_hf_blocks_f32_max_abs"] for v in checks.get("mtp", {}).values()]
        )
        if worst > a.tol:
            failed.append(f"{name}: oracle/transformers disagreement {worst:.3e} > {a.tol}")
    if failed:
        raise SystemExit("FAILED:\n  " + "\n  ".join(failed))
    log("all presets OK")


if __name__ == "__main__":
    main()
