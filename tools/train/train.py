#!/usr/bin/env python3
"""Trains mlaserve's bundled model: a small DeepSeek-V3-architecture LM with 3 MTP layers.

Everything runs in one process, inside one wall-clock budget (default 555 s from start):

  1. data: every *.py file under the Python installations of the machine (stdlib and
     site-packages), deduplicated by content, split into train / held-out by a hash of
     the content (deterministic); each file is one document: BOS + tokens + EOS.
  2. tokenizer: byte-level BPE trained here with `tokenizers` (vocab --vocab, special
     tokens <｜begin▁of▁sentence｜> = 0 and <｜end▁of▁sentence｜> = 1).
  3. model: transformers' DeepseekV3ForCausalLM (MLA with q_lora, sigmoid noaux_tc
     group-limited MoE with a shared expert, first layer dense) plus 3 MTP layers built
     from transformers' DeepseekV3DecoderLayer, trained with DeepSeek's MTP objective
     loss = CE_main + lambda * mean_d CE_d, bf16 autocast, AdamW, cosine LR over the
     training time budget, aux-loss-free load balancing (bias update on
     e_score_correction_bias).
  4. export in HF layout (per-expert weight names, MTP layers at model.layers.{N+d}),
     bf16 safetensors shards <= 15 MB + index, config.json, generation_config.json,
     tokenizer.json, tokenizer_config.json; reload check with transformers.
  5. evaluation on the reloaded export in float32: held-out CE (main and per MTP layer)
     and teacher-forced greedy MTP acceptance on held-out code prompts; README.md and
     eval.json are written into the export.

MTP convention (as vLLM and SGLang read DeepSeek-V3; tools/reference/make_goldens.py `Oracle.mtp`):
MTP layer d runs over its own positions j (RoPE position j, causal) with input
x_j = eh_proj(concat[enorm(embed(t_{j+d+1})), hnorm(h^d_j)]) -- embedding first -- the
embedding zeroed at j == 0; h^0 = the target's final-normed last hidden state, h^d (d>0)
= MTP layer d-1's block output (residual added, before shared_head.norm);
logits_j = shared_head.head(shared_head.norm(block_out_j)) predict t_{j+d+2}.

Usage (device):  python3 tools/train/train.py --out "$OUT"
Usage (smoke):   python tools/train/train.py --smoke --out /tmp/smoke
"""

import time

T_START = time.time()

import argparse  # noqa: E402
import hashlib  # noqa: E402
import glob  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import sysconfig  # noqa: E402
import tarfile  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import tokenizers  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: E402
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as mdv3  # noqa: E402

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
BOS_ID, EOS_ID = 0, 1

LOG_FILE = None


def log(msg=""):
    line = f"[{time.time() - T_START:7.1f}s] {msg}"
    print(line, flush=True)
    if LOG_FILE is not None:
        with open(LOG_FILE, "a") as f:
            f.write(line + "\n")


def elapsed():
    return time.time() - T_START


# --------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------


def model_config(a):
    """The exported config.json (also what the training model is built from)."""
    if a.smoke:
        dims = dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
                    num_attention_heads=8, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=8,
                    qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=16)
    else:
        dims = dict(hidden_size=256, intermediate_size=768, moe_intermediate_size=64, num_hidden_layers=8,
                    num_attention_heads=8, kv_lora_rank=128, q_lora_rank=128, qk_rope_head_dim=16,
                    qk_nope_head_dim=32, v_head_dim=48, n_routed_experts=16)
    cfg = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": a.vocab,
        "hidden_size": dims["hidden_size"],
        "intermediate_size": dims["intermediate_size"],
        "moe_intermediate_size": dims["moe_intermediate_size"],
        "num_hidden_layers": dims["num_hidden_layers"],
        "num_attention_heads": dims["num_attention_heads"],
        "num_key_value_heads": dims["num_attention_heads"],
        "n_shared_experts": 1,
        "n_routed_experts": dims["n_routed_experts"],
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": dims["kv_lora_rank"],
        "q_lora_rank": dims["q_lora_rank"],
        "qk_rope_head_dim": dims["qk_rope_head_dim"],
        "v_head_dim": dims["v_head_dim"],
        "qk_nope_head_dim": dims["qk_nope_head_dim"],
        "topk_method": "noaux_tc",
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 4,
        "moe_layer_freq": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": a.seq_len,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 3,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "bfloat16",
    }
    for k in ("vocab_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads"):
        assert cfg[k] % 8 == 0, (k, cfg[k])
    return cfg


def load_hf_config(cfg, tmpdir):
    """DeepseekV3Config parsed from config.json exactly as from_pretrained would."""
    os.makedirs(tmpdir, exist_ok=True)
    with open(os.path.join(tmpdir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    return DeepseekV3Config.from_pretrained(tmpdir)


# --------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------


def default_roots():
    roots = set()
    for pat in ("/usr/lib/python3*", "/usr/local/lib/python3*"):
        roots.update(p for p in glob.glob(pat) if os.path.isdir(p))
    paths = sysconfig.get_paths()
    for k in ("stdlib", "purelib", "platlib"):
        if paths.get(k) and os.path.isdir(paths[k]):
            roots.add(paths[k])
    roots = sorted(os.path.realpath(r) for r in roots)
    # drop roots inside other roots
    out = []
    for r in roots:
        if not any(r != o and r.startswith(o.rstrip("/") + "/") for o in roots):
            out.append(r)
    return sorted(set(out))


def collect_files(roots, max_file_bytes, min_file_bytes, read_cap=float("inf")):
    paths = []
    for r in roots:
        n0 = len(paths)
        for dirpath, dirnames, filenames in os.walk(r, followlinks=False):
            dirnames.sort()
            for fn in sorted(filenames):
                if fn.endswith(".py"):
                    p = os.path.join(dirpath, fn)
                    if os.path.islink(p):
                        continue
                    paths.append(p)
        log(f"  {r}: {len(paths) - n0} .py files")

    def read(p):
        try:
            sz = os.path.getsize(p)
            if sz < min_file_bytes or sz > max_file_bytes:
                return None
            with open(p, "rb") as f:
                b = f.read()
            t = b.decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        if "\x00" in t:
            return None
        return p, t, hashlib.sha1(b).hexdigest()

    # read in a path-hash order until read_cap bytes: bounds the I/O when there is far more code than needed
    paths.sort(key=lambda p: hashlib.sha1(p.encode()).hexdigest())
    res, nbytes = [], 0
    with ThreadPoolExecutor(16) as ex:
        for i in range(0, len(paths), 4096):
            part = [r for r in ex.map(read, paths[i : i + 4096], chunksize=64) if r is not None]
            res += part
            nbytes += sum(len(r[1]) for r in part)
            if nbytes > read_cap:
                log(f"  read cap reached after {i + 4096} of {len(paths)} paths ({nbytes / 1e6:.0f} MB)")
                break
    seen = {}
    for p, t, h in res:  # paths are in sorted walk order: keep the first path of each content
        if h not in seen:
            seen[h] = (p, t, h)
    docs = sorted(seen.values(), key=lambda x: x[2])  # deterministic order: by content hash
    return docs, len(paths), len(res)


def is_heldout(sha, pct):
    return int(sha[:8], 16) % 10000 < int(round(pct * 100))


# --------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------


def train_tokenizer(texts, vocab):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID
    return tok


def tokenize_docs(tok, texts, batch=2048, time_cap=None):
    """Token ids per text; stops (at a batch boundary) once time_cap seconds have passed."""
    enc = getattr(tok, "encode_batch_fast", tok.encode_batch)
    out = []
    t0 = time.time()
    for i in range(0, len(texts), batch):
        if time_cap is not None and time.time() - t0 > time_cap:
            log(f"WARNING: tokenization time cap reached: {len(out)} of {len(texts)} files used")
            break
        for e in enc(texts[i : i + batch], add_special_tokens=False):
            out.append(np.asarray(e.ids, dtype=np.int32))
    return out


def pack(docs_ids):
    parts = []
    for ids in docs_ids:
        parts.append(np.array([BOS_ID], dtype=np.int32))
        parts.append(ids)
        parts.append(np.array([EOS_ID], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


# --------------------------------------------------------------------------------------
# model pieces
# --------------------------------------------------------------------------------------


def grouped_mm(x, w, offs):
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x, w, offs=offs)
    return torch._grouped_mm(x, w, offs=offs)


def experts_forward_fast(self, hidden_states, top_k_index, top_k_weights):
    """Same math as transformers' DeepseekV3Experts (silu(gate) * up -> down, weighted), with
    tokens sorted by expert and bf16 grouped matmuls when autocast is on (training only)."""
    T, H = hidden_states.shape
    k = top_k_index.shape[1]
    E = self.gate_up_proj.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok_idx = order // k
    counts = torch.bincount(flat, minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    cdt = torch.get_autocast_dtype("cuda" if hidden_states.is_cuda else "cpu") if torch.is_autocast_enabled(
        hidden_states.device.type) else self.gate_up_proj.dtype
    x = hidden_states[tok_idx].to(cdt)
    w1 = self.gate_up_proj.to(cdt).transpose(1, 2)  # [E, H, 2I]
    w2 = self.down_proj.to(cdt).transpose(1, 2)  # [E, I, H]
    if self._mla_use_grouped:
        h1 = grouped_mm(x, w1, offs)
        g, u = h1.chunk(2, dim=-1)
        h2 = grouped_mm(F.silu(g) * u, w2, offs)
    else:
        ends = offs.tolist()
        outs, start = [], 0
        for e in range(E):
            end = ends[e]
            if end > start:
                g, u = (x[start:end] @ w1[e]).chunk(2, dim=-1)
                outs.append((F.silu(g) * u) @ w2[e])
            start = end
        h2 = torch.cat(outs, 0)
    h2 = h2.float() * top_k_weights.reshape(-1)[order].float()[:, None]
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return h2[inv].view(T, k, H).sum(1).to(hidden_states.dtype)


def patch_experts(module, use_grouped):
    for m in module.modules():
        if isinstance(m, mdv3.DeepseekV3Experts):
            m.forward = types.MethodType(experts_forward_fast, m)
            m._mla_use_grouped = use_grouped


class MTPLayer(nn.Module):
    """One DeepSeek MTP module: enorm, hnorm, eh_proj, a transformers decoder block,
    shared_head.norm; the head is the main lm_head in training (shared, as in DeepSeek-V3)
    and its exported copy (shared_head.head) in evaluation."""

    def __init__(self, config, layer_idx, with_head=False):
        super().__init__()
        H = config.hidden_size
        eps = config.rms_norm_eps
        self.enorm = mdv3.DeepseekV3RMSNorm(H, eps=eps)
        self.hnorm = mdv3.DeepseekV3RMSNorm(H, eps=eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        self.block = mdv3.DeepseekV3DecoderLayer(config, layer_idx=layer_idx)
        self.shared_head_norm = mdv3.DeepseekV3RMSNorm(H, eps=eps)
        self.head = nn.Linear(H, config.vocab_size, bias=False) if with_head else None


def causal_mask_for(config, n, device, dtype):
    if config._attn_implementation == "eager":
        m = torch.full((n, n), torch.finfo(dtype).min, device=device, dtype=dtype).triu(1)
        return m[None, None]
    return None  # sdpa: is_causal


def mtp_chain(model, mtps, ids, h, n):
    """MTP block outputs [B, n_d, H] for each layer d, n_d = min(n, L - 1 - d), L = ids.shape[1].

    Layer d, position j: x_j = eh_proj(cat[enorm(E[ids[j+d+1]]), hnorm(prev[j])]) with the
    embedding zeroed at j == 0, prev = h (final-normed target hidden) for d = 0, else the
    previous layer's block output; RoPE position j, causal over its own sequence."""
    outs = []
    prev = h
    L = ids.shape[1]
    for d, m in enumerate(mtps):
        nd = min(n, L - 1 - d)
        e = model.model.embed_tokens(ids[:, d + 1 : d + 1 + nd])
        keep = torch.ones(nd, device=e.device, dtype=e.dtype)
        keep[0] = 0.0
        e = e * keep[None, :, None]
        x = m.eh_proj(torch.cat([m.enorm(e), m.hnorm(prev[:, :nd])], dim=-1)).float()
        pos = torch.arange(nd, device=x.device)[None]
        pe = model.model.rotary_emb(x, pos)  # float32 cos/sin, as for the main model
        mask = causal_mask_for(model.config, nd, x.device, x.dtype)
        y = m.block(x, attention_mask=mask, position_ids=pos, position_embeddings=pe, use_cache=False)
        y = y[0] if isinstance(y, tuple) else y
        outs.append(y)
        prev = y
    return outs


def mtp_logits(model, m, y):
    head = m.head if m.head is not None else model.lm_head
    return head(m.shared_head_norm(y))


def init_like_hf(model, module):
    for sub in module.modules():
        model._init_weights(sub)


# --------------------------------------------------------------------------------------
# export
# --------------------------------------------------------------------------------------


def export_state(model, mtps, cfg):
    """HF-layout tensors: per-expert names, MTP layers at model.layers.{N+d}, bf16 except the
    router's e_score_correction_bias (float32, as transformers keeps it)."""
    N = cfg["num_hidden_layers"]
    I = cfg["moe_intermediate_size"]
    out = {}

    def put(name, t):
        t = t.detach().to("cpu")
        if name.endswith("e_score_correction_bias"):
            t = t.to(torch.float32)
        else:
            t = t.to(torch.bfloat16)
        out[name] = t.contiguous()

    def put_block(prefix, sd):
        for k, v in sd.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                base = prefix + k[: -len("gate_up_proj")]
                for e in range(v.shape[0]):
                    put(f"{base}{e}.gate_proj.weight", v[e, :I])
                    put(f"{base}{e}.up_proj.weight", v[e, I:])
            elif k.endswith("mlp.experts.down_proj"):
                base = prefix + k[: -len("down_proj")]
                for e in range(v.shape[0]):
                    put(f"{base}{e}.down_proj.weight", v[e])
            else:
                put(prefix + k, v)

    sd = model.state_dict()
    main = {k: v for k, v in sd.items() if not k.startswith("model.layers.")}
    for k, v in main.items():
        put(k, v)
    for l in range(N):
        p = f"model.layers.{l}."
        put_block(p, {k[len(p):]: v for k, v in sd.items() if k.startswith(p)})
    for d, m in enumerate(mtps):
        p = f"model.layers.{N + d}."
        put(p + "enorm.weight", m.enorm.weight)
        put(p + "hnorm.weight", m.hnorm.weight)
        put(p + "eh_proj.weight", m.eh_proj.weight)
        put_block(p, m.block.state_dict())
        put(p + "shared_head.norm.weight", m.shared_head_norm.weight)
        put(p + "shared_head.head.weight", model.lm_head.weight)
    return out


def layer_key(name):
    parts = name.split(".")
    if name.startswith("model.embed_tokens"):
        return (-1, name)
    if name.startswith("model.layers."):
        return (int(parts[2]), name)
    return (10**6, name)


def write_shards(tensors, outdir, max_bytes):
    names = sorted(tensors, key=layer_key)
    shards, cur, cur_bytes = [], [], 0
    for n in names:
        b = tensors[n].numel() * tensors[n].element_size()
        if cur and cur_bytes + b > max_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(n)
        cur_bytes += b
    if cur:
        shards.append(cur)
    weight_map, files = {}, []
    total = 0
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, os.path.join(outdir, fn), metadata={"format": "pt"})
        files.append(fn)
        for n in group:
            weight_map[n] = fn
            total += tensors[n].numel() * tensors[n].element_size()
    with open(os.path.join(outdir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    return files


def load_raw(ckpt):
    with open(os.path.join(ckpt, "model.safetensors.index.json")) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    raw = {}
    for fn in files:
        with safe_open(os.path.join(ckpt, fn), framework="pt") as sf:
            for k in sf.keys():
                raw[k] = sf.get_tensor(k)
    return raw


def mtp_from_export(model, raw, cfg, device):
    """MTP layers rebuilt from the exported tensors (transformers' block class, float32)."""
    N, D, E = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"], cfg["n_routed_experts"]
    mtps = []
    for d in range(D):
        l = N + d
        p = f"model.layers.{l}."
        m = MTPLayer(model.config, l, with_head=True)
        blk = {}
        for k, v in raw.items():
            if not k.startswith(p):
                continue
            s = k[len(p):]
            if s.startswith(("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.", "mlp.experts.")):
                continue
            blk[s] = v.float()
        blk["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([raw[f"{p}mlp.experts.{e}.gate_proj.weight"], raw[f"{p}mlp.experts.{e}.up_proj.weight"]], 0)
             for e in range(E)]).float()
        blk["mlp.experts.down_proj"] = torch.stack([raw[f"{p}mlp.experts.{e}.down_proj.weight"] for e in range(E)]).float()
        m.block.load_state_dict(blk, strict=True)
        with torch.no_grad():
            m.enorm.weight.copy_(raw[p + "enorm.weight"].float())
            m.hnorm.weight.copy_(raw[p + "hnorm.weight"].float())
            m.eh_proj.weight.copy_(raw[p + "eh_proj.weight"].float())
            m.shared_head_norm.weight.copy_(raw[p + "shared_head.norm.weight"].float())
            m.head.weight.copy_(raw[p + "shared_head.head.weight"].float())
        mtps.append(m.to(device=device, dtype=torch.float32).eval())
    return mtps


# --------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------


@torch.no_grad()
def heldout_loss(model, mtps, stream, T, D, batch, max_tokens, device, autocast):
    L = T + D + 1
    n_chunks = min(len(stream) // L, max(1, max_tokens // T))
    if n_chunks == 0:
        return None
    data = torch.from_numpy(stream[: n_chunks * L].astype(np.int64)).view(n_chunks, L)
    tot = np.zeros(1 + D)
    cnt = 0
    for i in range(0, n_chunks, batch):
        b = data[i : i + batch].to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            h = model.model(input_ids=b[:, :T], use_cache=False).last_hidden_state
            lm = F.cross_entropy(model.lm_head(h).float().flatten(0, 1), b[:, 1 : T + 1].flatten(), reduction="sum")
            ys = mtp_chain(model, mtps, b, h, T)
            ls = [lm]
            for d, (m, y) in enumerate(zip(mtps, ys)):
                lg = mtp_logits(model, m, y).float()
                ls.append(F.cross_entropy(lg.flatten(0, 1), b[:, d + 2 : d + 2 + T].flatten(), reduction="sum"))
        tot += np.array([float(x) for x in ls])
        cnt += b.shape[0] * T
    return {"tokens": cnt, "main_ce": tot[0] / cnt, "mtp_ce": [float(x) for x in tot[1:] / cnt]}


@torch.no_grad()
def greedy_generate(model, prompts, n_new):
    """prompts [B, P] (same length, no padding); float32, KV cache, argmax; never stops at EOS."""
    out = model(input_ids=prompts, use_cache=True)
    cache = out.past_key_values
    nxt = out.logits[:, -1].argmax(-1)
    gen = [nxt]
    for _ in range(n_new - 1):
        out = model(input_ids=nxt[:, None], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        gen.append(nxt)
    return torch.stack(gen, 1)


@torch.no_grad()
def acceptance(model, mtps, seqs, P, n_new, D):
    """Teacher-forced greedy draft acceptance. seqs [B, P + n_new] = prompt (P ids incl. BOS) +
    the target's greedy continuation. Positions i = P-1 .. P+n_new-2-D (the last prompt
    position, where the first drafts are made after prefill, to the last position whose D
    drafts all land inside the continuation). Draft d (1-based) at i = argmax of MTP layer
    d-1 at its position i (the chain over the whole sequence, true tokens), compared with
    the target's greedy token seqs[i + 1 + d]."""
    B, L = seqs.shape
    h = model.model(input_ids=seqs, use_cache=False).last_hidden_state
    full_argmax = model.lm_head(h).argmax(-1)  # [B, L]
    # consistency: cached greedy generation vs full-forward argmax
    gen_consistency = float((full_argmax[:, P - 1 : L - 1] == seqs[:, P:]).float().mean())
    ys = mtp_chain(model, mtps, seqs, h, L)
    i0, i1 = P - 1, P + n_new - 2 - D  # inclusive
    idx = torch.arange(i0, i1 + 1, device=seqs.device)
    correct = []
    for d in range(D):
        lg = mtp_logits(model, mtps[d], ys[d])  # [B, L-1-d, V]
        draft = lg[:, idx].argmax(-1)
        truth = seqs[:, idx + 2 + d]
        correct.append((draft == truth))
    C = torch.stack(correct, -1).cpu().numpy()  # [B, n_pos, D] bool
    flat = C.reshape(-1, D)
    uncond = [float(flat[:, d].mean()) for d in range(D)]
    cond = []
    prefix_all = np.ones(flat.shape[0], dtype=bool)
    for d in range(D):
        reached = prefix_all.sum()
        cond.append(float(flat[prefix_all, d].mean()) if reached else float("nan"))
        prefix_all = prefix_all & flat[:, d]
    # accepted prefix length a in [0, D] per position
    a = np.zeros(flat.shape[0], dtype=np.int64)
    alive = np.ones(flat.shape[0], dtype=bool)
    for d in range(D):
        alive = alive & flat[:, d]
        a += alive
    mal = {f"k={k}": float(1 + sum(np.prod(cond[: j + 1]) for j in range(k))) for k in range(1, D + 1)}
    mal_direct = {f"k={k}": float(1 + np.minimum(a, k).mean()) for k in range(1, D + 1)}
    return {
        "positions_per_prompt": int(i1 - i0 + 1),
        "positions_total": int(flat.shape[0]),
        "teacher_forced_acceptance": uncond,
        "conditional_acceptance": cond,
        "mean_acceptance_length": mal,
        "mean_acceptance_length_direct": mal_direct,
        "greedy_cached_vs_full_forward_agreement": gen_consistency,
        "per_position_correct": C.astype(np.int8).tolist(),
    }


# --------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------


def main():
    global LOG_FILE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output folder: export (model/) + log + bundle")
    ap.add_argument("--work", default="/tmp/mla-train-work", help="scratch folder (export assembled here)")
    ap.add_argument("--name", default="mla-tiny-code")
    ap.add_argument("--smoke", action="store_true", help="tiny CPU settings for a local end-to-end test")
    ap.add_argument("--roots", nargs="*", default=None, help="folders to collect *.py from (default: this Python's)")
    ap.add_argument("--deadline", type=float, default=555.0, help="seconds from start by which everything is done")
    ap.add_argument("--eval-reserve", type=float, default=70.0, help="seconds kept for export + evaluation")
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-frac", type=float, default=0.03)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-lambda", type=float, default=0.3)
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free balancing step")
    ap.add_argument("--heldout-pct", type=float, default=2.0, help="percent of files held out (by content hash)")
    ap.add_argument("--max-data-mb", type=float, default=400.0)
    ap.add_argument("--max-file-kb", type=float, default=400.0)
    ap.add_argument("--tokenize-cap-s", type=float, default=75.0, help="time cap for tokenizing the train files")
    ap.add_argument("--tok-sample-mb", type=float, default=40.0, help="text the BPE is trained on")
    ap.add_argument("--eval-prompts", type=int, default=50)
    ap.add_argument("--prompt-tokens", type=int, default=96, help="file tokens per prompt (BOS is added)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--heldout-tokens", type=int, default=1_000_000)
    ap.add_argument("--shard-bytes", type=int, default=14_500_000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.smoke:
        a.vocab = 512 if a.vocab == 4096 else a.vocab
        a.seq_len = 128 if a.seq_len == 1024 else a.seq_len
        a.batch = 4 if a.batch == 64 else a.batch
        a.max_data_mb = min(a.max_data_mb, 3.0)
        a.tok_sample_mb = min(a.tok_sample_mb, 1.5)
        a.heldout_pct = 8.0
        a.eval_prompts = min(a.eval_prompts, 6)
        a.prompt_tokens = 32
        a.new_tokens = 16
        a.heldout_tokens = 20_000

    os.makedirs(a.out, exist_ok=True)
    LOG_FILE = os.path.join(a.out, "train.log")
    open(LOG_FILE, "w").close()
    export_dir = os.path.join(a.work, a.name)  # not under --out: only <= 8 files may come back
    if os.path.exists(export_dir):
        shutil.rmtree(export_dir)
    os.makedirs(export_dir)

    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    log(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    log(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"tokenizers {tokenizers.__version__}, numpy {np.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name()})" if device.type == "cuda" else "")
        + f", cpus {os.cpu_count()}")
    info = {"command": " ".join(["python3"] + sys.argv), "versions": {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__},
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}

    # ---------------- data
    roots = a.roots or default_roots()
    log(f"collecting *.py under {roots}")
    docs, n_paths, n_read = collect_files(roots, int(a.max_file_kb * 1024), 64, read_cap=1.6 * a.max_data_mb * 1e6)
    # cap total bytes deterministically (docs sorted by hash)
    cap = int(a.max_data_mb * 1e6)
    total, kept = 0, []
    for d in docs:
        if total + len(d[1]) > cap:
            break
        kept.append(d)
        total += len(d[1])
    docs = kept
    train_docs = [d for d in docs if not is_heldout(d[2], a.heldout_pct)]
    held_docs = [d for d in docs if is_heldout(d[2], a.heldout_pct)]
    log(f"{n_paths} .py files, {n_read} read (utf-8, 64 B..{a.max_file_kb:.0f} KB), {len(docs)} unique used "
        f"({total / 1e6:.1f} MB): train {len(train_docs)} files, held-out {len(held_docs)} files")
    info["data"] = {"roots": roots, "py_files": n_paths, "read_ok": n_read, "unique_files": len(docs),
                    "bytes": total, "train_files": len(train_docs), "heldout_files": len(held_docs),
                    "heldout_rule": f"int(sha1(content)[:8], 16) % 10000 < {int(round(a.heldout_pct * 100))}",
                    "file_filter": f"*.py, utf-8, no NUL, 64 B <= size <= {a.max_file_kb:.0f} KB, deduplicated by sha1"}

    # ---------------- tokenizer
    sample, sb = [], 0
    for d in train_docs:  # hash order = a deterministic pseudo-random sample
        if sb > a.tok_sample_mb * 1e6:
            break
        sample.append(d[1])
        sb += len(d[1])
    tok = train_tokenizer(sample, a.vocab)
    log(f"tokenizer: BPE trained on {len(sample)} files ({sb / 1e6:.1f} MB), vocab {tok.get_vocab_size()}")
    if tok.get_vocab_size() != a.vocab:
        log(f"WARNING: tokenizer vocab {tok.get_vocab_size()} != {a.vocab} (model vocab stays {a.vocab})")
    tok.save(os.path.join(export_dir, "tokenizer.json"))
    tok = Tokenizer.from_file(os.path.join(export_dir, "tokenizer.json"))
    bad = 0
    for d in held_docs[:200]:
        if tok.decode(tok.encode(d[1], add_special_tokens=False).ids, skip_special_tokens=False) != d[1]:
            bad += 1
    log(f"tokenizer round trip: {min(200, len(held_docs)) - bad}/{min(200, len(held_docs))} held-out files exact")
    held_ids = tokenize_docs(tok, [d[1] for d in held_docs])
    train_ids = tokenize_docs(tok, [d[1] for d in train_docs], time_cap=a.tokenize_cap_s)
    if len(train_ids) < len(train_docs):
        train_docs = train_docs[: len(train_ids)]
    train_stream = pack(train_ids)
    held_stream = pack(held_ids)
    log(f"tokens: train {len(train_stream):,} ({total / max(1, len(train_stream) + len(held_stream)):.2f} bytes/token), "
        f"held-out {len(held_stream):,}")
    info["data"].update({"train_files_tokenized": len(train_ids), "train_tokens": int(len(train_stream)), "heldout_tokens": int(len(held_stream)),
                         "tokenizer_sample_files": len(sample), "tokenizer_sample_bytes": sb,
                         "roundtrip_bad": bad})

    # ---------------- model
    cfg = model_config(a)
    N, D = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    hf_cfg = load_hf_config(cfg, os.path.join(a.work, "_cfg"))
    hf_cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(hf_cfg)
    mtps = nn.ModuleList([MTPLayer(model.config, N + d) for d in range(D)])
    init_like_hf(model, mtps)
    model.to(device)
    mtps.to(device)
    n_params = sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in mtps.parameters())
    exp_params = n_params + D * cfg["vocab_size"] * cfg["hidden_size"]  # + exported head copies
    log(f"model: {N} layers + {D} MTP layers, {n_params / 1e6:.2f}M trained parameters, "
        f"{exp_params / 1e6:.2f}M exported ({exp_params * 2 / 1e6:.1f} MB bf16)")
    for nm, p in list(model.named_parameters()) + list(mtps.named_parameters()):
        assert torch.isfinite(p).all(), nm

    # experts kernel: grouped bf16 matmuls if they work here, else a per-expert loop
    use_grouped = False
    try:
        ref_ex = model.model.layers[1].mlp.experts
        xx = torch.randn(300, cfg["hidden_size"], device=device, requires_grad=True)
        ti = torch.stack([torch.randperm(cfg["n_routed_experts"], device=device)[:4] for _ in range(300)])
        tw = torch.rand(300, 4, device=device)
        with torch.no_grad():  # reference: the transformers expert math, float32, token by token
            I = cfg["moe_intermediate_size"]
            w1 = ref_ex.gate_up_proj[ti]  # [300, 4, 2I, H]
            g_u = torch.einsum("th,tkih->tki", xx, w1)
            act = F.silu(g_u[..., :I]) * g_u[..., I:]
            ref = (torch.einsum("tki,tkhi->tkh", act, ref_ex.down_proj[ti]) * tw[..., None]).sum(1)
        probe = types.SimpleNamespace(gate_up_proj=ref_ex.gate_up_proj, down_proj=ref_ex.down_proj, _mla_use_grouped=True)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            got = experts_forward_fast(probe, xx, ti, tw)
        got.float().sum().backward()
        err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
        use_grouped = err < 3e-2 and torch.isfinite(xx.grad).all().item()
        log(f"grouped_mm experts: rel err vs transformers {err:.2e} -> {'grouped_mm' if use_grouped else 'loop'}")
        model.zero_grad(set_to_none=True)
    except Exception as ex:  # noqa: BLE001
        log(f"grouped_mm experts unavailable ({type(ex).__name__}: {ex}); per-expert loop")
    patch_experts(model, use_grouped)
    patch_experts(mtps, use_grouped)
    info["experts_kernel"] = "grouped_mm (bf16)" if use_grouped else "per-expert loop"

    # routing counts for aux-loss-free balancing
    routers = [m for m in list(model.modules()) + list(mtps.modules()) if isinstance(m, mdv3.DeepseekV3TopkRouter)]
    E = cfg["n_routed_experts"]
    counts = torch.zeros(len(routers), E, device=device)

    def make_hook(i):
        def hook(mod, inp, out):
            if mod.training:
                counts[i] += torch.bincount(out[2].reshape(-1), minlength=E).float()
        return hook

    for i, r in enumerate(routers):
        r.register_forward_hook(make_hook(i))

    params = [p for p in list(model.parameters()) + list(mtps.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    T, B = a.seq_len, a.batch
    L = T + D + 1
    gpu_stream = torch.from_numpy(train_stream.astype(np.int64)).to(device)
    n_chunks = len(train_stream) // L
    g = torch.Generator(device="cpu").manual_seed(a.seed)
    perm = torch.randperm(n_chunks, generator=g)
    ptr, epoch = 0, 0
    ar = torch.arange(L, device=device)

    def next_batch():
        nonlocal ptr, perm, epoch
        if ptr + B > n_chunks:
            perm = torch.randperm(n_chunks, generator=g)
            ptr = 0
            epoch += 1
        idx = perm[ptr : ptr + B].to(device) * L
        ptr += B
        return gpu_stream[idx[:, None] + ar[None, :]]

    train_end = a.deadline - a.eval_reserve
    t0 = time.time()
    budget = train_end - elapsed()
    log(f"training: batch {B} x {T} tokens (+{D + 1} for MTP targets), {n_chunks} chunks/epoch, "
        f"budget {budget:.0f} s, lr {a.lr} cosine to {a.min_lr_frac * a.lr:g}, warmup {a.warmup_frac:.0%}, "
        f"lambda {a.mtp_lambda}, bias gamma {a.bias_gamma}")
    if budget < 10:
        raise SystemExit("no time left for training")
    model.train()
    mtps.train()
    step, tokens_seen = 0, 0
    hist = []
    last_log = time.time()
    ac_dtype = torch.bfloat16
    train_error = None
    while True:
        frac = (time.time() - t0) / budget
        if frac >= 1.0:
            break
        if frac < a.warmup_frac:
            lr = a.lr * max(frac / a.warmup_frac, 0.01)
        else:
            q = (frac - a.warmup_frac) / (1 - a.warmup_frac)
            lr = a.lr * (a.min_lr_frac + (1 - a.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * q)))
        for grp in opt.param_groups:
            grp["lr"] = lr
        try:
            b = next_batch()
            with torch.autocast(device.type, dtype=ac_dtype):
                h = model.model(input_ids=b[:, :T], use_cache=False).last_hidden_state
                loss_main = F.cross_entropy(model.lm_head(h).float().flatten(0, 1), b[:, 1 : T + 1].flatten())
                ys = mtp_chain(model, mtps, b, h, T)
                loss_mtp = [F.cross_entropy(mtp_logits(model, m, y).float().flatten(0, 1),
                                            b[:, d + 2 : d + 2 + T].flatten())
                            for d, (m, y) in enumerate(zip(mtps, ys))]
                loss = loss_main + a.mtp_lambda * sum(loss_mtp) / D
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
        except torch.OutOfMemoryError:
            if step >= 3 or B <= 4:
                train_error = traceback.format_exc()
                log("TRAINING STOPPED (out of memory):\n" + train_error)
                break
            del b
            h = ys = loss = loss_main = loss_mtp = None
            opt.zero_grad(set_to_none=True)
            counts.zero_()
            torch.cuda.empty_cache()
            B //= 2
            log(f"out of memory at step {step}: batch halved to {B}")
            continue
        except Exception:  # noqa: BLE001 -- keep what was trained, export it
            train_error = traceback.format_exc()
            log("TRAINING STOPPED (error):\n" + train_error)
            break
        step += 1
        tokens_seen += B * T
        do_log = step == 1 or step % 50 == 0 or time.time() - last_log > 30
        with torch.no_grad():  # aux-loss-free balancing: push overloaded experts down, underloaded up
            for i, r in enumerate(routers):
                r.e_score_correction_bias.sub_(a.bias_gamma * torch.sign(counts[i] - counts[i].mean()))
            c = counts.clone() if do_log else None
            counts.zero_()
        if do_log:
            lm, lmt = float(loss_main), [float(x) for x in loss_mtp]
            dt = time.time() - t0
            imb = float((c.max(1).values / c.mean(1).clamp_min(1)).mean())
            mem = f" mem {torch.cuda.max_memory_allocated() / 2**30:.1f}GiB" if device.type == "cuda" else ""
            log(f"step {step} ep {epoch} {frac:.1%} lr {lr:.2e} loss {lm:.4f} mtp {' '.join(f'{x:.3f}' for x in lmt)} "
                f"gnorm {float(gn):.2f} {tokens_seen / dt / 1e3:.0f}k tok/s maxload/mean {imb:.2f}{mem}")
            hist.append({"step": step, "t": round(dt, 1), "lr": lr, "loss": lm, "mtp": lmt, "maxload_over_mean": imb})
            last_log = time.time()
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_wall = time.time() - t0
    log(f"trained {step} steps, {tokens_seen:,} tokens ({tokens_seen / max(1, len(train_stream)):.2f} epochs) "
        f"in {train_wall:.1f} s ({tokens_seen / train_wall / 1e3:.0f}k tok/s)")
    bias_range = [(float(r.e_score_correction_bias.min()), float(r.e_score_correction_bias.max())) for r in routers]
    info["training"] = {"steps": step, "tokens": tokens_seen, "epochs": tokens_seen / max(1, len(train_stream)),
                        "wall_s": train_wall, "batch": B, "seq_len": T, "lr": a.lr, "min_lr_frac": a.min_lr_frac,
                        "warmup_frac": a.warmup_frac, "weight_decay": a.weight_decay, "mtp_lambda": a.mtp_lambda,
                        "bias_gamma": a.bias_gamma, "history": hist, "final_bias_range": bias_range,
                        "trained_params": n_params, "exported_params": exp_params, "error": train_error}
    del gpu_stream

    # ---------------- export (before anything that may fail)
    model.eval()
    mtps.eval()
    with open(os.path.join(export_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
        f.write("\n")
    with open(os.path.join(export_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "do_sample": False}, f, indent=2)
        f.write("\n")
    with open(os.path.join(export_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "model_max_length": cfg["max_position_embeddings"], "add_bos_token": True}, f, indent=2)
        f.write("\n")
    tensors = export_state(model, mtps, cfg)
    shard_files = write_shards(tensors, export_dir, a.shard_bytes)
    sizes = {fn: os.path.getsize(os.path.join(export_dir, fn)) for fn in shard_files}
    log(f"exported {len(tensors)} tensors in {len(shard_files)} shards: {sizes}")
    info["export"] = {"shards": sizes, "tensors": len(tensors)}
    bundle(a, export_dir, shard_files)  # a first bundle, in case evaluation dies

    # ---------------- reload + evaluation (float32, exported bf16 weights)
    try:
        evaluate(a, cfg, export_dir, model, mtps, tok, held_docs, held_ids, held_stream, device, info)
    except Exception:  # noqa: BLE001
        log("EVALUATION FAILED:\n" + traceback.format_exc())
        info["eval_error"] = traceback.format_exc()
    info["total_wall_s"] = elapsed()
    write_readme(a, cfg, export_dir, info)
    with open(os.path.join(export_dir, "eval.json"), "w") as f:
        json.dump(info, f)
    bundle(a, export_dir, shard_files)
    log(f"done in {elapsed():.1f} s")


def evaluate(a, cfg, export_dir, train_model, train_mtps, tok, held_docs, held_ids, held_stream, device, info):
    N, D = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    T = a.seq_len
    # held-out loss of the training model (bf16 autocast, fp32 master weights)
    r_train = heldout_loss(train_model, train_mtps, held_stream, T, D, 8, min(a.heldout_tokens, 262144), device,
                           autocast=True)
    log(f"held-out (training model, bf16 autocast, {r_train['tokens']} tokens): main {r_train['main_ce']:.4f} "
        f"mtp {' '.join(f'{x:.4f}' for x in r_train['mtp_ce'])}")
    info["heldout_train_model_bf16"] = r_train
    del train_model, train_mtps
    if device.type == "cuda":
        torch.cuda.empty_cache()

    kw = dict(dtype=torch.float32, attn_implementation="sdpa", output_loading_info=True)
    try:
        model, li = DeepseekV3ForCausalLM.from_pretrained(export_dir, experts_implementation="eager", **kw)
    except TypeError:
        model, li = DeepseekV3ForCausalLM.from_pretrained(export_dir, **kw)
    model.to(device).eval()
    missing = sorted(li.get("missing_keys", []))
    mismatched = [str(m) for m in li.get("mismatched_keys", [])]
    unexpected = sorted(li.get("unexpected_keys", []))
    bad_unexp = [k for k in unexpected if not (k.startswith("model.layers.") and N <= int(k.split(".")[2]) < N + D)]
    log(f"reload: missing {missing}, mismatched {mismatched}, unexpected non-MTP {bad_unexp}, "
        f"unexpected MTP keys {len(unexpected) - len(bad_unexp)}")
    info["reload"] = {"missing": missing, "mismatched": mismatched, "unexpected_non_mtp": bad_unexp,
                      "unexpected_mtp": len(unexpected) - len(bad_unexp)}
    if missing or mismatched or bad_unexp:
        raise RuntimeError("export does not load cleanly in transformers")
    raw = load_raw(export_dir)
    mtps = mtp_from_export(model, raw, cfg, device)
    del raw

    r = heldout_loss(model, mtps, held_stream, T, D, 8, a.heldout_tokens, device, autocast=False)
    log(f"held-out (export, float32, {r['tokens']} tokens): main CE {r['main_ce']:.4f} (ppl {math.exp(r['main_ce']):.2f}) "
        f"MTP CE {' '.join(f'{x:.4f}' for x in r['mtp_ce'])}")
    info["heldout"] = r

    # prompts: the first held-out files (hash order) with enough tokens
    P = a.prompt_tokens
    chosen = []
    for d, ids in zip(held_docs, held_ids):
        if len(ids) >= P + a.new_tokens:
            chosen.append((d, ids))
        if len(chosen) == a.eval_prompts:
            break
    if len(chosen) < a.eval_prompts:
        log(f"WARNING: only {len(chosen)} held-out files have >= {P + a.new_tokens} tokens")
    prompts = torch.tensor([[BOS_ID] + ids[:P].tolist() for _, ids in chosen], device=device)
    gen = greedy_generate(model, prompts, a.new_tokens)
    seqs = torch.cat([prompts, gen], 1)
    acc = acceptance(model, mtps, seqs, P + 1, a.new_tokens, D)
    eos_in = int((gen == EOS_ID).any(1).sum())
    log(f"acceptance on {len(chosen)} prompts ({P + 1} ids incl. BOS) x {a.new_tokens} greedy tokens, "
        f"{acc['positions_total']} draft positions ({eos_in} continuations contain EOS):")
    log(f"  teacher-forced per draft position: {' '.join(f'{x:.4f}' for x in acc['teacher_forced_acceptance'])}")
    log(f"  conditional P(d ok | 1..d-1 ok):   {' '.join(f'{x:.4f}' for x in acc['conditional_acceptance'])}")
    log(f"  mean acceptance length: {acc['mean_acceptance_length']} (direct {acc['mean_acceptance_length_direct']})")
    log(f"  cached greedy vs full-forward argmax agreement {acc['greedy_cached_vs_full_forward_agreement']:.4f}")
    per_pos = acc.pop("per_position_correct")
    info["acceptance"] = acc
    info["acceptance"]["prompts"] = len(chosen)
    info["acceptance"]["continuations_with_eos"] = eos_in
    info["eval_prompts"] = [{"file": d[0], "sha1": d[2], "prompt_ids": prompts[i].tolist(),
                             "continuation_ids": gen[i].tolist(), "draft_correct": per_pos[i]}
                            for i, (d, _) in enumerate(chosen)]
    for i in range(min(3, len(chosen))):
        log(f"--- sample {i} ({chosen[i][0][0]}):\n{tok.decode(prompts[i, 1:].tolist())}"
            f"<<<GEN>>>{tok.decode(gen[i].tolist())}\n---")
    # demo
    demo = "def fibonacci(n):"
    ids = torch.tensor([[BOS_ID] + tok.encode(demo, add_special_tokens=False).ids], device=device)
    g = greedy_generate(model, ids, 64)
    info["demo"] = {"prompt": demo, "prompt_ids": ids[0].tolist(), "greedy_ids": g[0].tolist(),
                    "greedy_text": tok.decode(g[0].tolist())}
    log(f"demo greedy:\n{demo}{info['demo']['greedy_text']}\n---")


def write_readme(a, cfg, export_dir, info):
    def f4(x):
        return f"{x:.4f}" if isinstance(x, float) else str(x)

    ho = info.get("heldout")
    acc = info.get("acceptance")
    tr = info.get("training", {})
    dt = info.get("data", {})
    lines = [f"# {a.name}", "",
             "A small DeepSeek-V3-architecture model (MLA with q_lora, sigmoid group-limited `noaux_tc` MoE with a "
             "shared expert, first layer dense) with 3 MTP layers, trained from scratch on Python source code by "
             "`tools/train/train.py` in one device call. Weights in HF layout (`DeepseekV3ForCausalLM`, per-expert "
             "names, MTP layers at `model.layers.{N+d}`), bf16 except `e_score_correction_bias` (float32).", "",
             "## Results (float32 evaluation of the exported bf16 weights)", ""]
    if ho:
        lines += [f"- Held-out CE (main model, {ho['tokens']:,} tokens): **{ho['main_ce']:.4f}** nats/token "
                  f"(ppl {math.exp(ho['main_ce']):.2f})",
                  "- Held-out CE per MTP layer d = 0, 1, 2 (layer d predicts the token d + 2 ahead): "
                  + ", ".join(f4(x) for x in ho["mtp_ce"])]
    if acc:
        lines += [f"- Teacher-forced greedy acceptance per draft position (1, 2, 3) over "
                  f"{acc['positions_total']} positions: **" + " / ".join(f"{x:.4f}" for x in acc["teacher_forced_acceptance"]) + "**",
                  "- Conditional acceptance P(draft d right | drafts 1..d-1 right): **"
                  + " / ".join(f"{x:.4f}" for x in acc["conditional_acceptance"]) + "**",
                  "- Mean acceptance length (1 + c1 + c1 c2 + ...), k = 1 / 2 / 3: **"
                  + " / ".join(f"{acc['mean_acceptance_length'][f'k={k}']:.3f}" for k in range(1, 4)) + "**"]
    if "eval_error" in info:
        lines += ["", "Evaluation failed: see eval.json `eval_error`."]
    lines += ["", "## Training", "",
              f"- Command: `{info.get('command')}` (device: {info.get('device')}; versions {info.get('versions')})",
              f"- Data: {dt.get('unique_files')} unique `*.py` files ({dt.get('bytes', 0) / 1e6:.1f} MB) from "
              f"{dt.get('roots')}; {dt.get('file_filter')}; held out: {dt.get('heldout_rule')} -> "
              f"{dt.get('train_files_tokenized', dt.get('train_files'))} train files ({dt.get('train_tokens', 0):,} tokens), {dt.get('heldout_files')} "
              f"held-out files ({dt.get('heldout_tokens', 0):,} tokens). Each file is one document BOS + tokens + EOS, "
              "concatenated and cut into chunks.",
              f"- Tokenizer: byte-level BPE (`tokenizers`), vocab {cfg['vocab_size']}, trained on "
              f"{dt.get('tokenizer_sample_files')} train files ({dt.get('tokenizer_sample_bytes', 0) / 1e6:.1f} MB); ids 0/1 = BOS/EOS, "
              "no post-processor (the engine adds BOS).",
              f"- Steps {tr.get('steps')}, tokens {tr.get('tokens', 0):,} ({tr.get('epochs', 0):.2f} epochs), "
              f"wall {tr.get('wall_s', 0):.0f} s of training, {info.get('total_wall_s', 0):.0f} s in all; batch "
              f"{tr.get('batch')} x {tr.get('seq_len')}; AdamW (0.9, 0.95), lr {tr.get('lr')} cosine to "
              f"{tr.get('min_lr_frac')} x over the time budget, warmup {tr.get('warmup_frac')}, wd {tr.get('weight_decay')}, "
              f"clip 1.0, bf16 autocast; loss = CE + {tr.get('mtp_lambda')} x mean_d CE_d; aux-loss-free balancing "
              f"(bias -= {tr.get('bias_gamma')} x sign(load - mean load) per step); experts kernel "
              f"{info.get('experts_kernel')}.",
              f"- Parameters: {tr.get('trained_params', 0) / 1e6:.2f}M trained (MTP heads share lm_head and embeddings, "
              f"as in DeepSeek-V3), {tr.get('exported_params', 0) / 1e6:.2f}M exported (each MTP layer has a copy of lm_head "
              "as `shared_head.head`; no MTP `embed_tokens`, the engine uses `model.embed_tokens`)."]
    hist = tr.get("history") or []
    if hist:
        last = hist[-1]
        lines += [f"- Final training loss (last logged step {last['step']}): main {last['loss']:.4f}, MTP "
                  + ", ".join(f"{x:.3f}" for x in last["mtp"])]
    lines += ["", "## Config", "", "```json", json.dumps(cfg, indent=1), "```", ""]
    with open(os.path.join(export_dir, "README.md"), "w") as f:
        f.write("\n".join(lines))


def bundle(a, export_dir, shard_files):
    """$OUT: the shards as they are, every small file of the export in bundle.tar."""
    for fn in shard_files:
        shutil.copy(os.path.join(export_dir, fn), os.path.join(a.out, fn))
    with tarfile.open(os.path.join(a.out, "bundle.tar"), "w") as tf:
        for fn in sorted(os.listdir(export_dir)):
            if fn not in shard_files:
                tf.add(os.path.join(export_dir, fn), arcname=fn)


if __name__ == "__main__":
    main()
