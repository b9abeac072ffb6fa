"""A cold start imports only what it uses (issue 42): reading a model's config and building it
on the meta device no longer import transformers' modeling machinery, torch._dynamo or sympy
(loader/config_import.py, loader/meta_build.py), and every config is still the one transformers
builds."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from serverless_llm.engine.loader import ResolvedModel, load_hf_config
from serverless_llm.engine.loader.meta_build import quiet_meta
from serverless_llm.engine.models.registry import ENCODER_FAMILIES, MODEL_REGISTRY
from serverless_llm.engine.multimodal.registry import VISION_FAMILIES, vision_family_of

# What a start used to import for nothing: ~2 s of CPU on the 2-core machine (docs/benchmarks.md)
HEAVY = ("transformers.activations", "torch._dynamo", "torch.distributed.tensor", "sympy")


def _run(code: str, *args: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_engine_start_to_first_token_imports_nothing_heavy(tiny_llama):
    """The engine's whole path: imports, config, model on meta, weights, tokenizer, one token."""
    got = _run(
        """
        import json, sys
        import serverless_llm.worker.handler  # noqa: F401 - the worker's imports
        from serverless_llm import LLM, SamplingParams
        HEAVY = json.loads(sys.argv[2])
        before = [m for m in HEAVY if m in sys.modules]
        llm = LLM(sys.argv[1], device="cpu", num_kv_blocks=64, max_model_len=256)
        out = llm.generate("Hello", SamplingParams(max_tokens=1, temperature=0))
        print(json.dumps({"before": before, "after": [m for m in HEAVY if m in sys.modules],
                          "outputs": len(out[0].outputs[0].token_ids)}))
        """,
        tiny_llama,
        json.dumps(HEAVY),
    )
    assert got["outputs"] >= 1
    assert got["before"] == [], got  # the worker's imports
    assert got["after"] == [], got  # config, build on meta, load, tokenizer, a step


def test_deferred_activations_still_validate_and_import_on_use(tiny_llama):
    got = _run(
        """
        import json, sys
        from serverless_llm.engine.loader import ResolvedModel, load_hf_config
        from serverless_llm.engine.loader.config_import import activations_imported
        d = sys.argv[1]
        config = load_hf_config(ResolvedModel(d, d, "safetensors", d))
        deferred = not activations_imported()
        from transformers.utils import type_validators
        try:
            field = type_validators.activation_fn_key(default="silu")
            field.metadata["validator"][0]("not-an-activation")
            bad = "accepted"
        except Exception as e:
            bad = type(e).__name__
        import transformers.activations as acts
        print(json.dumps({
            "model_type": config.model_type,
            "deferred": deferred,
            "bad_name": bad,
            "silu_ok": "silu" in type_validators.ACT2FN,
            "real_module": type(acts.ACT2FN).__name__,
            "same_table": dict(type_validators.ACT2FN).keys() == acts.ACT2FN.keys(),
            "imported_after_use": activations_imported(),
        }))
        """,
        tiny_llama,
    )
    assert got["model_type"] == "llama"
    assert got["deferred"], got
    assert got["bad_name"] == "ValueError", got  # the validator reads the real table
    assert got["silu_ok"] and got["same_table"], got
    assert got["real_module"] == "ClassInstantier", got  # a later import gets the real module
    assert got["imported_after_use"], got


def _served_model_types() -> dict[str, str]:
    """model_type -> one served architecture of it, from transformers' auto mappings."""
    served = set(MODEL_REGISTRY) | set(ENCODER_FAMILIES)
    vision_family_of(["LlavaForConditionalGeneration"])  # loads the vision registry
    served |= set(VISION_FAMILIES)
    types: dict[str, str] = {}
    for name in sorted(dir(modeling_auto)):
        mapping = getattr(modeling_auto, name)
        if not (name.endswith("_MAPPING_NAMES") and isinstance(mapping, dict)):
            continue
        for model_type, archs in mapping.items():
            for arch in archs if isinstance(archs, (list, tuple)) else [archs]:
                if arch in served and model_type in CONFIG_MAPPING:
                    types.setdefault(model_type, arch)
    return types


def test_every_served_config_reads_the_same_with_activations_deferred(tmp_path):
    """Each served model type's default config, saved and read back in a fresh process (the
    activations and transformers' model index deferred) and here (transformers imported as usual): the same config."""
    dirs = {}
    for model_type, arch in _served_model_types().items():
        config = CONFIG_MAPPING[model_type]()
        config.architectures = [arch]
        path = tmp_path / model_type
        config.save_pretrained(path)
        dirs[model_type] = str(path)
    assert len(dirs) >= 60, sorted(dirs)  # the decoders, encoders and vision families
    (tmp_path / "dirs.json").write_text(json.dumps(dirs))
    got = _run(
        """
        import json, sys
        from serverless_llm.engine.loader import ResolvedModel, load_hf_config
        from serverless_llm.engine.loader.config_import import (
            activations_imported, models_index_deferred)
        dirs = json.load(open(sys.argv[1]))
        out = {}
        for t, d in dirs.items():
            out[t] = load_hf_config(ResolvedModel(d, d, "safetensors", d)).to_dict()
        print(json.dumps({"configs": out, "activations": activations_imported(),
                          "index_deferred": models_index_deferred()}, default=str))
        """,
        str(tmp_path / "dirs.json"),
    )
    assert got["index_deferred"]  # every config read without transformers' model index
    importlib.import_module("transformers.activations")  # here the usual way

    for model_type, path in dirs.items():
        here = load_hf_config(ResolvedModel(path, path, "safetensors", path)).to_dict()
        here = json.loads(json.dumps(here, default=str))
        assert got["configs"][model_type] == here, model_type


def test_deferred_model_index_answers_and_gives_way_to_the_real_package(tiny_llama):
    """After a config read with transformers' model index deferred, the package still answers
    every way code reaches it: a submodule by its path, a name imported through the stand-in, a
    name only the index knows; the first such read puts the real package in its place."""
    got = _run(
        """
        import json, sys
        from serverless_llm.engine.loader import ResolvedModel, load_hf_config
        from serverless_llm.engine.loader.config_import import models_index_deferred
        d = sys.argv[1]
        load_hf_config(ResolvedModel(d, d, "safetensors", d))
        out = {"deferred": models_index_deferred()}
        from transformers.models.mistral.configuration_mistral import MistralConfig
        out["by_path"] = MistralConfig().model_type
        out["still_deferred"] = models_index_deferred()
        import transformers
        out["through_standin"] = transformers.models.llama.LlamaConfig.__name__
        out["after_submodule"] = models_index_deferred()  # llama: imported by the read
        from transformers.models import gemma  # not imported yet: the index answers
        out["index_name"] = gemma.GemmaConfig.__name__
        out["after_read"] = models_index_deferred()
        out["real"] = type(sys.modules["transformers.models"]).__name__
        out["parent_real"] = transformers.models is sys.modules["transformers.models"]
        out["kept"] = transformers.models.mistral.MistralConfig is MistralConfig
        print(json.dumps(out))
        """,
        tiny_llama,
    )
    assert got["deferred"] and got["still_deferred"] and got["after_submodule"], got
    assert got["by_path"] == "mistral" and got["through_standin"] == "LlamaConfig", got
    assert got["index_name"] == "GemmaConfig", got
    assert not got["after_read"] and got["real"] == "_LazyModule" and got["parent_real"], got
    assert got["kept"], got


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 8)
        self.proj = torch.nn.Linear(8, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.register_buffer("steps", torch.arange(5))
        self.t = torch.nn.Parameter(torch.empty(8, 6).t())  # not contiguous: left as it was


def test_quiet_meta_builds_and_materializes_the_same_model():
    with torch.device("meta"):
        plain = _Tiny().to(torch.bfloat16).to_empty(device="cpu")
    with torch.device("meta"), quiet_meta():
        built = _Tiny()
    with quiet_meta():
        quiet = built.to(torch.bfloat16).to_empty(device="cpu")
    a, b = dict(plain.named_parameters()), dict(quiet.named_parameters())
    a.update(plain.named_buffers())
    b.update(quiet.named_buffers())
    assert a.keys() == b.keys()
    for name in a:
        assert (a[name].shape, a[name].dtype, a[name].device, a[name].stride()) == (
            b[name].shape,
            b[name].dtype,
            b[name].device,
            b[name].stride(),
        ), name
    # Off the meta device the initialisers still run
    torch.manual_seed(0)
    with quiet_meta():
        real = torch.nn.Embedding(1000, 16)
    assert 0.9 < real.weight.std().item() < 1.1


def test_quiet_meta_imports_nothing_heavy():
    got = _run(
        """
        import json, sys, torch
        from serverless_llm.engine.loader.meta_build import quiet_meta
        with torch.device("meta"), quiet_meta():
            m = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
        with quiet_meta():
            m.to(torch.float16).to_empty(device="cpu")
        print(json.dumps([n for n in ("sympy", "torch._dynamo") if n in sys.modules]))
        """
    )
    assert got == []


def test_a_config_read_before_any_deferral_is_unchanged(tiny_llama):
    """In this process transformers' modeling modules are imported already: nothing deferred."""
    from serverless_llm.engine.loader.config_import import defer_activations

    importlib.import_module("transformers.activations")
    assert defer_activations() is False
    config = load_hf_config(ResolvedModel(tiny_llama, tiny_llama, "safetensors", tiny_llama))
    assert config.to_dict() == transformers.AutoConfig.from_pretrained(tiny_llama).to_dict()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
