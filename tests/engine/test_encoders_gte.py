"""gte's "NewModel" layout (gte-base-en-v1.5, gte-multilingual-base; issue 41 item 2). transformers
does not ship it and its own code lives in the checkpoints' repositories, so the reference here
is a plain torch forward of the published layout written for this test: per sequence, no
batching tricks. A tiny random checkpoint is saved under gte's tensor names (config.json keeps
model_type "bert" so transformers reads it without any repository code, with the gte keys
beside); the engine's hidden states over a ragged step, and its pooled embeddings, must equal
the reference's (float32, atol 1e-4). Jina's v3 (XLM-R with task LoRA adapters in its remote
code) is refused at start with a ConfigError naming it."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from serverless_llm.engine.config import ConfigError, EngineConfig
from serverless_llm.engine.model_builder import load_model
from serverless_llm.llm import LLM
from tests.engine.test_encoders import _ragged_forward
from tests.tiny_encoders import build_wordpiece_tokenizer
from tests.tiny_models import CORPUS

TEXTS = [CORPUS[0], "hello", CORPUS[2] + " " + CORPUS[7], CORPUS[1]]
H, LAYERS, HEADS, INTER = 64, 2, 4, 96


def _config(vocab: int, **extra) -> dict:
    cfg = {
        "model_type": "bert",
        "architectures": ["NewModel"],
        "vocab_size": vocab,
        "hidden_size": H,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "intermediate_size": INTER,
        "hidden_act": "gelu",
        "max_position_embeddings": 128,
        "type_vocab_size": 1,
        "layer_norm_eps": 1e-12,
        "layer_norm_type": "layer_norm",
        "position_embedding_type": "rope",
        "rope_theta": 500.0,
        "rope_scaling": {"type": "ntk", "factor": 2.0},
        "pack_qkv": True,
        "logn_attention_scale": False,
        "unpad_inputs": True,
        "use_memory_efficient_attention": True,
        "pad_token_id": 0,
    }
    cfg.update(extra)
    return cfg


def _weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors under gte's names (norms away from 1 and 0, so a misplaced norm shows)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=0.08):
        return torch.randn(*shape, generator=g) * scale

    def norm(prefix):
        return {f"{prefix}.weight": 1 + rnd(H, scale=0.1), f"{prefix}.bias": rnd(H, scale=0.1)}

    w = {"embeddings.word_embeddings.weight": rnd(cfg["vocab_size"], H, scale=0.5)}
    if cfg["type_vocab_size"]:
        w["embeddings.token_type_embeddings.weight"] = rnd(cfg["type_vocab_size"], H, scale=0.5)
    if cfg["position_embedding_type"] == "absolute":
        w["embeddings.position_embeddings.weight"] = rnd(cfg["max_position_embeddings"], H)
    w.update(norm("embeddings.LayerNorm"))
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        if cfg["pack_qkv"]:
            w[f"{p}.attention.qkv_proj.weight"] = rnd(3 * H, H)
            w[f"{p}.attention.qkv_proj.bias"] = rnd(3 * H)
        else:
            for n in "qkv":
                w[f"{p}.attention.{n}_proj.weight"] = rnd(H, H)
                w[f"{p}.attention.{n}_proj.bias"] = rnd(H)
        w[f"{p}.attention.o_proj.weight"] = rnd(H, H)
        w[f"{p}.attention.o_proj.bias"] = rnd(H)
        w[f"{p}.mlp.up_gate_proj.weight"] = rnd(2 * INTER, H)
        w[f"{p}.mlp.down_proj.weight"] = rnd(H, INTER)
        w[f"{p}.mlp.down_proj.bias"] = rnd(H)
        w.update(norm(f"{p}.attn_ln"))
        w.update(norm(f"{p}.mlp_ln"))
    return w


def build_gte(path: str, seed: int = 0, classifier_labels: int = 0, **extra) -> str:
    tok = build_wordpiece_tokenizer(path)
    cfg = _config(len(tok), **extra)
    w = _weights(cfg, seed)
    if classifier_labels:
        cfg["architectures"] = ["NewForSequenceClassification"]
        cfg["num_labels"] = classifier_labels
        w = {f"new.{k}": v for k, v in w.items()}
        g = torch.Generator().manual_seed(seed + 1)
        w["new.pooler.dense.weight"] = torch.randn(H, H, generator=g) * 0.1
        w["new.pooler.dense.bias"] = torch.randn(H, generator=g) * 0.1
        w["classifier.weight"] = torch.randn(classifier_labels, H, generator=g) * 0.3
        w["classifier.bias"] = torch.randn(classifier_labels, generator=g) * 0.1
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    save_file({k: v.contiguous() for k, v in w.items()}, f"{path}/model.safetensors")
    return path


# -- the reference: gte's forward for one sequence, in plain torch ------------------------------


def _frequencies(cfg: dict, dim: int) -> torch.Tensor:
    """Rotary frequencies of the layout: base rope_theta; with NTK scaling of factor f, either
    the base times f and each frequency over f^(2/dim), or (mixed, exponent b) the base kept
    and the i-th frequency (i from 1) over exp(ln(f) * (i / (dim / 2))^b)."""
    base = cfg["rope_theta"]
    exps = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    scaling = cfg.get("rope_scaling")
    if not scaling:
        return (1.0 / base**exps).float()
    f, b = scaling["factor"], scaling.get("mixed_b")
    if b is None:
        return (1.0 / (base * f) ** exps / f ** (2 / dim)).float()
    i = torch.arange(1, dim // 2 + 1, dtype=torch.float64)
    return (1.0 / base**exps / torch.exp(math.log(f) * (i / (dim / 2)) ** b)).float()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + turned * sin


def reference_hidden(cfg: dict, w: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Final hidden states [n, H] of one sequence."""
    n, d = len(ids), H // HEADS
    x = w["embeddings.word_embeddings.weight"][ids]
    if cfg["type_vocab_size"]:
        x = x + w["embeddings.token_type_embeddings.weight"][0]
    if cfg["position_embedding_type"] == "absolute":
        x = x + w["embeddings.position_embeddings.weight"][:n]
    ln = "embeddings.LayerNorm"
    x = F.layer_norm(x, (H,), w[f"{ln}.weight"], w[f"{ln}.bias"], cfg["layer_norm_eps"])
    angles = torch.arange(n).float()[:, None] * _frequencies(cfg, d)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    for i in range(LAYERS):
        p = f"encoder.layer.{i}"
        if cfg["pack_qkv"]:
            qkv = F.linear(
                x, w[f"{p}.attention.qkv_proj.weight"], w[f"{p}.attention.qkv_proj.bias"]
            )
            q, k, v = qkv.split(H, dim=-1)
        else:
            q, k, v = (
                F.linear(x, w[f"{p}.attention.{t}_proj.weight"], w[f"{p}.attention.{t}_proj.bias"])
                for t in "qkv"
            )
        q, k, v = (t.view(n, HEADS, d).transpose(0, 1) for t in (q, k, v))  # [heads, n, d]
        if cfg["position_embedding_type"] == "rope":
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        probs = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(d), dim=-1)
        ctx = (probs @ v).transpose(0, 1).reshape(n, H)
        x = x + F.linear(ctx, w[f"{p}.attention.o_proj.weight"], w[f"{p}.attention.o_proj.bias"])
        x = F.layer_norm(x, (H,), w[f"{p}.attn_ln.weight"], w[f"{p}.attn_ln.bias"], 1e-12)
        up, gate = F.linear(x, w[f"{p}.mlp.up_gate_proj.weight"]).split(INTER, dim=-1)
        mlp = F.linear(
            F.gelu(gate) * up, w[f"{p}.mlp.down_proj.weight"], w[f"{p}.mlp.down_proj.bias"]
        )
        x = F.layer_norm(x + mlp, (H,), w[f"{p}.mlp_ln.weight"], w[f"{p}.mlp_ln.bias"], 1e-12)
    return x


def _saved(path: str) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    w = load_file(f"{path}/model.safetensors")
    return cfg, {k.removeprefix("new."): v for k, v in w.items()}


VARIANTS = {
    "ntk": {},
    "ntk-mixed": {"rope_scaling": {"type": "ntk", "factor": 3.0, "mixed_b": 0.7}},
    "rope-plain-separate-qkv": {"rope_scaling": None, "pack_qkv": False},
    "absolute": {"position_embedding_type": "absolute", "type_vocab_size": 0},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gte_hidden_states_and_embeddings_equal_the_reference(variant, tmp_path):
    path = build_gte(str(tmp_path / variant), seed=len(variant), **VARIANTS[variant])
    cfg, w = _saved(path)
    loaded = load_model(EngineConfig(model=path, dtype="float32"))
    assert loaded.model.spec.arch == "NewModel"
    llm = LLM(path, dtype="float32", max_model_len=128)
    tok = llm.get_tokenizer()
    ids = [list(tok.encode(t)) for t in TEXTS]
    wants = [reference_hidden(cfg, w, x) for x in ids]
    for got, want in zip(_ragged_forward(loaded.model, ids), wants):  # one ragged step
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    outs = llm.embed(TEXTS)  # CLS pooling (an encoder's default), normalised
    for out, want in zip(outs, wants):
        vec = torch.tensor(out.outputs.embedding)
        torch.testing.assert_close(vec, F.normalize(want[0], dim=-1), atol=1e-4, rtol=1e-4)


def test_gte_cross_encoder_scores_equal_the_reference(tmp_path):
    """NewForSequenceClassification: BERT's pooler (dense + tanh on the first row), then the
    classifier; a one-label head scores pairs (sigmoid of its logit)."""
    path = build_gte(str(tmp_path / "rr"), seed=3, classifier_labels=1)
    cfg, w = _saved(path)
    llm = LLM(path, dtype="float32", max_model_len=128)
    tok = llm.get_tokenizer()
    pairs = [(CORPUS[0], CORPUS[1]), ("hello", CORPUS[2])]
    outs = llm.score([p[0] for p in pairs], [p[1] for p in pairs])
    for (a, b), out in zip(pairs, outs):
        ids = list(tok(a, b)["input_ids"])
        first = reference_hidden(cfg, w, ids)[0]
        pooled = torch.tanh(F.linear(first, w["pooler.dense.weight"], w["pooler.dense.bias"]))
        logit = F.linear(pooled, w["classifier.weight"], w["classifier.bias"])
        assert out.outputs.score == pytest.approx(torch.sigmoid(logit).item(), abs=1e-5)


@pytest.mark.parametrize(
    "extra,named",
    [
        ({"logn_attention_scale": True}, "logn_attention_scale"),
        ({"layer_norm_type": "rms_norm"}, "rms_norm"),
        ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "linear"),
    ],
)
def test_gte_options_not_served_are_refused_at_start(extra, named, tmp_path):
    path = build_gte(str(tmp_path / "bad"), **extra)
    with pytest.raises((ConfigError, ValueError), match=named):
        load_model(EngineConfig(model=path, dtype="float32"))


def test_jina_embeddings_v3_is_refused_with_its_name(tmp_path):
    """jina-embeddings-v3's remote code (XLMRobertaLoRA: XLM-R with per-task LoRA adapters
    chosen per request) is not served: a ConfigError at start names it and says why."""
    path = build_gte(str(tmp_path / "jina"))
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(architectures=["XLMRobertaLoRA"], lora_adaptations=["retrieval.query"])
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ConfigError, match="jina-embeddings-v3") as info:
        load_model(EngineConfig(model=path, dtype="float32"))
    assert "LoRA" in str(info.value)


def test_transformers_gte_port_equals_ours(tmp_path):
    """transformers 5.23 ports NewModel as GteModel (the same tensor names): a tiny random one
    through the same family equals transformers' hidden states over a ragged step."""
    import transformers

    path = str(tmp_path / "port")
    tok = build_wordpiece_tokenizer(path)
    config = transformers.GteConfig(
        vocab_size=len(tok),
        hidden_size=H,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        intermediate_size=INTER,
        max_position_embeddings=128,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    ref = transformers.GteModel(config).eval()
    with torch.no_grad():  # norms away from 1 and 0, so a misplaced norm shows
        for name, p in ref.named_parameters():
            if "norm" in name.lower() or "_ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    ref.save_pretrained(path)
    loaded = load_model(EngineConfig(model=path, dtype="float32"))
    assert loaded.model.spec.arch == "GteModel"
    ids = [list(tok.encode(t)) for t in TEXTS]
    for x, got in zip(ids, _ragged_forward(loaded.model, ids)):
        with torch.no_grad():
            want = ref(torch.tensor([x])).last_hidden_state[0]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
